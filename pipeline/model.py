"""What the scorer needs of a model: a version and ``predict`` on a feature matrix.

The stages never import an implementation: :mod:`models.ensemble` provides the
XGBoost ensemble, tests provide their own, and both satisfy this protocol.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

__all__ = ["InlineScoring", "Prediction", "ScoringModel"]


@dataclass(frozen=True)
class Prediction:
    scores: np.ndarray
    """Fraud probability per row, float in [0, 1]."""

    reasons: list[list[tuple[str, float]]] = field(default_factory=list)
    """Per row, up to TOP_K (feature name, contribution in log-odds) with positive
    push; empty for rows below the ``explain_above`` asked for (or no list at all)."""


class ScoringModel(Protocol):
    version: str

    def predict(self, features: np.ndarray, explain_above: float | None = 0.0) -> Prediction:
        """Scores per row; reasons for rows scoring at least ``explain_above``
        (None: no reasons, e.g. for a shadow model)."""
        ...


class InlineScoring(Protocol):
    """What a model may offer beside :class:`ScoringModel`: scores cheap and
    bounded enough to compute on the event loop (the scorer looks for it and
    uses it for batches whose rows all score under the review threshold)."""

    def inline_scores(self, features: np.ndarray) -> np.ndarray | None:
        """Fraud probability per row, or None when not available right now."""
        ...
