"""The Scorer, end to end per batch, with in-memory fakes for Redis.

The real ensemble (trained on the session's tiny simulation) scores where the
test only needs *a* model; small fake models stand in where the test needs
control over the score or the time a prediction takes.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import gc
import math
import time
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pandas as pd
import pytest

from app.contract import Transaction
from app.placement import Placement
from pipeline.cache import UNCHECKED, InMemoryDecisionCache, LocalFirstCache
from pipeline.feature_store import Enrichment, InMemoryFeatureStore
from pipeline.features import (
    FEATURE_NAMES,
    FEATURE_SET_VERSION,
)
from pipeline.model import Prediction
from pipeline.resend_index import CONTENT_HASH, MemoryStore, ResendIndex
from pipeline.scorer import PROVISIONAL_REASON, BatchOutput, Inbound, Scorer
from pipeline.validate import Limits, validate
from tests.factories import ConstantModel, iso
from tests.scoring import BLOCKED_DEVICE, RULES, World, decisions, inbound, make_scorer

DECISION_FIELDS = {
    "transaction_id", "user_id", "fraud_score", "action", "explanation", "model_version",
    "rules_version", "cached", "degraded", "feature_age_s", "latency_ms", "correlation_id",
    "decided_at", "error",
}  # fmt: skip
LATENCY_KEYS = {"queue_wait", "validate", "cache", "features", "model", "rules", "total"}


# --- fixtures and helpers -----------------------------------------------------


class RecordingStore(InMemoryFeatureStore):
    """Remembers every transaction id it was asked to enrich, in order."""

    def __init__(self, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.enriched: list[str] = []

    async def enrich(self, txs: Sequence[Transaction]) -> list[Enrichment]:
        self.enriched.extend(tx.transaction_id for tx in txs)
        return await super().enrich(txs)


@pytest.fixture(scope="module")
def world(sim_frame: pd.DataFrame) -> World:
    return World(sim_frame)


@pytest.fixture(scope="module")
def ensemble(trained_registry: Path) -> Any:
    from models.registry import load_ensemble

    return load_ensemble(trained_registry)


def score(scorer: Scorer, batch: Sequence[Inbound]) -> BatchOutput:
    """One batch as the agent handles it: score, then store the new decisions in the cache."""

    async def go() -> BatchOutput:
        out = await scorer.score_batch(batch)
        await scorer.cache.put_many(out.to_cache)
        return out

    return asyncio.run(go())


def dead_letters(out: BatchOutput) -> list[tuple[bytes | None, dict[str, Any]]]:
    return [(key, orjson.loads(value)) for key, value in out.dead_letters]


def check_full_decision(d: dict[str, Any]) -> None:
    """Every contract field, with its type and range."""
    assert set(d) >= DECISION_FIELDS
    assert isinstance(d["transaction_id"], str) and d["transaction_id"]
    assert isinstance(d["user_id"], str) and d["user_id"]
    assert isinstance(d["fraud_score"], float) and 0.0 <= d["fraud_score"] <= 1.0
    assert d["action"] in ("approve", "review", "decline")
    assert isinstance(d["explanation"], list) and all(isinstance(w, str) and w for w in d["explanation"])
    assert isinstance(d["model_version"], str) and d["model_version"]
    assert d["rules_version"] == RULES.version
    assert d["cached"] is False
    assert d["degraded"] is False
    assert isinstance(d["feature_age_s"], float) and d["feature_age_s"] >= 0
    assert set(d["latency_ms"]) == LATENCY_KEYS
    assert all(isinstance(v, (int, float)) and v >= 0 for v in d["latency_ms"].values())
    assert d["latency_ms"]["total"] >= d["latency_ms"]["queue_wait"]
    assert d["error"] is None


# --- the happy path ------------------------------------------------------------


def test_valid_transaction_gets_one_full_decision(world: World, ensemble: Any) -> None:
    scorer = make_scorer(world, ensemble)
    doc = world.tx(0)
    out = score(scorer, [inbound(doc, world, correlation="corr-abc-123")])

    [d] = decisions(out)
    check_full_decision(d)
    assert d["transaction_id"] == doc["transaction_id"]
    assert d["user_id"] == doc["user_id"]
    assert d["model_version"] == ensemble.version
    assert d["correlation_id"] == "corr-abc-123"
    assert d["decided_at"] == world.now
    # The profile is as of midnight; the transaction is ~2 h later.
    assert d["feature_age_s"] == pytest.approx(2 * 3600.0 - 5.0, abs=1.0)
    assert out.dead_letters == []

    # Feedback carries the decision, the transaction and the features it was scored on.
    [(key, raw)] = out.feedback
    feedback = orjson.loads(raw)
    assert key == doc["transaction_id"].encode()
    assert feedback["decision"]["fraud_score"] == d["fraud_score"]
    assert feedback["transaction"]["transaction_id"] == doc["transaction_id"]
    assert feedback["feature_set"] == FEATURE_SET_VERSION
    assert list(feedback["features"]) == list(FEATURE_NAMES)
    assert feedback["features"]["amount_usd"] > 0
    assert feedback["features"]["velocity_count_24h"] >= 1  # the transaction itself

    # The monitoring record counts the batch.
    assert out.monitoring is not None
    monitoring = out.monitoring
    assert monitoring["counts"]["batch"] == 1
    assert monitoring["counts"][d["action"]] == 1
    assert monitoring["model_version"] == ensemble.version
    assert monitoring["rules_version"] == RULES.version
    assert sum(monitoring["score_histogram"]["counts"]) == 1
    assert {"validate", "cache", "features", "model", "rules"} <= set(monitoring["stage_ms"])


def test_a_batch_of_valid_transactions_is_scored_in_order(world: World, ensemble: Any) -> None:
    scorer = make_scorer(world, ensemble)
    docs = [world.tx(i) for i in range(20)]
    out = score(scorer, [inbound(doc, world, correlation=f"c-{i}") for i, doc in enumerate(docs)])
    got = decisions(out)
    assert [d["transaction_id"] for d in got] == [doc["transaction_id"] for doc in docs]
    assert [d["correlation_id"] for d in got] == [f"c-{i}" for i in range(20)]
    for d in got:
        check_full_decision(d)
    assert len(out.feedback) == 20 and len(out.to_cache) == 20


# --- invalid messages ------------------------------------------------------------


def test_invalid_json_without_an_id_goes_to_the_dead_letter_topic_only(world: World, ensemble: Any) -> None:
    scorer = make_scorer(world, ensemble)
    raw = b'{"transaction_id": "t-x", "amount": 12.5,'  # truncated
    out = score(scorer, [inbound(raw, world, correlation="corr-bad", offset=17)])

    assert out.decisions == []
    [(key, dlq)] = dead_letters(out)
    assert key is None
    assert dlq["error"]["code"] == "bad_json"
    assert dlq["error"]["field"] is None
    assert isinstance(dlq["error"]["reason"], str) and dlq["error"]["reason"]
    assert dlq["transaction_id"] is None
    assert base64.b64decode(dlq["value_b64"]) == raw
    assert base64.b64decode(dlq["headers"]["correlation-id"]) == b"corr-bad"
    assert (dlq["partition"], dlq["offset"]) == (0, 17)
    assert (out.monitoring or {})["counts"]["rejected"] == 1


@pytest.mark.parametrize(
    "raw",
    [
        b"\xff\xfe not utf-8",
        b"[1, 2, 3]",
        b'"just a string"',
        b"",
        b"[" * 5000 + b"]" * 5000,  # nesting deeper than the parser takes
        b'{"amount": NaN}',
    ],
    ids=["not-utf8", "array", "string", "empty", "deep", "nan"],
)
def test_unreadable_messages_never_get_a_decision(world: World, ensemble: Any, raw: bytes) -> None:
    scorer = make_scorer(world, ensemble)
    out = score(scorer, [inbound(raw, world)])
    assert out.decisions == []
    [(key, dlq)] = dead_letters(out)
    assert key is None
    assert dlq["error"]["code"] in ("bad_json", "not_an_object")
    assert base64.b64decode(dlq["value_b64"]) == raw


@pytest.mark.parametrize(
    ("change", "code", "field"),
    [
        ({"amount": -5}, "out_of_range", "amount"),
        ({"amount": "12.50"}, "wrong_type", "amount"),
        ({"merchant_id": None}, "missing_field", "merchant_id"),
        ({"currency": "XXX"}, "unknown_currency", "currency"),
        ({"timestamp": "yesterday"}, "bad_timestamp", "timestamp"),
        ({"timestamp": "2020-01-01T00:00:00Z"}, "timestamp_out_of_window", "timestamp"),
        ({"lat": None}, "inconsistent", "lat"),
    ],
)
def test_invalid_transaction_with_a_readable_id_gets_a_reject_and_a_dead_letter(
    world: World, ensemble: Any, change: dict[str, Any], code: str, field: str
) -> None:
    scorer = make_scorer(world, ensemble)
    doc = world.tx(1)
    doc.update(change)
    doc = {k: v for k, v in doc.items() if v is not None}
    out = score(scorer, [inbound(doc, world, correlation="corr-rej")])

    [d] = decisions(out)
    assert d["transaction_id"] == doc["transaction_id"]
    assert d["user_id"] == doc["user_id"]
    assert d["action"] == "reject"
    assert d["fraud_score"] == 0.0
    assert d["error"]["code"] == code and d["error"]["field"] == field
    assert d["explanation"] and d["explanation"][0].startswith(code)
    assert d["correlation_id"] == "corr-rej"
    assert d["rules_version"] == RULES.version
    [(key, dlq)] = dead_letters(out)
    assert key == doc["transaction_id"].encode()
    assert dlq["error"] == {"code": code, "field": field, "reason": d["error"]["reason"]}
    assert orjson.loads(base64.b64decode(dlq["value_b64"])) == doc
    assert out.feedback == [] and out.to_cache == []


# --- resends ---------------------------------------------------------------------

COMPARED = ("transaction_id", "user_id", "fraud_score", "action", "explanation", "model_version",
            "rules_version", "degraded", "feature_age_s", "decided_at")  # fmt: skip


def test_a_resend_in_a_later_batch_is_answered_from_the_cache(world: World, ensemble: Any) -> None:
    store = RecordingStore(world.profiles, world.merchants)
    scorer = make_scorer(world, ensemble, store=store)
    doc = world.tx(2)
    [first] = decisions(score(scorer, [inbound(doc, world, correlation="first")]))
    others = [world.tx(i) for i in range(3, 6)]
    out = score(scorer, [inbound(o, world) for o in others] + [inbound(doc, world, correlation="again")])

    got = decisions(out)
    assert len(got) == 4
    [again] = [d for d in got if d["transaction_id"] == doc["transaction_id"]]
    assert again["cached"] is True
    assert {k: again[k] for k in COMPARED} == {k: first[k] for k in COMPARED}
    assert again["correlation_id"] == "again"
    assert {"queue_wait", "total"} <= set(again["latency_ms"])
    # The resend never reached the feature store: velocity counted once.
    assert store.enriched.count(doc["transaction_id"]) == 1
    assert list(store.events[doc["user_id"]]).count(doc["transaction_id"]) == 1
    # ...and is not scored, cached or fed back again.
    assert all(tx.transaction_id != doc["transaction_id"] for tx, _ in out.to_cache)
    assert [k for k, _ in out.feedback] == [o["transaction_id"].encode() for o in others]
    assert (out.monitoring or {})["counts"]["cached"] == 1


def test_the_same_transaction_twice_in_one_batch_gets_two_identical_decisions(world: World, ensemble: Any) -> None:
    store = RecordingStore(world.profiles, world.merchants)
    scorer = make_scorer(world, ensemble, store=store)
    doc = world.tx(6)
    out = score(scorer, [inbound(doc, world, correlation="a"), inbound(doc, world, correlation="b")])

    first, second = decisions(out)
    check_full_decision(first)
    assert first["correlation_id"] == "a"
    assert second["cached"] is True and second["correlation_id"] == "b"
    assert {k: second[k] for k in COMPARED} == {k: first[k] for k in COMPARED}
    assert store.enriched == [doc["transaction_id"]]
    assert len(out.feedback) == 1 and len(out.to_cache) == 1


def test_a_resend_under_a_new_id_is_recognised_by_its_content(world: World, ensemble: Any) -> None:
    store = RecordingStore(world.profiles, world.merchants)
    scorer = make_scorer(world, ensemble, store=store)
    doc = world.tx(7)
    [first] = decisions(score(scorer, [inbound(doc, world)]))
    retry = dict(doc, transaction_id=doc["transaction_id"] + "-retry")
    [again] = decisions(score(scorer, [inbound(retry, world)]))

    assert again["transaction_id"] == retry["transaction_id"]
    assert again["cached"] is True
    assert (again["fraud_score"], again["action"], again["explanation"]) == (
        first["fraud_score"], first["action"], first["explanation"],
    )  # fmt: skip
    assert store.enriched == [doc["transaction_id"]]


def test_a_content_resend_in_the_same_batch_follows_the_first(world: World, ensemble: Any) -> None:
    store = RecordingStore(world.profiles, world.merchants)
    scorer = make_scorer(world, ensemble, store=store)
    doc = world.tx(8)
    retry = dict(doc, transaction_id=doc["transaction_id"] + "-retry")
    first, second = decisions(score(scorer, [inbound(doc, world), inbound(retry, world)]))
    assert first["cached"] is False and second["cached"] is True
    assert second["transaction_id"] == retry["transaction_id"]
    assert second["fraud_score"] == first["fraud_score"] and second["action"] == first["action"]
    assert store.enriched == [doc["transaction_id"]]


def test_same_amount_at_another_time_is_not_a_resend(world: World, ensemble: Any) -> None:
    scorer = make_scorer(world, ensemble)
    doc = world.tx(9)
    later = dict(doc, transaction_id=doc["transaction_id"] + "-b", timestamp=iso(world.now - 1.0))
    first, second = decisions(score(scorer, [inbound(doc, world), inbound(later, world)]))
    assert first["cached"] is False and second["cached"] is False


# --- degraded paths ----------------------------------------------------------------


def test_feature_store_failure_degrades_every_decision_to_rules(world: World, ensemble: Any) -> None:
    store = world.store()
    store.fail = ConnectionError("redis down")
    scorer = make_scorer(world, ensemble, store=store)
    small = [world.tx(i, amount=20.0) for i in range(10, 15)]
    large = world.tx(15, amount=5000.0, currency="USD")  # over the degraded review amount
    huge = world.tx(16, amount=15000.0, currency="USD")
    blocked = world.tx(17, device_id=BLOCKED_DEVICE)
    docs = [*small, large, huge, blocked]
    out = score(scorer, [inbound(doc, world, correlation=f"c{i}") for i, doc in enumerate(docs)])

    got = decisions(out)
    assert [d["transaction_id"] for d in got] == [doc["transaction_id"] for doc in docs]  # none lost
    assert out.dead_letters == []
    for i, d in enumerate(got):
        assert d["degraded"] is True
        assert d["cached"] is False
        assert d["model_version"] is None
        assert d["rules_version"] == RULES.version
        assert d["feature_age_s"] is None
        assert d["correlation_id"] == f"c{i}"
        assert "degraded: feature store unavailable" in d["explanation"]
        assert 0.0 <= d["fraud_score"] <= 1.0
        assert set(d["latency_ms"]) == LATENCY_KEYS
    assert [d["action"] for d in got] == ["approve"] * 5 + ["review", "review", "decline"]
    assert any("forced review" in w for w in got[6]["explanation"])
    assert any(BLOCKED_DEVICE in w for w in got[7]["explanation"])
    # Feedback still goes out, without features.
    assert len(out.feedback) == len(docs)
    assert all(orjson.loads(v)["features"] is None for _, v in out.feedback)
    counts = (out.monitoring or {})["counts"]
    assert counts["degraded"] == len(docs) and counts["batch"] == len(docs)


def test_feature_store_recovery_brings_full_decisions_back(world: World, ensemble: Any) -> None:
    store = world.store()
    scorer = make_scorer(world, ensemble, store=store)
    store.fail = ConnectionError("redis down")
    [down] = decisions(score(scorer, [inbound(world.tx(18), world)]))
    store.fail = None
    [back] = decisions(score(scorer, [inbound(world.tx(19), world)]))
    assert down["degraded"] is True
    check_full_decision(back)


def test_a_model_over_its_budget_degrades_within_the_budget(world: World) -> None:
    slow = ConstantModel(0.2, sleep_s=1.0)
    scorer = make_scorer(world, slow, model_budget_s=0.05)
    docs = [world.tx(i, amount=30.0) for i in range(20, 24)]
    started = time.perf_counter()
    out = asyncio.run(scorer.score_batch([inbound(doc, world) for doc in docs]))
    elapsed = time.perf_counter() - started

    assert elapsed < 0.5, f"a batch waited {elapsed:.2f} s for a model with a 50 ms budget"
    got = decisions(out)
    assert len(got) == 4
    for d in got:
        assert d["degraded"] is True and d["model_version"] is None
        assert d["action"] == "approve"
        assert any("budget" in w for w in d["explanation"])
        assert d["latency_ms"]["model"] < 500
        # Features were read: the age of the profile is still known.
        assert d["feature_age_s"] is not None
    scorer._model_thread.shutdown(wait=True)


class InlineModel(ConstantModel):
    """Scores also offered for the loop (as compiled trees are)."""

    def __init__(self, score: float) -> None:
        super().__init__(score)
        self.inline_calls = 0

    def inline_scores(self, matrix: np.ndarray) -> np.ndarray:
        self.inline_calls += 1
        return np.full(matrix.shape[0], self.score)


def test_a_batch_that_needs_no_reasons_is_scored_without_the_model_thread(world: World) -> None:
    low = InlineModel(0.05)
    got = decisions(score(make_scorer(world, low), [inbound(world.tx(i, amount=30.0), world) for i in range(40, 44)]))
    assert (low.inline_calls, low.calls) == (1, 0)
    assert [(d["action"], d["degraded"], d["fraud_score"]) for d in got] == [("approve", False, 0.05)] * 4
    assert all(d["model_version"] == low.version for d in got)


def test_a_batch_with_a_row_to_explain_goes_to_the_model_thread_for_its_reasons(world: World) -> None:
    high = InlineModel(RULES.review_threshold + 0.01)
    [d] = decisions(score(make_scorer(world, high), [inbound(world.tx(44, amount=30.0), world)]))
    assert (high.inline_calls, high.calls) == (1, 1)
    assert d["action"] == "review" and not d["degraded"]
    assert d["explanation"][1].startswith("amount "), d["explanation"]  # the reason the model gave


def test_a_failing_model_degrades_to_rules(world: World) -> None:
    class Broken(ConstantModel):
        def predict(self, matrix: np.ndarray, explain_above: float | None = 0.0) -> Prediction:
            raise ValueError("corrupt booster")

    scorer = make_scorer(world, Broken())
    docs = [world.tx(24), world.tx(25, amount=15000.0, currency="USD")]
    got = decisions(score(scorer, [inbound(doc, world) for doc in docs]))
    assert [d["degraded"] for d in got] == [True, True]
    assert [d["action"] for d in got] == ["approve", "review"]
    assert any("model failed" in w for w in got[0]["explanation"])


def test_no_model_loaded_degrades_to_rules(world: World) -> None:
    scorer = make_scorer(world, None)
    [d] = decisions(score(scorer, [inbound(world.tx(26), world)]))
    assert d["degraded"] is True and d["action"] == "approve"
    assert "degraded: no model loaded" in d["explanation"]


# --- rules -----------------------------------------------------------------------------


def test_amount_over_the_review_limit_is_reviewed_by_rule(world: World, ensemble: Any) -> None:
    scorer = make_scorer(world, ConstantModel(0.05))
    [d] = decisions(score(scorer, [inbound(world.tx(27, amount=15000.0, currency="USD"), world)]))
    check_full_decision(d)
    assert d["action"] == "review"
    assert d["explanation"][0] == "amount 15,000.00 USD over 10,000: forced review"
    assert d["fraud_score"] == pytest.approx(0.05)

    # With the real ensemble the rule still applies: review, or decline at a decline-level score.
    real = make_scorer(world, ensemble)
    [d] = decisions(score(real, [inbound(world.tx(28, amount=15000.0, currency="USD"), world)]))
    check_full_decision(d)
    if d["fraud_score"] >= RULES.decline_threshold:  # the score decided, and says so first
        assert d["action"] == "decline"
        assert d["explanation"][0].startswith(f"score {d['fraud_score']:.3f} at or above decline threshold")
        assert "amount 15,000.00 USD over 10,000: at least review" in d["explanation"]
    else:
        assert d["action"] == "review"
        assert "forced review" in d["explanation"][0]

    # A decline-level score: the explanation names the decline threshold first, never "forced review".
    high = make_scorer(world, ConstantModel(0.986))
    [d] = decisions(score(high, [inbound(world.tx(30, amount=15000.0, currency="USD"), world)]))
    assert d["action"] == "decline"
    assert d["explanation"][0] == "score 0.986 at or above decline threshold 0.9"
    assert d["explanation"][1] == "amount 15,000.00 USD over 10,000: at least review"
    assert not any("forced review" in w for w in d["explanation"])


def test_a_blocklisted_device_is_declined(world: World, ensemble: Any) -> None:
    scorer = make_scorer(world, ensemble)
    [d] = decisions(score(scorer, [inbound(world.tx(29, device_id=BLOCKED_DEVICE), world)]))
    check_full_decision(d)
    assert d["action"] == "decline"
    assert d["explanation"][0] == f"blocked device {BLOCKED_DEVICE}"


def test_a_decline_level_score_declines(world: World) -> None:
    scorer = make_scorer(world, ConstantModel(0.97))
    [d] = decisions(score(scorer, [inbound(world.tx(30), world)]))
    assert d["action"] == "decline" and d["fraud_score"] == pytest.approx(0.97)
    assert any("decline threshold" in w for w in d["explanation"])


# --- poison messages ---------------------------------------------------------------------


def test_one_poison_message_does_not_cost_the_other_31(world: World, ensemble: Any) -> None:
    scorer = make_scorer(world, ensemble)
    docs = [world.tx(i) for i in range(40, 71)]
    poison = {"transaction_id": "t-poison-1", "user_id": "u-poison", "amount": {"$gt": 0},
              "merchant_id": "m-1", "timestamp": iso(world.now)}  # fmt: skip
    batch = [inbound(doc, world) for doc in docs[:13]]
    batch.append(inbound(poison, world))
    batch += [inbound(doc, world) for doc in docs[13:]]
    assert len(batch) == 32

    out = score(scorer, batch)
    got = decisions(out)
    assert len(got) == 32
    rejects = [d for d in got if d["action"] == "reject"]
    assert [d["transaction_id"] for d in rejects] == ["t-poison-1"]
    assert rejects[0]["error"]["code"] == "wrong_type"
    scored = [d for d in got if d["action"] != "reject"]
    assert sorted(d["transaction_id"] for d in scored) == sorted(doc["transaction_id"] for doc in docs)
    for d in scored:
        check_full_decision(d)
    assert len(out.dead_letters) == 1
    counts = (out.monitoring or {})["counts"]
    assert counts["batch"] == 32 and counts["rejected"] == 1
    assert sum(counts.get(a, 0) for a in ("approve", "review", "decline")) == 31


def test_a_bug_in_scoring_rejects_the_batch_instead_of_raising(world: World, ensemble: Any) -> None:
    class Buggy(InMemoryFeatureStore):
        async def enrich(self, txs: Sequence[Transaction]) -> list[Enrichment]:
            return [object()] * len(txs)  # type: ignore[list-item]  # a bug, not an outage

    scorer = make_scorer(world, ensemble, store=Buggy())
    docs = [world.tx(i) for i in range(71, 74)]
    out = asyncio.run(scorer.score_batch([inbound(doc, world) for doc in docs] + [inbound(b"nope", world)]))
    # Nothing escaped, and every message has exactly one outcome.
    got = decisions(out)
    assert sorted(d["transaction_id"] for d in got) == sorted(doc["transaction_id"] for doc in docs)
    assert all(d["action"] == "reject" and d["error"]["code"] == "internal_error" for d in got)
    letters = dead_letters(out)
    assert len(letters) == 4
    assert [key for key, _ in letters].count(None) == 1


def test_mixed_batch_every_message_has_exactly_one_outcome(world: World, ensemble: Any) -> None:
    scorer = make_scorer(world, ensemble)
    earlier = [world.tx(i) for i in range(80, 84)]
    score(scorer, [inbound(doc, world) for doc in earlier])

    fresh = [world.tx(i) for i in range(84, 100)]
    bad_with_id = [dict(world.tx(i), currency="ZZZ") for i in range(100, 104)]
    unreadable = [b"{{", b"null", b"\x00\x01"]
    batch = (
        [inbound(doc, world) for doc in fresh]
        + [inbound(doc, world) for doc in bad_with_id]
        + [inbound(raw, world) for raw in unreadable]
        + [inbound(doc, world) for doc in earlier]
        + [inbound(fresh[0], world)]
    )
    out = score(scorer, batch)
    got = decisions(out)
    by_id: dict[str, list[dict[str, Any]]] = {}
    for d in got:
        by_id.setdefault(d["transaction_id"], []).append(d)
    assert len(got) == len(batch) - len(unreadable)
    assert all(len(v) == 1 for k, v in by_id.items() if k != fresh[0]["transaction_id"])
    assert [d["cached"] for d in by_id[fresh[0]["transaction_id"]]] == [False, True]
    assert all(by_id[doc["transaction_id"]][0]["cached"] for doc in earlier)
    assert all(by_id[doc["transaction_id"]][0]["action"] == "reject" for doc in bad_with_id)
    assert len(out.dead_letters) == len(bad_with_id) + len(unreadable)


def test_inbound_reads_the_correlation_id_from_any_known_header() -> None:
    assert Inbound(b"", {"correlation-id": b"a"}).correlation_id == "a"
    assert Inbound(b"", {"x-correlation-id": b"b"}).correlation_id == "b"
    assert Inbound(b"", {}).correlation_id is None
    assert Inbound(b"", {"correlation-id": b"\xff" + b"x" * 300}).correlation_id is not None
    assert len(Inbound(b"", {"correlation-id": b"x" * 300}).correlation_id or "") == 128


def test_transactions_keep_their_types_in_feedback(world: World, ensemble: Any) -> None:
    scorer = make_scorer(world, ensemble)
    doc = world.tx(104, amount=10)  # an integer amount in the JSON
    out = score(scorer, [inbound(doc, world)])
    feedback = orjson.loads(out.feedback[0][1])
    assert feedback["transaction"]["amount"] == 10.0
    assert feedback["transaction"]["timestamp"] == pytest.approx(datetime.fromisoformat(doc["timestamp"]).timestamp())


def test_feedback_holds_the_decision_as_sent_and_a_feature_not_computable_as_null(world: World, ensemble: Any) -> None:
    scorer = make_scorer(world, ensemble)
    doc = world.tx(105)
    doc.pop("device_id", None)  # optional: new_device cannot be computed (NaN), and JSON has no NaN
    out = score(scorer, [inbound(doc, world)])
    [(_, sent, _, _)] = out.decisions
    feedback = orjson.loads(out.feedback[0][1])
    assert feedback["decision"] == orjson.loads(sent)
    assert feedback["features"]["new_device"] is None
    assert feedback["features"]["amount_usd"] > 0


def test_an_oversized_message_leaves_a_dead_letter_small_enough_to_produce() -> None:
    """The dead letter keeps a prefix, the size and the sha256 of a value over the
    limit: its base64 must stay far below the producer's 1 MB request limit."""
    import base64 as b64
    import hashlib

    from pipeline.validate import Limits

    scorer = Scorer(
        model=None,
        rules=RULES,
        store=InMemoryFeatureStore(),
        cache=InMemoryDecisionCache(),
        limits=Limits(max_message_bytes=64 * 1024),
    )
    value = b'{"transaction_id": "t-big", "pad": "' + b"x" * 800_000 + b'"}'
    out = asyncio.run(scorer.score_batch([Inbound(value, {"h": b"y" * 100_000}, time.time(), 3, 7)]))
    ((_, letter),) = out.dead_letters
    assert len(letter) < 20_000
    record = orjson.loads(letter)
    assert record["error"]["code"] == "too_large"
    assert record["value_truncated"] is True and record["value_bytes"] == len(value)
    assert record["value_sha256"] == hashlib.sha256(value).hexdigest()
    assert value.startswith(b64.b64decode(record["value_b64"]))
    assert (record["partition"], record["offset"]) == (3, 7)


# --- resends while the shared decision cache cannot be read --------------------------------------


class StalledCache:
    """A shared decision cache that is down (a Redis SIGSTOPped or past its timeout):
    the real protocol, every call failing as redis-py's would."""

    def __init__(self) -> None:
        self.calls = 0

    async def get_many(self, txs: Sequence[Any]) -> list[dict[str, Any] | None]:
        self.calls += 1
        raise TimeoutError("Timeout reading from socket")

    async def put_many(self, items: Sequence[Any]) -> None:
        raise TimeoutError("Timeout writing to socket")


def test_a_transaction_the_cache_cannot_check_is_provisional_and_never_approved(world: World, ensemble: Any) -> None:
    scorer = make_scorer(world, ensemble, cache=LocalFirstCache(StalledCache(), wait_s=0.03, retry_every_s=0.01))
    docs = [world.tx(i) for i in range(12)]

    got = decisions(asyncio.run(scorer.score_batch([inbound(d, world) for d in docs])))

    assert len(got) == 12 and all(d["provisional"] for d in got)
    assert not [d for d in got if d["action"] == "approve"]  # a resend of a decline must not be approved
    assert all(PROVISIONAL_REASON in d["explanation"] for d in got)
    assert scorer.cache.unchecked == 12  # type: ignore[attr-defined]
    assert scorer.cache.shared.calls >= 2  # type: ignore[attr-defined]  # retried within wait_s


def test_a_resend_on_the_same_worker_is_answered_from_memory_while_redis_is_stalled(
    world: World, ensemble: Any
) -> None:
    shared = InMemoryDecisionCache()
    scorer = make_scorer(world, ensemble, cache=LocalFirstCache(shared, wait_s=0.03))
    doc = world.tx(3)
    [first] = decisions(score(scorer, [inbound(doc, world, correlation="first")]))
    assert first["provisional"] is False

    scorer.cache.shared = StalledCache()  # type: ignore[attr-defined]
    [again] = decisions(asyncio.run(scorer.score_batch([inbound(doc, world, correlation="again")])))

    assert again["cached"] is True and again["provisional"] is False
    assert {k: again[k] for k in COMPARED} == {k: first[k] for k in COMPARED}


class BrokenStore(MemoryStore):
    """A resend index whose disk fails."""

    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        raise OSError("Input/output error")


def indexed_cache(shared: Any = None, store: Any = None) -> LocalFirstCache:
    return LocalFirstCache(shared, index=ResendIndex(store or MemoryStore(), 3600), wait_s=0.03)


def test_with_a_resend_index_a_stalled_redis_decides_nothing_provisionally(world: World, ensemble: Any) -> None:
    """The index holds every decision the partition committed: a miss there is
    a first sight, whatever Redis (a second level here) answers or does not."""
    scorer = make_scorer(world, ensemble, cache=indexed_cache(StalledCache()))
    docs = [world.tx(i) for i in range(12)]
    out = asyncio.run(scorer.score_batch([inbound(d, world) for d in docs]))
    got = decisions(out)
    assert len(got) == 12 and not [d for d in got if d["provisional"]]
    assert scorer.cache.unchecked == 0  # type: ignore[attr-defined]

    # Committed: into the index; a resend (another batch, another worker's cache) is answered from it.
    scorer.cache.committed(out.indexed)  # type: ignore[attr-defined]
    fresh = make_scorer(world, ensemble, cache=LocalFirstCache(None, index=scorer.cache.index))  # type: ignore[attr-defined]
    again = decisions(asyncio.run(fresh.score_batch([inbound(d, world, correlation="again") for d in docs[:3]])))
    assert [d["cached"] for d in again] == [True] * 3
    assert [{k: d[k] for k in COMPARED} for d in again] == [{k: d[k] for k in COMPARED} for d in got[:3]]


def test_an_index_that_cannot_be_read_decides_provisionally(world: World, ensemble: Any) -> None:
    scorer = make_scorer(world, ensemble, cache=indexed_cache(store=BrokenStore()))
    got = decisions(asyncio.run(scorer.score_batch([inbound(world.tx(i), world) for i in range(4)])))
    assert all(d["provisional"] and d["action"] != "approve" for d in got)
    assert scorer.cache.unchecked == 4  # type: ignore[attr-defined]  # once each, for the worker's metric


def test_each_decision_goes_to_its_transaction_s_partition_a_new_one_as_an_index_entry(
    world: World, ensemble: Any
) -> None:
    """Partition p of ``decisions`` holds the decisions of partition p of
    ``transactions``: the changelog of p's resend index. A new decision
    carries its content hash (the entry's one part not in the record); a
    copy answered from it carries none, and a restore reads back the entries."""
    scorer = make_scorer(world, ensemble, cache=indexed_cache())
    docs = [world.tx(i) for i in range(3)]
    batch = [dataclasses.replace(inbound(d, world), partition=p) for p, d in zip((0, 5, 5), docs)]
    batch.append(dataclasses.replace(inbound(docs[0], world, correlation="copy"), partition=0))  # a copy: answered, not an entry
    out = asyncio.run(scorer.score_batch(batch))
    placed = out.placed({"decisions": "dec", "transactions": "tx"})
    assert [(topic, partition) for topic, partition, *_ in placed] == [("dec", 0), ("dec", 5), ("dec", 5), ("dec", 0)]
    entries = [(value, headers) for _, _, _, value, headers in placed if CONTENT_HASH in dict(headers)]
    assert [orjson.loads(value)["transaction_id"] for value, _ in entries] == [d["transaction_id"] for d in docs]
    assert not any(topic == "dec" for topic, *_ in out.records({"decisions": "dec", "dead_letters": "dlq",
                                                                 "feedback": "f", "monitoring": "m"}))  # fmt: skip

    restored = ResendIndex(MemoryStore(), 3600)
    assert restored.restore([(value, headers, time.time()) for _, _, _, value, headers in placed], "dec") == 3
    txs = [validate(orjson.dumps(d), world.now, Limits()) for d in docs]
    held = [orjson.loads(v) for _, v in out.indexed]
    assert [orjson.loads(f or b"null") for f in restored.get_many(txs)] == held  # type: ignore[arg-type]
    assert all("latency_ms" not in entry for entry in held)  # per delivery: a cached answer carries its own


def test_a_record_away_from_its_home_partition_is_rerouted_not_decided(world: World, ensemble: Any) -> None:
    """Its resends land at its home, whose index must see its decision: it is
    produced there (same value and headers, keyed by its user) and decided by
    that partition's owner; here it costs no admission and no features."""
    store = RecordingStore(world.profiles, world.merchants)
    placement = Placement(8)
    scorer = make_scorer(world, ensemble, store=store, cache=indexed_cache(), placement=placement)
    home, away = world.tx(1), world.tx(2)
    at_home = dataclasses.replace(inbound(home, world), partition=placement.home(home["user_id"]))
    elsewhere = dataclasses.replace(inbound(away, world, correlation="c-away"), key=b"not-the-user",
                                    partition=(placement.home(away["user_id"]) + 1) % 8)  # fmt: skip
    out = asyncio.run(scorer.score_batch([at_home, elsewhere]))

    assert [d["transaction_id"] for d in decisions(out)] == [home["transaction_id"]]
    assert store.enriched == [home["transaction_id"]]
    [(topic, partition, key, value, headers)] = out.placed({"decisions": "dec", "transactions": "tx"})[1:]
    assert (topic, partition, key, value) == ("tx", placement.home(away["user_id"]), away["user_id"].encode(),
                                              elsewhere.value)  # fmt: skip
    assert ("correlation-id", b"c-away") in headers
    assert out.monitoring is not None and out.monitoring["counts"]["rerouted"] == 1


def test_a_stale_local_entry_goes_to_the_shared_cache(world: World) -> None:
    clock = [0.0]
    cache = LocalFirstCache(InMemoryDecisionCache(), ttl_s=10, wait_s=0.0, clock=lambda: clock[0])
    tx = validate(orjson.dumps(world.tx(1)), world.now, Limits())
    assert isinstance(tx, Transaction)
    asyncio.run(cache.put_many([(tx, orjson.dumps({"action": "decline"}))]))
    assert asyncio.run(cache.get_many([tx])) == [{"action": "decline"}]
    clock[0] = 11.0  # past its TTL here; and the shared cache is down
    cache.shared = StalledCache()
    assert asyncio.run(cache.get_many([tx])) == [UNCHECKED]


def test_a_worker_s_held_decisions_add_nothing_for_the_garbage_collector_to_walk(world: World) -> None:
    """The local cache holds tens of thousands of decisions: kept as dicts they
    made every full collection a long pause of the scoring loop."""
    cache = LocalFirstCache(InMemoryDecisionCache())
    txs = [validate(orjson.dumps(world.tx(i)), world.now, Limits()) for i in range(2000)]
    items = [
        (tx, orjson.dumps({"action": "approve", "latency_ms": {"total": 1.0}, "explanation": ["x"]})) for tx in txs
    ]
    gc.collect()
    before = len(gc.get_objects())
    cache.hold(items)  # type: ignore[arg-type]
    del items
    gc.collect()

    assert len(gc.get_objects()) - before < 50  # not one per decision
    assert asyncio.run(cache.get_many(txs[:1]))[0]["latency_ms"] == {"total": 1.0}  # type: ignore[arg-type]


def test_every_outcome_becomes_one_record_on_its_topic(world: World, ensemble: Any) -> None:
    scorer = make_scorer(world, ensemble)
    batch = [
        Inbound(value=orjson.dumps(world.tx(i)), timestamp=world.now, partition=i % 3, offset=i) for i in range(6)
    ] + [Inbound(value=b"{not json", timestamp=world.now, partition=2, offset=9)]
    out = score(scorer, batch)
    topics = {"decisions": "d", "dead_letters": "dlq", "feedback": "f", "monitoring": "m"}

    records = out.records(topics)
    placed = out.placed({**topics, "transactions": "tx"})

    # Each decision on its transaction's partition (the resend index's changelog).
    decided = [(orjson.loads(v)["transaction_id"], p) for t, p, _, v, _ in placed if t == "d"]
    assert sorted(decided) == sorted((orjson.loads(m.value)["transaction_id"], m.partition) for m in batch[:6])
    assert [t for t, _, _, _ in records].count("dlq") == 1  # the unreadable record: a dead letter only
    assert [t for t, _, _, _ in records].count("f") == 6  # a feedback record per decision
    assert [t for t, _, _, _ in records].count("m") == 1  # the batch's monitoring record, once
    assert len(records) + len(placed) == len(out.decisions) + len(out.dead_letters) + len(out.feedback) + 1


# --- what the review endpoint serves, against its OpenAPI schema ----------------


def _check_schema(value: Any, schema: dict[str, Any], schemas: dict[str, Any], where: str = "$") -> None:
    """The JSON Schema subset the gateway's document uses: $ref, oneOf, type
    (lists too), enum, required, properties, additionalProperties, items, bounds."""
    if "$ref" in schema:
        return _check_schema(value, schemas[schema["$ref"].rsplit("/", 1)[-1]], schemas, where)
    if "oneOf" in schema:
        matches = 0
        for option in schema["oneOf"]:
            try:
                _check_schema(value, option, schemas, where)
                matches += 1
            except AssertionError:
                pass
        assert matches == 1, f"{where}: {value!r} matches {matches} of oneOf"
        return None
    kinds = {"string": str, "number": (int, float), "integer": int, "boolean": bool, "object": dict,
             "array": list, "null": type(None)}  # fmt: skip
    types = schema.get("type")
    if types is not None:
        allowed = [types] if isinstance(types, str) else types
        ok = any(isinstance(value, kinds[t]) and not (t in ("number", "integer") and isinstance(value, bool))
                 for t in allowed)  # fmt: skip
        assert ok, f"{where}: {value!r} is not {allowed}"
    if "enum" in schema:
        assert value in schema["enum"], f"{where}: {value!r} not in {schema['enum']}"
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        assert value >= schema.get("minimum", -math.inf) and value <= schema.get("maximum", math.inf), where
        assert value > schema.get("exclusiveMinimum", -math.inf), where
    if isinstance(value, dict):
        for name in schema.get("required", []):
            assert name in value, f"{where}: {name} missing"
        props = schema.get("properties", {})
        for name, item in value.items():
            if name in props:
                _check_schema(item, props[name], schemas, f"{where}.{name}")
            elif isinstance(schema.get("additionalProperties"), dict):
                _check_schema(item, schema["additionalProperties"], schemas, f"{where}.{name}")
    if isinstance(value, list) and "items" in schema:
        for i, item in enumerate(value):
            _check_schema(item, schema["items"], schemas, f"{where}[{i}]")
    return None


def test_served_review_items_match_the_openapi_schema(world: World) -> None:
    from gateway.openapi import openapi_document
    from gateway.review import ReviewQueue
    from pipeline.labels import parse_label

    scorer = make_scorer(world, ConstantModel(0.6))  # at the review threshold: every decision in review
    docs = [world.tx(40), world.tx(41, device_id=None, lat=None, lon=None, merchant_category=None, country=None)]
    out = score(scorer, [inbound(doc, world) for doc in docs])
    queue = ReviewQueue()
    assert all(queue.add_feedback(orjson.loads(value)) for _, value in out.feedback)
    label = parse_label(orjson.dumps({"transaction_id": docs[0]["transaction_id"], "label": "fraud",
                                      "source": "analyst", "labeled_at": "2026-12-02T11:00:00Z"}))  # fmt: skip
    assert not isinstance(label, str)
    queue.add_label(label)
    page = {**queue.page(100, 0, now=world.now), "limit": 100}  # what GET /v1/review/decisions serves
    page = orjson.loads(orjson.dumps(page))
    schemas = openapi_document()["components"]["schemas"]
    _check_schema(page, schemas["ReviewPage"], schemas)
    served = {item["transaction_id"]: item for item in page["items"]}
    bare = served[docs[1]["transaction_id"]]["transaction"]
    assert isinstance(bare["timestamp"], float) and bare["device_id"] is None  # epoch seconds, nulls
    # The request schema does not describe it (a date-time string, no nulls): the item must not point there.
    with pytest.raises(AssertionError):
        _check_schema(bare, schemas["Transaction"], schemas)
    assert served[docs[0]["transaction_id"]]["reason_features"] == ["amount_usd", "log_amount"]
