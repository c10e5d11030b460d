"""Drift: population stability index of the score and the top features.

At training time :func:`build_reference` fixes, for the ensemble score and the
model's most important features, bin edges at the reference window's deciles
and the share of rows in each bin (missing values are a bin of their own). The
reference is written beside the model (``reference.json``, checksummed in the
manifest). While serving, :class:`DriftMonitor` counts the served scores and
feature values into the same bins and, every ``window_rows`` scored rows,
returns a ``drift`` record with the PSI of each:

    PSI = sum over bins of (served% - reference%) * ln(served% / reference%)

Common reading: below 0.1 stable, 0.1-0.25 moderate shift, above 0.25 a
shift worth retraining for. Above ``warn_psi`` the record is flagged and a
warning is logged.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.features import FEATURE_NAMES

__all__ = ["REFERENCE_FILE", "DriftMonitor", "build_reference", "load_reference", "psi", "top_features"]

log = logging.getLogger(__name__)

REFERENCE_FILE = "reference.json"
TOP_FEATURES = 5
QUANTILES = np.linspace(0.0, 1.0, 11)[1:-1]
#: A bin with no rows would make the PSI infinite; it counts as this share instead.
EPSILON = 1e-4


def top_features(importances: dict[str, float], k: int = TOP_FEATURES) -> list[str]:
    return [name for name, _ in sorted(importances.items(), key=lambda kv: -kv[1])[:k]]


def _edges(values: np.ndarray) -> list[float]:
    present = values[~np.isnan(values)]
    if not len(present):
        return []
    return sorted({float(q) for q in np.quantile(present, QUANTILES)})


def _shares(values: np.ndarray, edges: Sequence[float]) -> np.ndarray:
    """Counts per bin: ``len(edges) + 1`` value bins (right-closed at each edge), then missing."""
    values = np.asarray(values, dtype=np.float64)
    missing = np.isnan(values)
    bins = np.searchsorted(np.asarray(edges, dtype=np.float64), values[~missing], side="left")
    counts = np.bincount(bins, minlength=len(edges) + 1).astype(np.float64)
    return np.append(counts, float(missing.sum()))


def build_reference(matrix: np.ndarray, scores: np.ndarray, features: Sequence[str]) -> dict[str, Any]:
    """Bins and shares of the score and ``features`` over a reference window."""
    items: dict[str, dict[str, Any]] = {}
    columns = {"score": np.asarray(scores, dtype=np.float64)}
    for name in features:
        columns[name] = np.asarray(matrix[:, FEATURE_NAMES.index(name)], dtype=np.float64)
    for name, values in columns.items():
        edges = _edges(values)
        counts = _shares(values, edges)
        items[name] = {"edges": edges, "shares": (counts / max(counts.sum(), 1.0)).round(6).tolist()}
    return {"rows": int(len(scores)), "items": items}


def write_reference(folder: Path, reference: dict[str, Any]) -> Path:
    path = folder / REFERENCE_FILE
    folder.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(reference, indent=1) + "\n")
    return path


def load_reference(folder: Path) -> dict[str, Any] | None:
    """The reference beside a model version; None for models trained before it existed."""
    path = folder / REFERENCE_FILE
    return json.loads(path.read_text()) if path.is_file() else None


def psi(reference: Sequence[float], counts: Sequence[float]) -> float:
    ref = np.maximum(np.asarray(reference, dtype=np.float64), EPSILON)
    total = float(np.sum(counts))
    if total <= 0:
        return 0.0
    act = np.maximum(np.asarray(counts, dtype=np.float64) / total, EPSILON)
    return float(np.sum((act - ref) * np.log(act / ref)))


class DriftMonitor:
    """Counts served rows into the reference's bins; a record per full window."""

    def __init__(self, model_version: str, reference: dict[str, Any], *, window_rows: int = 2000,
                 warn_psi: float = 0.25) -> None:  # fmt: skip
        self.model_version = model_version
        self.reference = reference["items"]
        self.window_rows = window_rows
        self.warn_psi = warn_psi
        names = list(self.reference)
        #: Where each item is in a batch's kept values (reference order), and
        #: the feature matrix's columns the features come from.
        self._score_at = names.index("score") if "score" in names else None
        self._feature_at = [i for i, n in enumerate(names) if n != "score"]
        self._columns = [FEATURE_NAMES.index(n) for n in names if n != "score"]
        self._reset()

    def _reset(self) -> None:
        self.rows = 0
        self._kept: list[np.ndarray] = []

    def observe(self, matrix: np.ndarray, scores: np.ndarray) -> dict[str, Any] | None:
        """Keep one batch's values; the window's record once ``window_rows`` are in.

        NOTE: counting into the bins costs a few numpy calls per item whatever
        the rows, ~90 µs a batch for six items: at a batch of one that was ~4 %
        of the scoring loop (docs/performance.md). The values wait here (a
        window's rows: 2,000 x 6 doubles, 96 KB, in one array per batch) and
        are counted once, when the window closes.
        """
        kept = np.empty((len(scores), len(self.reference)), dtype=np.float64)
        kept[:, self._feature_at] = matrix[:, self._columns]
        if self._score_at is not None:
            kept[:, self._score_at] = scores
        self._kept.append(kept)
        self.rows += len(scores)
        if self.rows < self.window_rows:
            return None
        values = np.concatenate(self._kept)
        counts = {n: _shares(values[:, i], r["edges"]) for i, (n, r) in enumerate(self.reference.items())}
        psis = {n: round(psi(r["shares"], list(counts[n])), 4) for n, r in self.reference.items()}
        drifting = sorted(n for n, v in psis.items() if v > self.warn_psi or math.isnan(v))
        record = {"kind": "drift", "model_version": self.model_version, "rows": self.rows, "psi": psis,
                  "warn_psi": self.warn_psi, "drifting": drifting, "warning": bool(drifting)}  # fmt: skip
        if drifting:
            log.warning(
                "drift: PSI above %.2f for %s over the last %d rows (model %s)",
                self.warn_psi, ", ".join(f"{n}={psis[n]}" for n in drifting), self.rows, self.model_version,
            )
        self._reset()
        return record
