"""Live quality: the join of labels with decisions, and the figures, on hand-checked cases."""

from __future__ import annotations

import asyncio

import fakeredis
import numpy as np
import pytest

from pipeline.labels import Label
from pipeline.quality import JoinLedger, RedisQualityStore, Served, format_quality, quality_report

T0 = 1_790_000_000.0


def served(txid: str, action: str, *, model: str = "v1", rule: str = "score", at: float = T0,
           shadow: str | None = None, shadow_action: str | None = None) -> Served:  # fmt: skip
    return Served(txid, model, "rules-1", rule, action, 0.5, at, shadow, shadow_action)


def label(txid: str, verdict: str, *, after_s: float = 3600.0, source: str = "chargeback") -> Label:
    return Label(txid, verdict, source, T0 + after_s)


# The hand-checked case: 10 decisions by v1.
#   declined: d1 fraud, d2 fraud, d3 legit           -> decline precision 2/3
#   reviewed: r1 fraud, r2 legit, r3 (no label)      -> review precision 1/2
#   approved: a1 fraud, a2 legit, a3 legit, a4 (none) -> one fraud let through
# Labelled frauds: d1 d2 r1 a1 = 4 -> decline recall 2/4, review 1/4, flagged 3/4;
# flagged precision 3/5; alert rate 6/10.
CASE = [
    ("d1", "decline", "fraud"), ("d2", "decline", "fraud"), ("d3", "decline", "legit"),
    ("r1", "review", "fraud"), ("r2", "review", "legit"), ("r3", "review", None),
    ("a1", "approve", "fraud"), ("a2", "approve", "legit"), ("a3", "approve", "legit"), ("a4", "approve", None),
]  # fmt: skip


def ledger_for_case(labels_first: bool = False) -> JoinLedger:
    ledger = JoinLedger()
    decisions = [served(txid, action) for txid, action, _ in CASE]
    labels = [label(txid, verdict, after_s=3600.0 * (i + 1)) for i, (txid, _, verdict) in enumerate(CASE) if verdict]
    if labels_first:
        for lb in labels:
            assert ledger.add_label(lb, now=T0) is None
        for s in decisions:
            ledger.add_served(s, now=T0)
    else:
        for s in decisions:
            assert ledger.add_served(s, now=T0) is None
        for lb in labels:
            assert ledger.add_label(lb, now=T0) is not None
    return ledger


@pytest.mark.parametrize("labels_first", [False, True])
def test_precision_recall_and_alert_rate_on_a_hand_checked_case(labels_first: bool) -> None:
    ledger = ledger_for_case(labels_first)
    report = quality_report(ledger.joined.values(), ledger.decided)
    v1 = report["models"]["v1"]
    assert (v1["decisions"], v1["labelled"], v1["fraud"]) == (10, 8, 4)
    assert v1["alert_rate"] == 0.6
    assert v1["actions"]["decline"] == {"labelled": 3, "fraud": 2, "precision": 0.6667, "recall": 0.5}
    assert v1["actions"]["review"] == {"labelled": 2, "fraud": 1, "precision": 0.5, "recall": 0.25}
    assert v1["actions"]["flagged"] == {"labelled": 5, "fraud": 3, "precision": 0.6, "recall": 0.75}
    # Label delays 1..9 h for the 8 labelled rows (the 6th and 10th have none).
    assert v1["label_delay_s"]["p50"] == pytest.approx(np.median([1, 2, 3, 4, 5, 7, 8, 9]) * 3600, abs=0.1)
    approve = report["rules"]["score/approve"]
    assert (approve["decided"], approve["labelled"], approve["fraud"], approve["legit"]) == (4, 3, 1, 2)
    assert approve["share_of_frauds"] == 0.25


def test_quality_is_kept_per_model_version_and_per_rule() -> None:
    ledger = JoinLedger()
    ledger.add_served(served("x1", "decline", model="v1"))
    ledger.add_served(served("x2", "approve", model="v2"))
    ledger.add_served(served("x3", "review", model="degraded", rule="degraded_amount"))
    ledger.add_served(served("x4", "decline", rule="block_list"))
    for txid in ("x1", "x2", "x3", "x4"):
        ledger.add_label(label(txid, "fraud"))
    report = quality_report(ledger.joined.values(), ledger.decided)
    assert set(report["models"]) == {"v1", "v2", "degraded"}
    assert report["models"]["v2"]["actions"]["flagged"]["recall"] == 0.0
    assert report["models"]["v1"]["actions"]["decline"]["precision"] == 1.0
    assert set(report["rules"]) == {"score/decline", "score/approve", "degraded_amount/review", "block_list/decline"}


def test_a_changed_verdict_replaces_the_first_and_a_redelivered_decision_counts_once() -> None:
    ledger = JoinLedger()
    ledger.add_served(served("t1", "decline"))
    ledger.add_served(served("t1", "decline"))  # redelivered feedback record
    ledger.add_label(label("t1", "fraud", source="customer"))
    ledger.add_label(label("t1", "legit", source="analyst", after_s=7200))
    report = quality_report(ledger.joined.values(), ledger.decided)
    assert report["models"]["v1"]["decisions"] == 1
    assert report["models"]["v1"]["actions"]["decline"] == {"labelled": 1, "fraud": 0, "precision": 0.0, "recall": None}


def test_waiting_decisions_expire_after_the_join_window() -> None:
    ledger = JoinLedger(window_s=86400.0, max_waiting=100)
    ledger.add_served(served("old", "approve", at=T0))
    ledger.add_served(served("new", "approve", at=T0 + 2 * 86400))
    assert ledger.add_label(label("old", "fraud")) is None  # too late to join: it waits as an early label
    assert ledger.add_label(label("new", "fraud")) is not None
    assert len(ledger.served) == 1


def test_shadow_quality_compares_with_what_was_served() -> None:
    ledger = JoinLedger()
    ledger.add_served(served("s1", "approve", shadow="v2", shadow_action="decline"))
    ledger.add_served(served("s2", "approve", shadow="v2", shadow_action="approve"))
    ledger.add_label(label("s1", "fraud"))
    ledger.add_label(label("s2", "legit"))
    report = quality_report(ledger.joined.values(), ledger.decided)
    v2 = report["shadows"]["v2"]
    assert v2["agreement"] == 0.5
    assert v2["actions"]["flagged"]["recall"] == 1.0 and v2["served_actions"]["flagged"]["recall"] == 0.0
    assert "v2" in format_quality(report)


def test_the_text_report_shows_each_model_and_rule() -> None:
    ledger = ledger_for_case()
    text = format_quality(quality_report(ledger.joined.values(), ledger.decided))
    assert "v1" in text and "60.00" in text and "0.667" in text and "score" in text


def test_the_redis_store_joins_in_either_order_and_counts_once() -> None:
    async def go() -> None:
        client = fakeredis.FakeAsyncRedis()
        store = RedisQualityStore(client, max_joined=1000)
        half = len(CASE) // 2
        # Labels of the first half arrive before their decisions; the rest after.
        early = [label(t, v) for t, _, v in CASE[:half] if v]
        assert await store.add_labels(early) == 0
        decisions = [served(t, a) for t, a, _ in CASE]
        assert await store.add_served(decisions) == len(early)
        assert await store.add_served(decisions[:3]) == 3  # redelivered: joined again, not counted again
        late = [label(t, v) for t, _, v in CASE[half:] if v]
        assert await store.add_labels(late) == len(late)
        joined, decided = await store.snapshot()
        report = quality_report(joined, decided)
        assert report["models"]["v1"]["decisions"] == 10
        assert report["models"]["v1"]["actions"]["flagged"] == {"labelled": 5, "fraud": 3, "precision": 0.6,
                                                                 "recall": 0.75}  # fmt: skip

    asyncio.run(go())


def test_the_redis_store_keeps_at_most_max_joined_rows_newest_first() -> None:
    async def go() -> None:
        store = RedisQualityStore(fakeredis.FakeAsyncRedis(), max_joined=3)
        await store.add_served([served(f"t{i}", "approve", at=T0 + i) for i in range(5)])
        await store.add_labels([label(f"t{i}", "legit") for i in range(5)])
        joined, decided = await store.snapshot()
        assert sorted(j.served.transaction_id for j in joined) == ["t2", "t3", "t4"]
        assert sum(decided.values()) == 5

    asyncio.run(go())



