"""Prequential validation: the members' hyper-parameters and the ensemble's
combination, chosen on windows before the test week.

The Handbook's prequential validation (chapter 5): validation folds slide back
from the training window, each "train 7 days, delay 7, validate 7" and each
one week earlier than the one before. The first fold validates on the training
window itself (labelled, and out of sample for a model fitted two weeks
earlier); none touches the delay or the test week. Each fold's validation rows
are the Handbook's: customers already known compromised are removed.

* Hyper-parameters: each member's grid entries are fitted on every fold's
  training window and scored on its validation rows; the entry with the best
  mean average precision wins (AP: the metric the ensemble is furthest above
  the baseline on, and much steadier across weeks than CP@100).
* Combination: the winning entries' validation margins, pooled over the folds,
  fit :func:`models.combination.fit_stacked`. The members are then refitted on
  the training window (the most recent labels: what a model put in service
  next week should know) with the chosen parameters; their margins stay on the
  scale the weights were fitted on, since each fold model is the same recipe on
  a window of the same length.

Where the data does not reach back far enough for one fold (short files,
feedback), :func:`holdout_fold` splits the training rows by time instead.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import numpy as np
import xgboost as xgb
from sklearn.metrics import average_precision_score

from models.combination import Combination, fit_stacked
from pipeline.features import DAY_S, FEATURE_NAMES

__all__ = ["FoldData", "FoldWindow", "MemberChoice", "fit_member", "holdout_fold", "prequential_windows", "select"]

BASE_PARAMS = {
    "objective": "binary:logistic",
    "eval_metric": "aucpr",
    "tree_method": "hist",
    "max_bin": 256,
}


@dataclass(frozen=True)
class FoldWindow:
    fit: tuple[float, float]
    validate: tuple[float, float]


@dataclass
class FoldData:
    """One fold's matrices; ``keep``: the validation rows the Handbook scores."""

    x_fit: np.ndarray
    y_fit: np.ndarray
    x_val: np.ndarray
    y_val: np.ndarray
    keep: np.ndarray
    window: dict[str, Any]


@dataclass
class MemberChoice:
    name: str
    params: dict[str, Any]
    rounds: int
    features: list[str]
    scores: list[dict[str, Any]]
    """Every grid entry with its mean validation AP, for the report."""


def prequential_windows(
    train_start: float, folds: int, train_days: int, delay_days: int, validate_days: int = 7, step_days: int = 7
) -> list[FoldWindow]:
    """The Handbook's validation folds for a model trained from ``train_start``:
    fold i trains from ``train_start - (delay + validate) - i * step`` days."""
    out = []
    for i in range(folds):
        fit_start = train_start - (delay_days + validate_days + i * step_days) * DAY_S
        fit_end = fit_start + train_days * DAY_S
        val_start = fit_end + delay_days * DAY_S
        out.append(FoldWindow((fit_start, fit_end), (val_start, val_start + validate_days * DAY_S)))
    return out


def holdout_fold(x: np.ndarray, y: np.ndarray, share: float = 0.3) -> FoldData:
    """The training rows (time-ordered) split in two: the last ``share`` validates."""
    cut = int(round(len(y) * (1.0 - share)))
    return FoldData(x[:cut], y[:cut], x[cut:], y[cut:], np.ones(len(y) - cut, dtype=bool),
                    {"holdout": f"last {share:.0%} of the training rows"})  # fmt: skip


def fit_member(
    x: np.ndarray, y: np.ndarray, features: Sequence[str], params: dict[str, Any], rounds: int, threads: int
) -> xgb.Booster:
    idx = [FEATURE_NAMES.index(n) for n in features]
    full = {**BASE_PARAMS, **params, "nthread": threads}
    booster = xgb.train(full, xgb.DMatrix(x[:, idx], label=y, missing=np.nan), num_boost_round=rounds)
    booster.feature_names = None  # the manifest holds names; serving passes bare matrices
    return booster


def margins(booster: xgb.Booster, x: np.ndarray, features: Sequence[str]) -> np.ndarray:
    idx = [FEATURE_NAMES.index(n) for n in features]
    return np.asarray(booster.inplace_predict(np.ascontiguousarray(x[:, idx]), predict_type="margin"), np.float64)


def select(
    specs: Sequence[dict[str, Any]],
    features: Sequence[str],
    folds: Sequence[FoldData],
    *,
    full_grid: bool,
    rounds_scale: float,
    threads: int,
    log: Callable[[str], None] = lambda _: None,
    stage: Callable[[str], AbstractContextManager[object]] = lambda _: nullcontext(),
) -> tuple[list[MemberChoice], Combination]:
    """Each member's parameters (its whole grid when ``full_grid``, else its
    first entry) and the combination fitted on the chosen members' validation margins."""
    usable = [f for f in folds if len(f.y_fit) and f.y_fit.min() != f.y_fit.max()]
    if not usable:
        raise ValueError("no validation fold has both classes in its training window")
    choices: list[MemberChoice] = []
    pooled: list[np.ndarray] = []
    for spec in specs:
        names = [n for n in features if n not in spec["exclude"]]
        grid = spec["grid"] if full_grid else spec["grid"][:1]
        best: tuple[float, int, list[np.ndarray]] | None = None
        tried = []
        for entry_index, entry in enumerate(grid):
            params = {k: v for k, v in entry.items() if k != "rounds"}
            rounds = _rounds(entry["rounds"], rounds_scale)
            started = time.perf_counter()
            fold_margins, aps = [], []
            for fold in usable:
                with stage(f"validate {spec['name']}"):
                    booster = fit_member(fold.x_fit, fold.y_fit, names, {**spec["params"], **params}, rounds, threads)
                    m = margins(booster, fold.x_val, names)
                fold_margins.append(m)
                y, keep = fold.y_val[fold.keep], fold.keep
                if len(y) and y.min() != y.max():
                    aps.append(float(average_precision_score(y, m[keep])))
            mean_ap = float(np.mean(aps)) if aps else math.nan
            tried.append({**entry, "mean_validation_ap": round(mean_ap, 4), "folds_scored": len(aps)})
            log(f"  {spec['name']:<10} {_describe(entry)}: validation AP {mean_ap:.3f} "
                f"({len(aps)} folds, {time.perf_counter() - started:.1f} s)")  # fmt: skip
            if best is None or (not math.isnan(mean_ap) and (math.isnan(best[0]) or mean_ap > best[0])):
                best = (mean_ap, entry_index, fold_margins)
        assert best is not None
        chosen = grid[best[1]]
        choices.append(MemberChoice(spec["name"], {**spec["params"], **{k: v for k, v in chosen.items() if k != "rounds"}},
                                    _rounds(chosen["rounds"], rounds_scale), names, tried))  # fmt: skip
        pooled.append(np.concatenate([m[f.keep] for m, f in zip(best[2], usable)]))
    labels = np.concatenate([f.y_val[f.keep] for f in usable])
    fitted_on = {
        "folds": [f.window for f in usable],
        "rows": int(len(labels)),
        "frauds": int(labels.sum()),
        "selection": "full grid" if full_grid else "default entries (no grid search)",
    }
    combination = fit_stacked(np.column_stack(pooled), labels, fitted_on)
    return choices, combination


def _rounds(rounds: int, scale: float) -> int:
    """Boosting rounds scaled (tests use fewer); a forest's single round stays one."""
    return 1 if rounds == 1 else max(10, int(rounds * scale))


def _describe(entry: dict[str, Any]) -> str:
    return " ".join(f"{k}={v}" for k, v in entry.items())
