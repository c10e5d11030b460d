"""One error tree for the whole service.

    FraudPipelineError
    ├── ConfigError              a setting or file is wrong; the operator fixes it
    │   └── RulesError           a rules file failed validation (the old one stays)
    ├── ModelError
    │   ├── ModelNotFound        no such version in the registry
    │   └── ModelIntegrityError  a checksum or the feature list does not match
    ├── FeatureStoreError        the online store failed; decisions degrade
    ├── BatchLookupError         the batch's one Redis call failed; the separate calls take over
    ├── TallyError               the merchant tally could not be read or written; the worker restarts
    └── StackError               a local service did not start or become ready

Validation problems are not exceptions: a bad transaction is an expected input,
returned as a :class:`pipeline.validate.Rejection` value.
"""

from __future__ import annotations

__all__ = [
    "BatchLookupError",
    "ConfigError",
    "FeatureStoreError",
    "FraudPipelineError",
    "ModelError",
    "ModelIntegrityError",
    "ModelNotFound",
    "RulesError",
    "StackError",
    "TallyError",
]


class FraudPipelineError(Exception):
    """Root of every error this project raises on purpose."""


class ConfigError(FraudPipelineError):
    """A setting or configuration file is invalid."""


class RulesError(ConfigError):
    """A rules file failed validation; the rules in force are kept."""

    def __init__(self, path: object, reason: str) -> None:
        super().__init__(f"rules file {path}: {reason}")
        self.path = path
        self.reason = reason


class ModelError(FraudPipelineError):
    """Loading or running a model failed."""


class ModelNotFound(ModelError):
    """The registry holds no such model version."""

    def __init__(self, registry: object, version: str | None, hint: str | None = None) -> None:
        if hint:
            message = f"{registry}: {hint}"
        elif version:
            message = f"{registry} holds no version {version!r}; `fraud-pipeline models list` shows what it holds"
        else:
            message = f"{registry} holds no model version; train one with `fraud-pipeline train`"
        super().__init__(message)
        self.registry = registry
        self.version = version


class ModelIntegrityError(ModelError):
    """A model artifact does not match its manifest; it is refused."""

    def __init__(self, path: object, reason: str) -> None:
        super().__init__(f"refusing model artifact {path}: {reason}")
        self.path = path
        self.reason = reason


class FeatureStoreError(FraudPipelineError):
    """The online feature store could not be read or written."""


class BatchLookupError(FraudPipelineError):
    """The batch's one Redis call (cache, admission, enrichment) failed or made no sense."""

    def __init__(self, size: int, reason: str) -> None:
        super().__init__(f"one-call lookup of {size} transactions: {reason}")
        self.size = size
        self.reason = reason


class TallyError(FraudPipelineError):
    """The merchant tally could not be read or written (agents/tally.py)."""


class StackError(FraudPipelineError):
    """A local service (broker, Redis) failed to start or become ready."""
