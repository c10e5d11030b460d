"""Evaluation with the Handbook's protocol and metrics, and the report written beside a model.

The Handbook (Le Borgne et al., "Reproducible Machine Learning for Credit Card
Fraud Detection", ``get_train_test_set`` and ``card_precision_top_k``) evaluates
on the test rows of customers *not already known to be compromised*:

* :func:`handbook_rows`: for each test day, a customer is known compromised if
  one of their transactions from the start of the training window up to
  ``delay_days`` before that day was a fraud (the labels known by then: the
  training window, then the delay window and, when the delay is shorter than the
  test window, earlier test days, day by day). Their rows that day are removed:
  an investigator would already have blocked the card, so scoring it again says
  nothing about the model;
* AUC-ROC and average precision over the rows kept;
* card-precision@100 (:func:`card_precision_at_k`), on the same rows: each test
  day, the 100 customers (cards) with the highest score that day (a card's
  score is its highest transaction score, its label its highest label); the
  share of them with a fraud that day, averaged over days. Cards found
  compromised in a day's top 100 are removed from later days.

The metrics over *all* test rows (known-compromised customers kept) are
reported as well, labelled, for comparison only: they are not the Handbook's
figures. A card already known to be compromised is easy to flag again, which
raises them on the Handbook's scenarios; on other fraud mixes they can be lower
(docs/model-evaluation.md has both).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # no display on servers and CI
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
from sklearn.metrics import (  # noqa: E402
    average_precision_score,
    precision_recall_curve,
    roc_auc_score,
    roc_curve,
)

__all__ = [
    "HANDBOOK_XGBOOST",
    "card_precision_at_k",
    "card_precision_per_day",
    "evaluate_scores",
    "handbook_rows",
    "threshold_table",
    "write_report",
]

DAY_S = 86400.0

#: The Handbook's reported test-week figures for XGBoost (defaults / tuned).
HANDBOOK_XGBOOST = {"auc": (0.862, 0.869), "ap": (0.639, 0.687), "cp_at_100": (0.273, 0.303)}


def handbook_rows(
    labelled: pd.DataFrame, test_rows: pd.DataFrame, train_start: float, delay_days: float
) -> np.ndarray:
    """Which ``test_rows`` the Handbook keeps: True unless the customer is known
    compromised on the row's day.

    ``labelled``: ``user_id``, ``ts``, ``label`` of the transactions whose labels
    can be known (any rows; only frauds at or after ``train_start`` count). A test
    row on day D is removed when its customer has a fraud with
    ``train_start <= ts < D - delay_days`` (the Handbook adds, for test day i,
    the frauds of day ``train_end + i - 1`` to the training window's).
    """
    frauds = labelled[(labelled["label"].to_numpy() > 0) & (labelled["ts"].to_numpy() >= train_start)]
    first_fraud = frauds.groupby("user_id", sort=False)["ts"].min()
    known_from = test_rows["user_id"].map(first_fraud).to_numpy(dtype=np.float64)  # NaN: never a known fraud
    day_start = np.floor(test_rows["ts"].to_numpy(dtype=np.float64) / DAY_S) * DAY_S
    known = known_from < day_start - delay_days * DAY_S  # NaN compares False
    return np.asarray(~known, dtype=bool)


def card_precision_at_k(rows: pd.DataFrame, scores: np.ndarray, k: int = 100) -> float:
    """The Handbook's card-precision@k: the mean of :func:`card_precision_per_day`."""
    daily = card_precision_per_day(rows, scores, k)
    return float(np.mean(list(daily.values()))) if daily else float("nan")


def card_precision_per_day(rows: pd.DataFrame, scores: np.ndarray, k: int = 100) -> dict[str, float]:
    """Card-precision@k of each test day (ISO date -> precision), in day order."""
    frame = pd.DataFrame(
        {"user_id": rows["user_id"].to_numpy(), "day": (rows["ts"].to_numpy() // DAY_S), "score": scores,
         "label": rows["label"].to_numpy()}
    )
    known_compromised: set[str] = set()
    precisions: dict[str, float] = {}
    for day_index, day in frame.groupby("day", sort=True):
        cards = day.groupby("user_id").agg(score=("score", "max"), label=("label", "max"))
        cards = cards[~cards.index.isin(known_compromised)]
        top = cards.sort_values("score", ascending=False).head(k)
        date = pd.Timestamp(float(day_index) * DAY_S, unit="s", tz="UTC").date().isoformat()
        precisions[date] = float(top["label"].sum()) / k
        known_compromised.update(top.index[top["label"] > 0])
    return precisions


def _metrics(labels: np.ndarray, scores: np.ndarray, rows: pd.DataFrame) -> dict[str, float]:
    if len(labels) == 0 or labels.min() == labels.max():
        raise ValueError("the test window holds only one class; simulate more days or users")
    return {
        "auc": round(float(roc_auc_score(labels, scores)), 4),
        "ap": round(float(average_precision_score(labels, scores)), 4),
        "cp_at_100": round(card_precision_at_k(rows, scores), 4),
    }


def evaluate_scores(
    labels: np.ndarray, scores: np.ndarray, rows: pd.DataFrame, keep: np.ndarray | None = None
) -> dict[str, Any]:
    """AUC, AP and CP@100 on the rows ``keep`` selects (the Handbook's: see
    :func:`handbook_rows`), and under ``all_rows`` the same on every row.
    Without ``keep``, every row (and no ``all_rows``)."""
    if keep is None:
        return _metrics(labels, scores, rows)
    kept = rows[keep].reset_index(drop=True)
    return {**_metrics(labels[keep], scores[keep], kept), "all_rows": _metrics(labels, scores, rows)}


def threshold_table(
    labels: np.ndarray, scores: np.ndarray, thresholds: tuple[float, ...] = (0.05, 0.1, 0.2, 0.3, 0.5, 0.7, 0.9)
) -> list[dict[str, float]]:
    """Per score threshold: precision and recall of flagging ``score >= t``, and
    the share of rows flagged (the alert rate analysts would see)."""
    table = []
    frauds = max(int(labels.sum()), 1)
    for t in thresholds:
        flagged = scores >= t
        hits = int(labels[flagged].sum())
        n = int(flagged.sum())
        table.append({"threshold": t, "precision": round(hits / n, 4) if n else float("nan"),
                      "recall": round(hits / frauds, 4), "alert_rate": round(n / max(len(scores), 1), 5)})  # fmt: skip
    return table


def write_report(
    folder: Path,
    labels: np.ndarray,
    ensemble: np.ndarray,
    members: dict[str, np.ndarray],
    metrics: dict[str, Any],
    window: dict[str, Any],
    extra: dict[str, Any] | None = None,
    rows: pd.DataFrame | None = None,
) -> list[Path]:
    """On the evaluated rows: ROC and PR curves (curves.png), and with ``rows``
    (``user_id``, ``ts``, ``label`` of those rows) card-precision@100 per day
    (daily_card_precision.png, values in evaluation.json) and the ensemble's
    reliability diagram (reliability.png); evaluation.json. Returns the files written."""
    folder.mkdir(parents=True, exist_ok=True)
    curves = {"ensemble": ensemble, **members}
    written = [_curves_png(folder / "curves.png", labels, curves, metrics)]
    report: dict[str, Any] = {"metrics": metrics, "handbook_xgboost": HANDBOOK_XGBOOST, "window": window}
    if rows is not None:
        daily = {name: card_precision_per_day(rows, scores) for name, scores in curves.items()}
        report["daily_card_precision"] = daily
        written.append(_daily_png(folder / "daily_card_precision.png", daily))
        report["reliability"] = reliability(labels, ensemble)
        written.append(_reliability_png(folder / "reliability.png", report["reliability"]))
    evaluation = folder / "evaluation.json"
    evaluation.write_text(json.dumps({**report, **(extra or {})}, indent=2) + "\n")
    return [*written, evaluation]


def reliability(labels: np.ndarray, scores: np.ndarray, bins: int = 10) -> list[dict[str, float]]:
    """Per score bin (equal width on [0, 1]): rows, mean score, observed fraud
    rate. A calibrated model's points lie on the diagonal; thresholds in
    ``config/rules.json`` read as fraud probabilities only if they do."""
    edges = np.linspace(0.0, 1.0, bins + 1)
    which = np.clip(np.digitize(scores, edges[1:-1]), 0, bins - 1)
    out = []
    for b in range(bins):
        inside = which == b
        n = int(inside.sum())
        if n:
            out.append({"low": float(edges[b]), "high": float(edges[b + 1]), "rows": n,
                        "mean_score": round(float(scores[inside].mean()), 5),
                        "fraud_rate": round(float(labels[inside].mean()), 5)})  # fmt: skip
    return out


def _curves_png(path: Path, labels: np.ndarray, curves: dict[str, np.ndarray], metrics: dict[str, Any]) -> Path:
    fig, (roc_ax, pr_ax) = plt.subplots(1, 2, figsize=(11, 4.5))
    for name, scores in curves.items():
        fpr, tpr, _ = roc_curve(labels, scores)
        precision, recall, _ = precision_recall_curve(labels, scores)
        style = {"linewidth": 2.4} if name == "ensemble" else {"linewidth": 1, "alpha": 0.8}
        roc_ax.plot(fpr, tpr, label=f"{name} AUC {metrics[name]['auc']:.3f}", **style)
        pr_ax.plot(recall, precision, label=f"{name} AP {metrics[name]['ap']:.3f}", **style)
    roc_ax.plot([0, 1], [0, 1], "k:", linewidth=0.8)
    roc_ax.set(xlabel="false positive rate", ylabel="true positive rate", title="ROC (test window)")
    pr_ax.set(xlabel="recall", ylabel="precision", title="Precision-recall (test window)")
    for ax in (roc_ax, pr_ax):
        ax.legend(loc="lower right" if ax is roc_ax else "upper right", fontsize=8)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _daily_png(path: Path, daily: dict[str, dict[str, float]]) -> Path:
    fig, ax = plt.subplots(figsize=(8, 4.2))
    for name, values in daily.items():
        mean = float(np.mean(list(values.values()))) if values else float("nan")
        main = name == "ensemble"
        ax.plot(range(len(values)), list(values.values()), label=f"{name} (mean {mean:.3f})", marker="o" if main else ".",
                linewidth=2.4 if main else 1.0, alpha=1.0 if main else 0.8)  # fmt: skip
    days = list(next(iter(daily.values()), {}))
    ax.set_xticks(range(len(days)), days)  # day positions, labelled with their dates
    ax.set(xlabel="test day (UTC)", ylabel="card precision @ 100", title="Card-precision@100 per test day")
    ax.tick_params(axis="x", rotation=30, labelsize=8)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _reliability_png(path: Path, table: list[dict[str, float]]) -> Path:
    fig, (ax, count_ax) = plt.subplots(2, 1, figsize=(6, 6.5), gridspec_kw={"height_ratios": [3, 1]}, sharex=True)
    ax.plot([0, 1], [0, 1], "k:", linewidth=0.8, label="calibrated")
    ax.plot([r["mean_score"] for r in table], [r["fraud_rate"] for r in table], "o-", label="ensemble")
    ax.set(ylabel="observed fraud rate", title="Reliability (test window, evaluated rows)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    count_ax.bar([(r["low"] + r["high"]) / 2 for r in table], [r["rows"] for r in table], width=0.09)
    count_ax.set(xlabel="ensemble score (bin)", ylabel="rows", yscale="log")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
