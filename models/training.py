"""Train, evaluate and register the XGBoost ensemble.

Protocol (the Handbook's): train on one window, skip a *delay* window (labels
of recent transactions are not known yet when a model is trained), test on the
window after it. Defaults: 7 / 7 / 7 days, ending at the end of the data. The
registered model is the one evaluated, so its metrics describe it. Training
registers a version and never serves it: ``fraud-pipeline models promote``
does that (:mod:`models.lifecycle`), logged.

Four members, each wrong in a different way:

* ``broad``: deep boosted trees on every feature — the strongest single
  model, it learns interactions (amount x new device x distance);
* ``shallow``: depth 3 boosted trees, 60 % of columns per tree — lower
  variance, degrades gracefully when the fraud mix drifts;
* ``forest``: a random forest (50-100 deep trees on subsampled rows, half the
  columns per split, one round) — averaging instead of boosting, so its
  errors are the least correlated with the boosted members';
* ``behaviour``: the user's own behaviour only, no merchant-risk features —
  merchant risk is label-delayed and absent for new merchants, and this member
  keeps the ensemble sharp when it is stale or missing.

Their hyper-parameters and the combination (a non-negative logistic
regression on their margins, :mod:`models.combination`) are chosen by the
Handbook's prequential validation on earlier windows (:mod:`models.selection`),
never on the test week. ``search="light"`` (the default) uses each member's
first grid entry (the cheaper one: it keeps ``make demo``'s training near a
minute on 2 cores) and one validation fold; ``search="full"`` tries every
entry over ``folds`` folds (docs/model-evaluation.md has both).

Evaluation follows the Handbook's protocol (:mod:`models.evaluation`): test
rows of customers already known to be compromised are removed before AUC, AP
and CP@100; the all-rows figures are kept beside them, labelled. Every run also
fits the Handbook's plain baseline, XGBoost on its 15 features (100 trees,
depth 6, XGBoost's default learning rate 0.3), on the same training rows and
scores it on the same test rows, so the ensemble is always compared with it on
this data rather than with numbers from another generator. Its features are
the Handbook's own definitions (:mod:`models.handbook_features`: customer
windows ending at the transaction, terminal windows 7 days back), computed
from the history; ``train --from-feedback``, which has served vectors and no
history, fits it on the served columns that approximate them
(:data:`HANDBOOK_FEATURES`), and the report says which.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any
from zoneinfo import ZoneInfo

import numpy as np
import pandas as pd
import xgboost as xgb

from models.evaluation import evaluate_scores, handbook_rows, threshold_table, write_report
from models.handbook_features import HANDBOOK_FEATURE_NAMES, handbook_features
from models.registry import MemberArtifact, new_version_name, save_version
from models.selection import BASE_PARAMS, FoldData, fit_member, holdout_fold, margins, prequential_windows, select
from pipeline.drift import build_reference, top_features, write_reference
from pipeline.features import DAY_S, FEATURE_NAMES, available_features, prepare_history, training_matrix

__all__ = [
    "BASELINE", "HANDBOOK_FEATURES", "MEMBER_SPECS", "Stage", "TrainConfig", "TrainResult", "fit_and_register",
    "no_stage", "train",
]  # fmt: skip

MERCHANT_FEATURES = frozenset(n for n in FEATURE_NAMES if n.startswith("merchant_"))

#: ``params``: fixed; ``grid``: what prequential validation chooses among
#: (first entry: the default, used without ``search="full"``).
MEMBER_SPECS: tuple[dict[str, Any], ...] = (
    {
        "name": "broad",
        "exclude": frozenset(),
        "params": {"subsample": 0.8, "colsample_bytree": 0.8, "seed": 1},
        "grid": [{"max_depth": 6, "eta": 0.1, "rounds": 150}, {"max_depth": 8, "eta": 0.1, "rounds": 200}],
    },
    {
        "name": "shallow",
        "exclude": frozenset(),
        "params": {"subsample": 0.9, "colsample_bytree": 0.6, "seed": 2},
        "grid": [{"max_depth": 3, "eta": 0.2, "rounds": 150}, {"max_depth": 3, "eta": 0.1, "rounds": 300}],
    },
    {
        "name": "forest",
        "exclude": frozenset(),
        # One round of parallel trees with eta 1: XGBoost's random forest.
        "params": {"eta": 1.0, "subsample": 0.6, "colsample_bynode": 0.5, "seed": 3},
        "grid": [{"max_depth": 8, "num_parallel_tree": 50, "rounds": 1}, {"max_depth": 12, "num_parallel_tree": 100, "rounds": 1}],
    },
    {
        "name": "behaviour",
        "exclude": MERCHANT_FEATURES,
        "params": {"subsample": 0.8, "colsample_bytree": 0.9, "seed": 4},
        "grid": [{"max_depth": 3, "eta": 0.2, "rounds": 150}, {"max_depth": 5, "eta": 0.1, "rounds": 200}],
    },
)

#: The served columns nearest the Handbook's 15 features: amount, weekend,
#: night; the customer's count and mean amount over 1/7/30 days; the terminal
#: (merchant)'s count and fraud rate over 1/7/30 days ending 7 days back. NOT the
#: Handbook's: the customer windows end at the start of the transaction's day
#: (the profile a worker reads) where the Handbook's end at the transaction, and
#: night ends at 06:00, not 07:00. The baseline uses them only when there is no
#: history to compute the Handbook's (``train --from-feedback``).
HANDBOOK_FEATURES: tuple[str, ...] = (
    "amount_usd", "is_weekend", "is_night",
    "user_count_1d", "user_mean_1d", "user_count_7d", "user_mean_7d", "user_count_30d", "user_mean_30d",
    "merchant_count_1d", "merchant_risk_1d", "merchant_count_7d", "merchant_risk_7d",
    "merchant_count_30d", "merchant_risk_30d",
)  # fmt: skip
#: Wraps a named step of training (the benchmark measures each); the default does nothing.
Stage = Callable[[str], AbstractContextManager[object]]


def no_stage(name: str) -> AbstractContextManager[object]:
    del name
    return nullcontext()


BASELINE = "baseline"
#: What the baseline's features were, as the report and ``train`` say it.
BASELINE_HANDBOOK = "the Handbook's 15 features"
BASELINE_SERVED = "served columns approximating the Handbook's 15 features"
TEST_SCORES = "test_scores.parquet"
BASELINE_SPEC: dict[str, Any] = {
    "rounds": 100,
    "params": {"max_depth": 6, "eta": 0.3, "seed": 0},  # XGBClassifier's defaults, as in the Handbook
}


@dataclass(frozen=True)
class TrainConfig:
    train_days: int = 7
    delay_days: int = 7
    test_days: int = 7
    threads: int = 2
    rounds_scale: float = 1.0
    """Multiplies each member's boosting rounds (tests use fewer)."""
    train_start: float | None = None
    """Epoch seconds where the training window starts; None: the test window ends at the end of the data."""
    timezone: str = "UTC"
    """The zone whose wall clock night and weekend are read on; recorded in the manifest, served the same way."""
    search: str = "light"
    """"light": each member's default entry, one validation fold; "full": every grid entry over ``folds`` folds."""
    folds: int = 3
    """Prequential validation folds for ``search="full"``."""

    def __post_init__(self) -> None:
        if self.search not in ("light", "full"):
            raise ValueError(f"search must be 'light' or 'full', not {self.search!r}")
        if self.folds < 1:
            raise ValueError("folds must be at least 1")


@dataclass(frozen=True)
class TrainResult:
    version: str
    folder: Path
    metrics: dict[str, Any]
    window: dict[str, Any] = field(default_factory=dict)
    threshold_table: list[dict[str, float]] = field(default_factory=list)


def train(
    df: pd.DataFrame, registry: Path, cfg: TrainConfig = TrainConfig(), progress: bool = True,
    stage: Stage = no_stage,
) -> TrainResult:
    """``stage(name)`` wraps each step (a context manager: the training
    benchmark times and measures memory with it)."""
    present = [c for c in df.columns if df[c].notna().any()]
    features = available_features(present)
    with stage("prepare"):
        history = prepare_history(df)
    # A caller that handed over its only reference (the CLI, the benchmark) frees the raw frame here.
    del df
    first, last = float(history["ts"].min()), float(history["ts"].max())
    days = cfg.train_days + cfg.delay_days + cfg.test_days
    if cfg.train_start is None:
        end = math.ceil(last / DAY_S) * DAY_S
        train_start = end - days * DAY_S
    else:
        train_start = cfg.train_start
        end = train_start + days * DAY_S
    train_end = train_start + cfg.train_days * DAY_S
    test_start = train_end + cfg.delay_days * DAY_S
    if train_start < math.floor(first / DAY_S) * DAY_S or end > math.ceil(last / DAY_S) * DAY_S:
        raise ValueError(
            f"the data covers {_iso(first)} to {_iso(last)}; train {cfg.train_days} + delay {cfg.delay_days} + "
            f"test {cfg.test_days} days would need {_iso(train_start)} to {_iso(end)}; pick --train-start inside "
            f"the data or fewer days (30 more before the start give full profiles)"
        )
    tz = None if cfg.timezone == "UTC" else ZoneInfo(cfg.timezone)
    # Validation folds need labelled data before the training window; those the data does not reach are dropped.
    fold_windows = [
        w for w in prequential_windows(train_start, cfg.folds if cfg.search == "full" else 1, cfg.train_days,
                                       cfg.delay_days)
        if w.fit[0] >= math.floor(first / DAY_S) * DAY_S
    ]  # fmt: skip
    earliest = min([train_start, *(w.fit[0] for w in fold_windows)])
    # One vectorised pass over everything any window needs, then sliced: a row's
    # features depend only on what came before it, not on the window it is in.
    with stage("features"):
        x_all, y_all, rows_all = training_matrix(history, earliest, end, progress, tz)
    part = partial(_window_of, x_all, y_all, rows_all, rows_all["ts"].to_numpy(dtype=np.float64))

    x_train, y_train, _ = part(train_start, train_end)
    x_test, y_test, test_rows = part(test_start, end)
    with stage("handbook features"):
        # The baseline's own matrices, the same rows in the same order.
        baseline_x = (handbook_features(history, train_start, train_end, tz), handbook_features(history, test_start, end, tz))
    if (len(baseline_x[0]), len(baseline_x[1])) != (len(x_train), len(x_test)):
        raise AssertionError("the Handbook's feature rows differ from the training matrix's")
    # Labels known before each test day: the training window onwards, up to the delay.
    # Only frauds make a customer known compromised: a small frame instead of copies of the history.
    frauds = history.loc[history["label"].to_numpy() > 0, ["user_id", "ts", "label"]]
    keep = handbook_rows(frauds[frauds["ts"] < end], test_rows, train_start, cfg.delay_days)
    folds = []
    for w in fold_windows:
        x_fit, y_fit, _ = part(*w.fit)
        x_val, y_val, val_rows = part(*w.validate)
        val_keep = handbook_rows(frauds[frauds["ts"] < w.validate[1]], val_rows, w.fit[0], cfg.delay_days)
        folds.append(FoldData(x_fit, y_fit, x_val, y_val, val_keep,
                              {"fit": [_iso(w.fit[0]), _iso(w.fit[1])], "validate": [_iso(w.validate[0]), _iso(w.validate[1])]}))  # fmt: skip
    del part, x_all, y_all, rows_all  # the slices are copies: the whole matrix can go
    window = {
        "train": [_iso(train_start), _iso(train_end)],
        "delay_days": cfg.delay_days,
        "test": [_iso(test_start), _iso(end)],
    }
    return fit_and_register(x_train, y_train, x_test, y_test, test_rows, features, window, registry, cfg, keep=keep,
                            folds=folds or None, progress=progress, stage=stage, baseline_x=baseline_x)  # fmt: skip


def _window_of(
    x: np.ndarray, y: np.ndarray, rows: pd.DataFrame, ts: np.ndarray, lo: float, hi: float
) -> tuple[np.ndarray, np.ndarray, pd.DataFrame]:
    mask = (ts >= lo) & (ts < hi)
    return x[mask], y[mask], rows[mask].reset_index(drop=True)


def fit_and_register(
    x_train: np.ndarray,
    y_train: np.ndarray,
    x_test: np.ndarray,
    y_test: np.ndarray,
    test_rows: pd.DataFrame,
    features: list[str],
    window: dict[str, Any],
    registry: Path,
    cfg: TrainConfig = TrainConfig(),
    *,
    keep: np.ndarray | None = None,
    timezone: str | None = None,
    folds: list[FoldData] | None = None,
    progress: bool = False,
    stage: Stage = no_stage,
    baseline_x: tuple[np.ndarray, np.ndarray] | None = None,
) -> TrainResult:
    """Fit the members and the baseline on the train matrix, evaluate on the test
    matrix and register.

    The one training path: ``train`` (from the simulated history) and
    ``train --from-feedback`` (served vectors joined with labels) both end here.
    ``test_rows`` needs ``user_id``, ``ts`` and ``label`` (card precision).
    ``keep`` selects the evaluated test rows (the Handbook's, from
    :func:`models.evaluation.handbook_rows`); None evaluates every row.
    ``timezone``: the zone the matrices' night/weekend were computed on (default ``cfg.timezone``).
    ``folds``: the prequential validation folds (:mod:`models.selection`); None
    (feedback, or data too short for one): the training rows' last 30 %, by time.
    ``baseline_x``: the baseline's (train, test) matrices of the Handbook's 15
    features (:func:`models.handbook_features.handbook_features`); None: the
    served columns nearest them (:data:`HANDBOOK_FEATURES`).
    """
    log = print if progress else (lambda _: None)
    folds = folds or [holdout_fold(x_train, y_train)]
    log(f"prequential validation ({cfg.search}): {len(folds)} fold(s), validating on "
        + "; ".join(str(f.window.get("validate", f.window.get("holdout"))) for f in folds))  # fmt: skip
    choices, combination = select(MEMBER_SPECS, features, folds, full_grid=cfg.search == "full",
                                  rounds_scale=cfg.rounds_scale, threads=cfg.threads, log=log, stage=stage)  # fmt: skip
    artifacts: list[MemberArtifact] = []
    member_scores: dict[str, np.ndarray] = {}
    test_margins = []
    importance: dict[str, float] = {}
    say = np.array(combination.weights) / (sum(combination.weights) or 1.0)
    for choice, weight, share in zip(choices, combination.weights, say):
        # Refitted on the training window: the most recent labels, with the chosen parameters.
        with stage(f"fit {choice.name}"):
            booster = fit_member(x_train, y_train, choice.features, choice.params, choice.rounds, cfg.threads)
        gains = booster.get_score(importance_type="total_gain")
        total_gain = math.fsum(float(g) for g in gains.values() if isinstance(g, float)) or 1.0  # floats for total_gain
        for index, gain in gains.items():  # each member's say, as in the ensemble (names are f0, f1, ...)
            name = choice.features[int(index[1:])] if index.startswith("f") and index[1:].isdigit() else index
            importance[name] = importance.get(name, 0.0) + float(share) * float(gain) / total_gain  # type: ignore[arg-type]
        margin = margins(booster, x_test, choice.features)
        test_margins.append(margin)
        member_scores[choice.name] = 1.0 / (1.0 + np.exp(-margin))
        params = {**BASE_PARAMS, **choice.params, "nthread": cfg.threads, "rounds": choice.rounds}
        artifacts.append(MemberArtifact(choice.name, booster, weight, choice.features, params))
    ensemble_scores = combination.score(np.column_stack(test_margins))
    with stage("fit baseline"):
        if baseline_x is None:
            names = [n for n in HANDBOOK_FEATURES if n in features]
            idx = [FEATURE_NAMES.index(n) for n in names]
            baseline_scores = _fit_baseline(x_train[:, idx], y_train, x_test[:, idx], cfg)
            baseline = {"definition": BASELINE_SERVED, "features": names}
        else:
            baseline_scores = _fit_baseline(baseline_x[0], y_train, baseline_x[1], cfg)
            baseline = {"definition": BASELINE_HANDBOOK, "features": list(HANDBOOK_FEATURE_NAMES)}

    all_scores = {"ensemble": ensemble_scores, **member_scores, BASELINE: baseline_scores}
    with stage("evaluate"):
        metrics: dict[str, Any] = {name: evaluate_scores(y_test, sc, test_rows, keep) for name, sc in all_scores.items()}
    # Thresholds for serving: on every test row, since workers score known-compromised cards too.
    thresholds = suggest_thresholds(y_test, ensemble_scores)
    evaluated = np.ones(len(y_test), dtype=bool) if keep is None else keep
    window = {
        **window,
        "train_rows": int(len(y_train)),
        "train_frauds": int(y_train.sum()),
        "test_rows": int(len(y_test)),
        "test_frauds": int(y_test.sum()),
        "evaluation": "all test rows" if keep is None else "handbook: known-compromised customers removed",
        "evaluated_rows": int(evaluated.sum()),
        "evaluated_frauds": int(y_test[evaluated].sum()),
        "removed_customers": int(test_rows.loc[~evaluated, "user_id"].nunique()),
        "features": features,
        "baseline": {**baseline, **BASELINE_SPEC},
        "combination": combination.to_manifest([c.name for c in choices]),
        "search": {c.name: c.scores for c in choices},
    }
    version = new_version_name()
    while (registry / version).exists():  # two trainings in one second
        time.sleep(1.0)
        version = new_version_name()
    folder = registry / version
    with stage("report"):
        curves = {name: sc[evaluated] for name, sc in all_scores.items() if name != "ensemble"}
        table = threshold_table(y_test, ensemble_scores)
        report_files = write_report(folder / "report", y_test[evaluated], ensemble_scores[evaluated], curves, metrics,
                                    window, extra={"threshold_table": table},
                                    rows=test_rows[evaluated].reset_index(drop=True))  # fmt: skip
        report_files.append(_write_test_scores(folder / "report" / TEST_SCORES, test_rows, y_test, evaluated, all_scores))
        # The drift reference: the test window, scored out of sample like live traffic.
        reference = write_reference(folder, build_reference(x_test, ensemble_scores, top_features(importance)))
    with stage("register"):
        saved = save_version(
            registry,
            version,
            artifacts,
            thresholds=thresholds,
            metrics=metrics,
            data_window=window,
            extra_files=[*report_files, reference],
            timezone=timezone or cfg.timezone,
            combination=combination,
        )
    return TrainResult(version, saved, metrics, window, table)


def _write_test_scores(
    path: Path, rows: pd.DataFrame, labels: np.ndarray, evaluated: np.ndarray, scores: dict[str, np.ndarray]
) -> Path:
    """Every test row's scores, so the metrics can be recomputed (and other
    metrics computed) without retraining: ids, time, label, whether the
    evaluation kept the row, and one score column per model."""
    frame = pd.DataFrame({
        "transaction_id": rows["transaction_id"].astype(str).to_numpy() if "transaction_id" in rows else None,
        "user_id": rows["user_id"].astype(str).to_numpy(),
        "ts": rows["ts"].to_numpy(dtype=np.float64),
        "label": labels.astype(np.int8),
        "evaluated": evaluated,
        **{name: np.asarray(sc, dtype=np.float64) for name, sc in scores.items()},
    })  # fmt: skip
    frame.to_parquet(path, index=False)
    return path


def _fit_baseline(x_train: np.ndarray, y_train: np.ndarray, x_test: np.ndarray, cfg: TrainConfig) -> np.ndarray:
    """The Handbook's plain XGBoost on its features' matrices; scores the test rows. Not registered."""
    params = {**BASE_PARAMS, **BASELINE_SPEC["params"], "nthread": cfg.threads}
    rounds = max(10, int(BASELINE_SPEC["rounds"] * cfg.rounds_scale))
    booster = xgb.train(params, xgb.DMatrix(x_train, label=y_train, missing=np.nan), num_boost_round=rounds)
    return np.asarray(booster.inplace_predict(x_test))


def suggest_thresholds(labels: np.ndarray, scores: np.ndarray) -> dict[str, float]:
    """Review: the score that flags 1 % of traffic; decline: the lowest score
    whose precision on the test window is at least 90 % (or 0.9)."""
    review = float(np.quantile(scores, 0.99)) if len(scores) else 0.5
    order = np.argsort(-scores)
    hits = np.cumsum(labels[order])
    precision = hits / np.arange(1, len(order) + 1)
    ok = np.nonzero(precision >= 0.9)[0]
    decline = float(scores[order][ok[-1]]) if len(ok) else 0.9
    decline = max(decline, review)
    return {"review": round(review, 4), "decline": round(decline, 4)}


def _iso(ts: float) -> str:
    return str(pd.Timestamp(ts, unit="s", tz="UTC").isoformat())


def format_thresholds(table: list[dict[str, float]]) -> str:
    """The ensemble's threshold table: what flagging ``score >= t`` would have
    done on every test row (known-compromised customers included, as served)."""
    lines = ["ensemble thresholds on all test rows:", f"{'threshold':>9} {'precision':>9} {'recall':>7} {'alert rate':>10}"]
    for row in table:
        lines.append(f"{row['threshold']:>9.2f} {row['precision']:>9.3f} {row['recall']:>7.3f} {row['alert_rate']:>10.2%}")
    return "\n".join(lines)


def format_metrics(metrics: dict[str, Any], window: dict[str, Any] | None = None) -> str:
    """The evaluated rows' table and, when there is one, the all-rows table below it, labelled."""
    window = window or {}
    definition = (window.get("baseline") or {}).get("definition", BASELINE_SERVED)
    label = {BASELINE: f"baseline ({definition}, plain XGBoost)"}
    width = max(len(label.get(n, n)) for n in metrics)

    def table(pick: dict[str, dict[str, Any]]) -> list[str]:
        rows = [f"{'model':<{width}} {'AUC':>7} {'AP':>7} {'CP@100':>7}"]
        for name, m in pick.items():
            rows.append(f"{label.get(name, name):<{width}} {m['auc']:>7.3f} {m['ap']:>7.3f} {m['cp_at_100']:>7.3f}")
        return rows

    lines = []
    all_rows = {n: m["all_rows"] for n, m in metrics.items() if isinstance(m.get("all_rows"), dict)}
    if all_rows:
        lines.append(
            f"Handbook protocol: {window.get('evaluated_rows', 0):,} test rows, {window.get('evaluated_frauds', 0):,} "
            f"frauds ({window.get('removed_customers', 0):,} customers known compromised removed)"
        )
    lines += table(metrics)
    if all_rows:
        lines.append(
            f"all test rows, known-compromised customers kept (not the Handbook's figure): "
            f"{window.get('test_rows', 0):,} rows, {window.get('test_frauds', 0):,} frauds"
        )
        lines += table(all_rows)
    return "\n".join(lines)
