"""`train --from-feedback`: served vectors joined with labels become a registered candidate."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest

from models.from_feedback import feedback_training_set, train_from_feedback
from models.registry import current_version, load_ensemble, read_manifest
from models.training import TrainConfig
from pipeline.drift import load_reference
from pipeline.features import DAY_S, FEATURE_NAMES, FEATURE_SET_VERSION, prepare_history, training_matrix
from pipeline.labels import Label


def served_records(frame: pd.DataFrame, days: int = 8) -> tuple[list[dict[str, Any]], dict[str, Label], np.ndarray]:
    """Feedback records as the scorer writes them, one per transaction of the last ``days``,
    with the point-in-time vectors training would compute; labels from the simulation."""
    history = prepare_history(frame)
    end = math.ceil(history["ts"].max() / DAY_S) * DAY_S
    matrix, labels, rows = training_matrix(history, end - days * DAY_S, end)
    records, verdicts = [], {}
    for i, row in enumerate(rows.itertuples()):
        txid = f"fb-{i:06d}"
        features = {n: (None if math.isnan(v) else float(v)) for n, v in zip(FEATURE_NAMES, matrix[i])}
        records.append({
            "decision": {"transaction_id": txid, "user_id": row.user_id, "action": "approve", "decided_at": row.ts,
                         "fraud_score": 0.1, "model_version": "v-old"},
            "transaction": {"transaction_id": txid, "user_id": row.user_id, "timestamp": row.ts},
            "feature_set": FEATURE_SET_VERSION,
            "features": features,
        })  # fmt: skip
        verdicts[txid] = Label(txid, "fraud" if labels[i] else "legit", "chargeback", row.ts + 86400)
    return records, verdicts, matrix


def test_the_training_rows_are_the_served_vectors_in_time_order(sim_frame: pd.DataFrame) -> None:
    records, labels, matrix = served_records(sim_frame, days=3)
    records.append({**records[0]})  # a redelivered record
    records.append({**records[1], "decision": {**records[1]["decision"], "transaction_id": "no-label"}})
    records.append({**records[2], "decision": {**records[2]["decision"], "transaction_id": "t-deg"}, "features": None})
    labels["t-deg"] = Label("t-deg", "fraud", "analyst", 0.0)
    data = feedback_training_set(records, labels)
    assert data.skipped == {"unlabelled": 1, "no_features": 1, "other_feature_set": 0, "duplicate": 1}
    assert len(data.labels) == len(matrix)
    assert (np.diff(data.rows["ts"].to_numpy()) >= 0).all()
    by_id = {r["decision"]["transaction_id"]: i for i, r in enumerate(records[: len(matrix)])}
    for k in (0, len(matrix) // 2, len(matrix) - 1):
        original = matrix[by_id[data.rows["transaction_id"][k]]]
        np.testing.assert_array_equal(data.matrix[k], original)  # bit for bit, NaN where missing


def test_training_from_feedback_registers_a_candidate_that_does_not_serve(
    sim_frame: pd.DataFrame, trained_registry: Path, tmp_path: Path
) -> None:
    import shutil

    registry = tmp_path / "registry"
    shutil.copytree(trained_registry, registry)
    serving = current_version(registry)
    records, labels, _ = served_records(sim_frame, days=16)
    data = feedback_training_set(records, labels)
    result = train_from_feedback(data, registry, TrainConfig(rounds_scale=0.05), min_rows=50)
    assert result.version != serving and current_version(registry) == serving
    manifest = read_manifest(registry, result.version)
    assert manifest["data_window"]["source"] == "feedback"
    assert manifest["data_window"]["train_rows"] + manifest["data_window"]["test_rows"] == len(data.labels)
    assert "reference.json" in manifest["sha256"]
    assert "score" in load_reference(registry / result.version)["items"]
    assert 0.5 < manifest["metrics"]["ensemble"]["auc"] <= 1.0
    # The Handbook's rows (customers with a fraud labelled 7+ days before removed), all rows beside them.
    window = manifest["data_window"]
    assert window["evaluation"].startswith("handbook") and window["label_delay_days"] == 7
    assert 0 < window["evaluated_rows"] < window["test_rows"]
    assert "all_rows" in manifest["metrics"]["ensemble"]
    scores = load_ensemble(registry, result.version).predict(data.matrix[:16]).scores
    assert scores.shape == (16,)


def test_too_few_or_one_class_labels_are_refused(sim_frame: pd.DataFrame, tmp_path: Path) -> None:
    records, labels, _ = served_records(sim_frame, days=2)
    legit_only = {k: Label(k, "legit", "analyst", v.labeled_at) for k, v in labels.items()}
    with pytest.raises(ValueError, match="one class"):
        train_from_feedback(feedback_training_set(records, legit_only), tmp_path, min_rows=10)
    with pytest.raises(ValueError, match="at least"):
        train_from_feedback(feedback_training_set(records[:5], labels), tmp_path, min_rows=10)
