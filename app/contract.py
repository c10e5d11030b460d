"""The data contract: what a transaction and a decision look like on the wire.

A *transaction* is a JSON object produced to the ``transactions`` topic, keyed by
``user_id``. A *decision* is a JSON object produced to ``decisions``, keyed by
``transaction_id``. Both are documented with examples in docs/contract.md; this module
is the single definition the rest of the code imports.

Required transaction fields: ``transaction_id``, ``user_id``, ``amount``,
``merchant_id``, ``timestamp``. Optional: ``currency`` (default ``USD``),
``merchant_category``, ``device_id``, ``lat``/``lon`` (both or neither),
``country``. A missing optional field makes the features that need it missing
(NaN), which the models are trained to handle.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

__all__ = [
    "ACTIONS",
    "Action",
    "CURRENCY_TO_USD",
    "Decision",
    "OPTIONAL_FIELDS",
    "REQUIRED_FIELDS",
    "TRAINING_COLUMNS",
    "Transaction",
]

#: Reference rates used to put amounts on one scale for features and rules.
#: NOTE: fixed on purpose: a model trained on USD-equivalent amounts must see the
#: same conversion at serving time. A deployment with live FX would version them.
CURRENCY_TO_USD: dict[str, float] = {
    "USD": 1.0,
    "EUR": 1.08,
    "GBP": 1.27,
    "CHF": 1.13,
    "CAD": 0.73,
    "AUD": 0.66,
    "JPY": 0.0067,
    "SEK": 0.095,
    "NOK": 0.093,
    "DKK": 0.145,
    "PLN": 0.25,
    "BRL": 0.18,
    "MXN": 0.055,
    "INR": 0.012,
}

REQUIRED_FIELDS: tuple[str, ...] = (
    "transaction_id",
    "user_id",
    "amount",
    "merchant_id",
    "timestamp",
)
OPTIONAL_FIELDS: tuple[str, ...] = (
    "currency",
    "merchant_category",
    "device_id",
    "lat",
    "lon",
    "country",
)

#: The training file schema (Parquet): the contract's columns plus ``label``
#: (1 = fraud). ``timestamp`` is stored as ``timestamp[ms, UTC]``. The simulator
#: also writes ``scenario`` (why a row is fraud), which training ignores.
TRAINING_COLUMNS: tuple[str, ...] = (
    "transaction_id",
    "user_id",
    "amount",
    "currency",
    "merchant_id",
    "merchant_category",
    "device_id",
    "lat",
    "lon",
    "country",
    "timestamp",
    "label",
)

Action = Literal["approve", "review", "decline", "reject"]
ACTIONS: tuple[str, ...] = ("approve", "review", "decline", "reject")


@dataclass(frozen=True, slots=True)
class Transaction:
    """A validated transaction. ``timestamp`` is epoch seconds (UTC)."""

    transaction_id: str
    user_id: str
    amount: float
    merchant_id: str
    timestamp: float
    currency: str = "USD"
    merchant_category: str | None = None
    device_id: str | None = None
    lat: float | None = None
    lon: float | None = None
    country: str | None = None

    @property
    def amount_usd(self) -> float:
        return self.amount * CURRENCY_TO_USD[self.currency]


@dataclass(slots=True)
class Decision:
    """What the payment system gets back for one transaction.

    ``fraud_score`` is the ensemble's probability in [0, 1] (0 for rejects).
    ``latency_ms`` holds per-stage timings: queue_wait, validate, cache,
    features, model, rules, total.
    """

    transaction_id: str
    user_id: str | None
    fraud_score: float
    action: Action
    explanation: list[str]
    model_version: str | None
    rules_version: str | None
    cached: bool = False
    degraded: bool = False
    feature_age_s: float | None = None
    latency_ms: dict[str, float] = field(default_factory=dict)
    correlation_id: str | None = None
    decided_at: float = 0.0
    error: dict[str, str | None] | None = None
    provisional: bool = False
    """The decision cache could not be read: maybe a resend of a payment decided
    before, so this decision never approves (``approve`` became ``review``)."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "transaction_id": self.transaction_id,
            "user_id": self.user_id,
            "fraud_score": self.fraud_score,
            "action": self.action,
            "explanation": self.explanation,
            "model_version": self.model_version,
            "rules_version": self.rules_version,
            "cached": self.cached,
            "degraded": self.degraded,
            "feature_age_s": self.feature_age_s,
            "latency_ms": self.latency_ms,
            "correlation_id": self.correlation_id,
            "decided_at": self.decided_at,
            "error": self.error,
            "provisional": self.provisional,
        }
