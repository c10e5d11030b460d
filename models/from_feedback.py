"""Training data from the stream: served feature vectors joined with labels.

Every fresh decision's ``feedback`` record holds the exact vector the model
scored (``features``, by name, feature set version included). That vector *is*
the point-in-time vector: it was computed from what the feature store held at
decision time, by the serving code path, so there is no training/serving skew
and no leakage from later data to fix. Joined with the latest label per
transaction it becomes a training row; the newest ``test_share`` of rows (by
transaction time) is held out for the evaluation written beside the model.

The new version is registered through :func:`models.training.fit_and_register`
(the one training path) but *not* made current: promote it, or run it in shadow
first (``fraud-pipeline models shadow VERSION``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from app.errors import ModelNotFound
from models.evaluation import handbook_rows
from models.registry import read_manifest
from models.training import TrainConfig, TrainResult, _iso, fit_and_register
from pipeline.features import FEATURE_NAMES, FEATURE_SET_VERSION, MERCHANT_LABEL_DELAY_DAYS
from pipeline.labels import Label

__all__ = ["FeedbackSet", "feedback_training_set", "train_from_feedback"]


@dataclass
class FeedbackSet:
    matrix: np.ndarray
    labels: np.ndarray
    rows: pd.DataFrame
    """user_id, ts (transaction time), label, transaction_id: one per matrix row."""
    skipped: dict[str, int]


def feedback_training_set(feedback: Iterable[Mapping[str, Any]], labels: Mapping[str, Label]) -> FeedbackSet:
    """One row per labelled transaction with a served vector, in transaction-time order."""
    skipped = {"unlabelled": 0, "no_features": 0, "other_feature_set": 0, "duplicate": 0}
    seen: set[str] = set()
    vectors, ys, rows = [], [], []
    for doc in feedback:
        decision = doc.get("decision") or {}
        txid = decision.get("transaction_id")
        if not isinstance(txid, str):
            skipped["unlabelled"] += 1  # nothing to join a label on
            continue
        if txid in seen:
            skipped["duplicate"] += 1
            continue
        seen.add(txid)
        label = labels.get(txid)
        if label is None:
            skipped["unlabelled"] += 1
            continue
        features = doc.get("features")
        if not isinstance(features, dict):
            skipped["no_features"] += 1  # the feature store was down: nothing was served to learn from
            continue
        if doc.get("feature_set") != FEATURE_SET_VERSION:
            skipped["other_feature_set"] += 1
            continue
        vectors.append([math.nan if features.get(n) is None else float(features[n]) for n in FEATURE_NAMES])
        ys.append(1 if label.label == "fraud" else 0)
        tx = doc.get("transaction") or {}
        rows.append({"transaction_id": txid, "user_id": tx.get("user_id") or decision.get("user_id"),
                     "ts": float(tx.get("timestamp") or decision.get("decided_at") or 0.0)})  # fmt: skip
    frame = pd.DataFrame(rows, columns=["transaction_id", "user_id", "ts"])
    frame["label"] = np.asarray(ys, dtype=np.int64)
    order = np.argsort(frame["ts"].to_numpy(), kind="stable")
    matrix = np.asarray(vectors, dtype=np.float32).reshape(-1, len(FEATURE_NAMES))[order]
    frame = frame.iloc[order].reset_index(drop=True)
    return FeedbackSet(matrix, frame["label"].to_numpy(), frame, skipped)


def train_from_feedback(
    data: FeedbackSet,
    registry: Path,
    cfg: TrainConfig = TrainConfig(),
    *,
    test_share: float = 0.25,
    min_rows: int = 50,
) -> TrainResult:
    n = len(data.labels)
    if n < min_rows:
        raise ValueError(f"{n} labelled decisions with served features; at least {min_rows} are needed")
    cut = int(round(n * (1.0 - test_share)))
    y_train, y_test = data.labels[:cut], data.labels[cut:]
    for name, part in (("training", y_train), ("test", y_test)):
        if len(part) == 0 or part.min() == part.max():
            raise ValueError(f"the {name} part ({len(part)} rows) holds one class only; wait for more labels")
    x_train, x_test = data.matrix[:cut], data.matrix[cut:]
    present = [n for i, n in enumerate(FEATURE_NAMES) if not np.isnan(x_train[:, i]).all()]
    ts = data.rows["ts"].to_numpy()
    window = {
        "source": "feedback",
        "train": [_iso(ts[0]), _iso(ts[cut - 1])],
        "delay_days": 0,
        "test": [_iso(ts[cut]), _iso(ts[-1])],
        "skipped": data.skipped,
    }
    test_rows = data.rows.iloc[cut:].reset_index(drop=True)
    handbook = handbook_rows(data.rows, test_rows, float(ts[0]), MERCHANT_LABEL_DELAY_DAYS)
    # Nothing left to rank on the Handbook's rows: evaluate on every row (the window says "all test rows").
    kept = y_test[handbook]
    keep = None if len(kept) == 0 or kept.min() == kept.max() else handbook
    window["label_delay_days"] = MERCHANT_LABEL_DELAY_DAYS
    return fit_and_register(
        x_train, y_train, x_test, y_test, test_rows, present, window,
        registry, cfg, keep=keep, timezone=_served_timezone(registry),
    )


def _served_timezone(registry: Path) -> str:
    """The served vectors' night/weekend were computed on the serving model's zone."""
    try:
        return str(read_manifest(registry).get("timezone", "UTC"))
    except ModelNotFound:
        return "UTC"
