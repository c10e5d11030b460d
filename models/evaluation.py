"""Evaluation with the Handbook's metrics, and the report written beside a model.

* AUC-ROC and average precision over the test window's transactions;
* card-precision@100: each test day, the 100 users (cards) with the highest
  score that day; the share of them that had fraud that day, averaged over
  days. As in the Handbook, cards found compromised on one day are removed
  from later days (an investigator would already have blocked them).
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

__all__ = ["HANDBOOK_XGBOOST", "card_precision_at_k", "evaluate_scores", "write_report"]

DAY_S = 86400.0

#: The Handbook's reported test-week figures for XGBoost (defaults / tuned).
HANDBOOK_XGBOOST = {"auc": (0.862, 0.869), "ap": (0.639, 0.687), "cp_at_100": (0.273, 0.303)}


def card_precision_at_k(rows: pd.DataFrame, scores: np.ndarray, k: int = 100) -> float:
    frame = pd.DataFrame(
        {"user_id": rows["user_id"].to_numpy(), "day": (rows["ts"].to_numpy() // DAY_S), "score": scores,
         "label": rows["label"].to_numpy()}
    )
    known_compromised: set[str] = set()
    precisions = []
    for _, day in frame.groupby("day", sort=True):
        cards = day.groupby("user_id").agg(score=("score", "max"), label=("label", "max"))
        cards = cards[~cards.index.isin(known_compromised)]
        top = cards.sort_values("score", ascending=False).head(k)
        precisions.append(float(top["label"].sum()) / k)
        known_compromised.update(top.index[top["label"] > 0])
    return float(np.mean(precisions)) if precisions else float("nan")


def evaluate_scores(labels: np.ndarray, scores: np.ndarray, rows: pd.DataFrame) -> dict[str, float]:
    if labels.min() == labels.max():
        raise ValueError("the test window holds only one class; simulate more days or users")
    return {
        "auc": round(float(roc_auc_score(labels, scores)), 4),
        "ap": round(float(average_precision_score(labels, scores)), 4),
        "cp_at_100": round(card_precision_at_k(rows, scores), 4),
    }


def write_report(
    folder: Path,
    labels: np.ndarray,
    ensemble: np.ndarray,
    members: dict[str, np.ndarray],
    metrics: dict[str, Any],
    window: dict[str, Any],
) -> list[Path]:
    """ROC and PR curves as PNG plus evaluation.json; returns the files written."""
    folder.mkdir(parents=True, exist_ok=True)
    curves = {"ensemble": ensemble, **members}
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
    curves_png = folder / "curves.png"
    fig.savefig(curves_png, dpi=110)
    plt.close(fig)
    evaluation = folder / "evaluation.json"
    evaluation.write_text(
        json.dumps({"metrics": metrics, "handbook_xgboost": HANDBOOK_XGBOOST, "window": window}, indent=2)
        + "\n"
    )
    return [curves_png, evaluation]
