"""The Handbook's evaluation protocol, on hand-made cases and against its own code."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from sklearn.metrics import roc_auc_score

from models.evaluation import DAY_S, card_precision_at_k, evaluate_scores, handbook_rows
from models.handbook_features import HANDBOOK_FEATURE_NAMES
from models.registry import read_manifest
from models.training import BASELINE_HANDBOOK

H = 3600.0


def _frame(rows: list[tuple[str, float, int]]) -> pd.DataFrame:
    return pd.DataFrame(rows, columns=["user_id", "ts", "label"])


def test_known_compromised_customers_are_removed_per_test_day() -> None:
    """Train day 0, delay 1 day (day 1), test days 2-4: a customer is removed on a
    test day once one of their frauds is older than the delay."""
    history = _frame([
        ("a", 0 * DAY_S + 10 * H, 1),   # fraud in the training window: known on every test day
        ("b", 1 * DAY_S + 12 * H, 1),   # fraud in the delay window: known from day 3 (label 1 day old)
        ("d", -1 * DAY_S + 5 * H, 1),   # fraud before the training window: the Handbook ignores it
        ("e", 0 * DAY_S + 9 * H, 0),
    ])  # fmt: skip
    test = _frame([
        ("a", 2 * DAY_S + 1 * H, 0), ("b", 2 * DAY_S + 2 * H, 0), ("c", 2 * DAY_S + 12 * H, 1),
        ("d", 2 * DAY_S + 3 * H, 0), ("e", 2 * DAY_S + 4 * H, 0),
        ("a", 3 * DAY_S + 1 * H, 1), ("b", 3 * DAY_S + 2 * H, 0), ("c", 3 * DAY_S + 3 * H, 0),
        ("e", 3 * DAY_S + 4 * H, 0),
        ("b", 4 * DAY_S + 2 * H, 0), ("c", 4 * DAY_S + 3 * H, 1), ("e", 4 * DAY_S + 5 * H, 1),
    ])  # fmt: skip
    labelled = pd.concat([history, test], ignore_index=True)  # test-day frauds count once old enough
    keep = handbook_rows(labelled, test, train_start=0.0, delay_days=1)
    kept = [f"{u}{int(ts // DAY_S)}" for (u, ts, _), k in zip(test.itertuples(index=False), keep) if k]
    # day 2: a removed (train fraud); b kept (its fraud is not 1 day old yet); c's own fraud day kept.
    # day 3: a and b removed; c kept (its day-2 fraud not yet known).
    # day 4: b and c removed (c's day-2 fraud is now known); e's first fraud kept.
    assert kept == ["b2", "c2", "d2", "e2", "c3", "e3", "e4"]


def _handbook_test_set(transactions: pd.DataFrame, train_start_day: int, delta_train: int, delta_delay: int,
                       delta_test: int) -> pd.DataFrame:  # fmt: skip
    """The Handbook's ``get_train_test_set`` test-set loop, transcribed (columns renamed)."""
    tx = transactions.assign(TX_TIME_DAYS=(transactions["ts"] // DAY_S).astype(int))
    train_df = tx[(tx.TX_TIME_DAYS >= train_start_day) & (tx.TX_TIME_DAYS < train_start_day + delta_train)]
    known_defrauded_customers = set(train_df[train_df.label == 1].user_id)
    test_df = []
    for day in range(delta_test):
        test_df_day = tx[tx.TX_TIME_DAYS == train_start_day + delta_train + delta_delay + day]
        test_df_day_delay_period = tx[tx.TX_TIME_DAYS == train_start_day + delta_train + day - 1]
        new_defrauded_customers = set(test_df_day_delay_period[test_df_day_delay_period.label == 1].user_id)
        known_defrauded_customers = known_defrauded_customers.union(new_defrauded_customers)
        test_df_day = test_df_day[~test_df_day.user_id.isin(known_defrauded_customers)]
        test_df.append(test_df_day)
    return pd.concat(test_df)


@pytest.mark.parametrize("delay", [7, 2])
def test_the_removal_matches_the_handbooks_code_on_random_data(delay: int) -> None:
    rng = np.random.default_rng(5)
    n = 6000
    tx = pd.DataFrame({"user_id": rng.integers(0, 300, n).astype(str), "ts": np.sort(rng.uniform(0, 30 * DAY_S, n)),
                       "label": (rng.random(n) < 0.03).astype(int)})  # fmt: skip
    start_day, train, test_days = 3, 7, 7
    expected = _handbook_test_set(tx, start_day, train, delay, test_days)
    test_start = (start_day + train + delay) * DAY_S
    test = tx[(tx["ts"] >= test_start) & (tx["ts"] < test_start + test_days * DAY_S)].reset_index(drop=True)
    keep = handbook_rows(tx, test, train_start=start_day * DAY_S, delay_days=delay)
    assert 0 < (~keep).sum() and test[keep]["ts"].tolist() == expected["ts"].tolist()


def test_card_precision_at_100_is_the_handbooks_on_a_hand_computed_case() -> None:
    rows: list[tuple[str, float, int]] = []
    scores: list[float] = []

    def add(user: str, day: int, score: float, label: int) -> None:
        rows.append((user, day * DAY_S + 100 + len(rows), label))
        scores.append(score)

    # Day 0: 150 cards; u0..u29 fraud (in the top 100), u120..u124 fraud (outside it).
    for i in range(150):
        add(f"u{i}", 0, 0.9 - i / 1000, int(i < 30 or 120 <= i < 125))
    # A card's score is its highest, its label its highest: one legit top-scored
    # transaction and one low-scored fraud make a top card with a fraud.
    add("multi", 0, 0.999, 0)
    add("multi", 0, 0.001, 1)
    # Top 100 of day 0: multi and u0..u98 -> 31 frauds: 0.31.
    # Day 1: the 31 cards detected on day 0 score highest and are fraud again: removed.
    for i in range(30):
        add(f"u{i}", 1, 1.0, 1)
    add("multi", 1, 1.0, 1)
    add("u120", 1, 0.95, 1)  # compromised on day 0 but not detected then: stays
    for i in range(200):
        add(f"v{i}", 1, 0.5 - i / 1000, int(i < 10))
    # Top 100 of day 1: u120 and v0..v98 -> 11 frauds: 0.11. Mean: 0.21.
    frame = _frame(rows)
    assert card_precision_at_k(frame, np.array(scores), k=100) == pytest.approx(0.21)


def test_auc_ap_and_cp_are_on_the_same_kept_rows_and_all_rows_are_labelled_apart() -> None:
    rng = np.random.default_rng(1)
    n = 2000
    rows = pd.DataFrame({"user_id": rng.integers(0, 400, n).astype(str), "ts": rng.uniform(0, 3 * DAY_S, n),
                         "label": (rng.random(n) < 0.1).astype(int)})  # fmt: skip
    scores = np.clip(rows["label"] * 0.3 + rng.random(n) * 0.7, 0, 1).to_numpy()
    keep = rng.random(n) < 0.8
    labels = rows["label"].to_numpy()
    m = evaluate_scores(labels, scores, rows, keep)
    assert m["auc"] == round(roc_auc_score(labels[keep], scores[keep]), 4)
    assert m["cp_at_100"] == round(card_precision_at_k(rows[keep].reset_index(drop=True), scores[keep]), 4)
    assert m["all_rows"] == evaluate_scores(labels, scores, rows)


def test_train_reports_the_handbook_rows_all_rows_and_the_baseline(trained_registry: Path) -> None:
    manifest = read_manifest(trained_registry)
    window, metrics = manifest["data_window"], manifest["metrics"]
    assert 0 < window["evaluated_rows"] < window["test_rows"] and window["removed_customers"] > 0
    assert set(metrics) == {"ensemble", "broad", "shallow", "forest", "behaviour", "baseline"}
    assert all(set(m) == {"auc", "ap", "cp_at_100", "all_rows"} for m in metrics.values())
    assert len(window["baseline"]["features"]) == 15 and window["baseline"]["rounds"] == 100
    # The Handbook's own feature definitions, from the history (not the served columns that approximate them).
    assert window["baseline"]["features"] == list(HANDBOOK_FEATURE_NAMES)
    assert window["baseline"]["definition"] == BASELINE_HANDBOOK


def test_the_saved_test_scores_reproduce_the_registered_metrics(trained_registry: Path) -> None:
    from models.registry import current_version, verify

    version = current_version(trained_registry)
    manifest = read_manifest(trained_registry, version)
    verify(trained_registry / version, manifest)  # the scores file is checksummed like the models
    assert "report/test_scores.parquet" in manifest["sha256"]
    scores = pd.read_parquet(trained_registry / version / "report" / "test_scores.parquet")
    assert len(scores) == manifest["data_window"]["test_rows"]
    assert int(scores["evaluated"].sum()) == manifest["data_window"]["evaluated_rows"]
    labels, keep = scores["label"].to_numpy(), scores["evaluated"].to_numpy()
    for name, expected in manifest["metrics"].items():
        assert evaluate_scores(labels, scores[name].to_numpy(), scores, keep) == expected, name


def test_the_threshold_table_is_precision_recall_and_alert_rate_by_hand() -> None:
    from models.evaluation import threshold_table

    labels = np.array([1, 0, 1, 0, 0, 0, 0, 0, 0, 1])
    scores = np.array([0.95, 0.8, 0.6, 0.4, 0.3, 0.2, 0.1, 0.05, 0.01, 0.02])
    table = threshold_table(labels, scores, thresholds=(0.5, 0.9, 0.99))
    assert table == [
        {"threshold": 0.5, "precision": round(2 / 3, 4), "recall": round(2 / 3, 4), "alert_rate": 0.3},
        {"threshold": 0.9, "precision": 1.0, "recall": round(1 / 3, 4), "alert_rate": 0.1},
    ] + [table[2]]
    assert table[2]["alert_rate"] == 0.0 and table[2]["recall"] == 0.0 and np.isnan(table[2]["precision"])
