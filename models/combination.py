"""How the members' outputs become the ensemble's score.

Two kinds, both recorded in the manifest and applied by
:class:`models.ensemble.XGBoostEnsemble`:

* ``stacked`` (what ``train`` fits): a logistic regression on the members'
  margins (log-odds), ``score = sigmoid(b + sum_i w_i * margin_i)``, with every
  ``w_i >= 0``. It is fitted on *validation* rows, scored by members that never
  saw them (:mod:`models.selection`), never on the test week. Non-negative
  weights because the members are correlated: an unconstrained fit happily
  gives one member +2 and its twin -1, which fits the validation window's noise
  and flips sign on the next week; a weight of 0 drops a member that adds
  nothing. On the log-odds scale the combination stays additive, so the
  members' per-feature contributions add up to the ensemble's (reasons);
* ``mean`` (versions registered before stacking): the weighted mean of the
  members' probabilities, with the weights in each member's manifest entry.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from scipy.optimize import minimize

__all__ = ["MEAN", "STACKED", "Combination", "fit_stacked"]

STACKED = "stacked"
MEAN = "mean"
#: L2 penalty on the weights (per validation row): keeps them finite when the
#: validation window separates perfectly, negligible otherwise.
_L2 = 1e-4


@dataclass(frozen=True)
class Combination:
    kind: str
    weights: tuple[float, ...]
    """Per member, in the members' order."""
    intercept: float = 0.0
    fitted_on: dict[str, Any] = field(default_factory=dict)
    """What the weights were learned on (windows, rows, frauds), for the manifest."""

    def __post_init__(self) -> None:
        if self.kind not in (STACKED, MEAN):
            raise ValueError(f"combination kind {self.kind!r}: this code knows {STACKED!r} and {MEAN!r}")
        if self.kind == MEAN and sum(self.weights) <= 0:
            raise ValueError("a mean needs positive weights")

    def score(self, margins: np.ndarray) -> np.ndarray:
        """Ensemble probabilities from the members' margins (rows x members)."""
        margins = np.asarray(margins, dtype=np.float64)
        w = np.asarray(self.weights, dtype=np.float64)
        if self.kind == STACKED:
            return _sigmoid(self.intercept + margins @ w)
        scores = np.zeros(margins.shape[0], dtype=np.float64)
        for column, weight in zip(margins.T, w / w.sum()):  # in member order, as versions before stacking summed
            scores += weight * _sigmoid(column)
        return scores

    def to_manifest(self, names: Sequence[str]) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "intercept": self.intercept,
            "weights": dict(zip(names, self.weights, strict=True)),
            "fitted_on": self.fitted_on,
        }

    @classmethod
    def from_manifest(cls, entry: dict[str, Any] | None, members: Sequence[dict[str, Any]]) -> Combination:
        """The manifest's combination; a manifest without one (registered before
        stacking) is the weighted mean of probabilities it was trained as."""
        if entry is None:
            return cls(MEAN, tuple(float(m["weight"]) for m in members))
        weights = entry["weights"]
        return cls(
            str(entry["kind"]),
            tuple(float(weights[m["name"]]) for m in members),
            float(entry.get("intercept", 0.0)),
            dict(entry.get("fitted_on", {})),
        )


def fit_stacked(margins: np.ndarray, labels: np.ndarray, fitted_on: dict[str, Any] | None = None) -> Combination:
    """Non-negative logistic regression of ``labels`` on the members' validation margins."""
    x = np.asarray(margins, dtype=np.float64)
    y = np.asarray(labels, dtype=np.float64)
    n, k = x.shape
    if n == 0 or y.min() == y.max():
        raise ValueError("the validation rows hold one class only: the combination cannot be learned")

    def loss(theta: np.ndarray) -> tuple[float, np.ndarray]:
        z = theta[0] + x @ theta[1:]
        # log(1 + e^z) - y z, computed without overflow.
        value = float(np.mean(np.logaddexp(0.0, z) - y * z)) + _L2 * float(theta[1:] @ theta[1:])
        g = _sigmoid(z) - y
        grad = np.concatenate(([g.mean()], x.T @ g / n + 2 * _L2 * theta[1:]))
        return value, grad

    start = np.concatenate(([0.0], np.full(k, 1.0 / k)))
    bounds = [(None, None)] + [(0.0, None)] * k
    result = minimize(loss, start, jac=True, method="L-BFGS-B", bounds=bounds)
    theta = np.asarray(result.x, dtype=np.float64)
    weights = tuple(float(w) for w in np.maximum(theta[1:], 0.0))
    if not any(w > 0 for w in weights):
        raise ValueError("no member's margin separates the validation rows")
    return Combination(STACKED, weights, float(theta[0]), dict(fitted_on or {}))


def _sigmoid(z: np.ndarray) -> np.ndarray:
    # The form versions before stacking were scored with (bit for bit the same
    # scores); a margin below -709 overflows exp to inf and gives 0, as it should.
    with np.errstate(over="ignore"):
        return np.asarray(1.0 / (1.0 + np.exp(-np.asarray(z, dtype=np.float64))), dtype=np.float64)
