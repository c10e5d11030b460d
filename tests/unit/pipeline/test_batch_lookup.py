"""The scorer's one-call path with a scripted lookup, and when the lookup is built.

What the script itself decides is tested against a real redis-server
(tests/integration/test_redis_batch.py); here, how the scorer turns a
:class:`BatchAnswer` into decisions, and its fallback to the separate calls.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import orjson
import pytest
import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster

from app.errors import BatchLookupError, FeatureStoreError
from pipeline.admission import Admission
from pipeline.auth import InMemoryReplayGuard, RedisReplayGuard
from pipeline.cache import InMemoryDecisionCache, LocalFirstCache, RedisDecisionCache
from pipeline.feature_store import Enrichment, InMemoryFeatureStore, RedisFeatureStore
from pipeline.features import velocity_from_events
from pipeline.ratelimit import RateDecision, RedisRateLimiter
from pipeline.redis_batch import BatchAnswer, RedisBatchLookup, Request
from pipeline.scorer import BatchOutput, Inbound, Scorer
from pipeline.validate import Rejection
from tests.factories import RULES, ConstantModel, tx_bytes

NO_VELOCITY = velocity_from_events(np.array([]), np.array([]), 0.0)


class ScriptedLookup:
    """Answers each batch with ``answer(requests)``; remembers what it was asked."""

    def __init__(self, answer: Callable[[Sequence[Request]], BatchAnswer]) -> None:
        self.answer = answer
        self.asked: list[list[Request]] = []

    async def look_up(self, requests: Sequence[Request]) -> BatchAnswer:
        self.asked.append(list(requests))
        return self.answer(requests)


def scorer(lookup: Any = None, store: InMemoryFeatureStore | None = None) -> Scorer:
    return Scorer(
        model=ConstantModel(0.05, version="low-1"), rules=RULES, store=store or InMemoryFeatureStore(),
        cache=InMemoryDecisionCache(), admission=Admission(keys={}, allow_unsigned=True), lookup=lookup,
    )  # fmt: skip


def run(s: Scorer, batch: list[Inbound]) -> BatchOutput:
    return asyncio.run(s.score_batch(batch))


def msg(i: int, offset: int, **over: Any) -> Inbound:
    return Inbound(tx_bytes(i, transaction_id=f"t-{i}", user_id="u-1", **over), timestamp=time.time(), offset=offset)


def actions(out: BatchOutput) -> list[tuple[str, str, bool]]:
    docs = [orjson.loads(v) for _, v in out.decisions]
    return [(d["transaction_id"], d["action"], bool(d.get("cached"))) for d in docs]


def test_hits_copies_refusals_and_the_enriched_each_get_their_answer() -> None:
    enrichment = Enrichment(None, None, NO_VELOCITY)
    limited = RateDecision(False, "user", 2.0).rejection("t-4", "u-1")

    def answer(requests: Sequence[Request]) -> BatchAnswer:
        return BatchAnswer(
            hits=[{"action": "decline", "fraud_score": 0.9}, None, None, None],
            follows=[None, None, 1, None],
            verdicts=[None, None, None, limited],
            enrichments=[enrichment],
        )

    lookup = ScriptedLookup(answer)
    out = run(scorer(lookup), [msg(1, 1), msg(2, 2), msg(2, 3), msg(4, 4)])
    assert [r.delivery for r in lookup.asked[0]] == ["None:1", "None:2", "None:3", "None:4"]
    assert actions(out) == [
        ("t-1", "decline", True),  # answered from the cache, first: emitted after the cache stage
        ("t-4", "reject", False),  # refused by admission
        ("t-2", "approve", False),  # the one enriched and scored
        ("t-2", "approve", True),  # its second copy in the batch
    ]
    counts = out.monitoring["counts"]  # type: ignore[index]
    assert counts["cached"] == 2 and counts["rejected_rate_limited"] == 1 and counts.get("degraded", 0) == 0
    assert [tx.transaction_id for tx, _ in out.to_cache] == ["t-2"]  # a reject is never cached
    assert set(out.monitoring["stage_ms"]) == {"validate", "cache", "features", "model", "rules"}  # type: ignore[index]


def test_a_refused_first_copy_takes_its_second_copy_with_it() -> None:
    replayed = Rejection("replayed", "signature", "already received")
    lookup = ScriptedLookup(lambda r: BatchAnswer([None, None], [None, 0], [replayed, None], []))
    out = run(scorer(lookup), [msg(1, 1), msg(1, 2)])
    assert out.decisions == [] and len(out.dead_letters) == 2  # a replay: dead letters only
    assert out.monitoring["counts"]["rejected"] == 2  # type: ignore[index]


def test_features_that_could_not_be_read_degrade_the_batch() -> None:
    error = FeatureStoreError("fp:{u:u-1}:profile has feature set 'old'")
    lookup = ScriptedLookup(lambda r: BatchAnswer([None], [None], [None], None, error))
    out = run(scorer(lookup), [msg(1, 1)])
    (doc,) = [orjson.loads(v) for _, v in out.decisions]
    assert doc["degraded"] and "degraded: feature store unavailable" in doc["explanation"]
    assert out.monitoring["degraded_reason"] == "feature store unavailable"  # type: ignore[index]


def test_a_failed_call_makes_the_separate_calls_for_that_batch() -> None:
    def fail(requests: Sequence[Request]) -> BatchAnswer:
        raise BatchLookupError(len(requests), "Redis call failed: TimeoutError()")

    store = InMemoryFeatureStore()
    with_lookup = run(scorer(ScriptedLookup(fail), store), [msg(1, 1), msg(1, 2), msg(3, 3)])
    without = run(scorer(None, InMemoryFeatureStore()), [msg(1, 1), msg(1, 2), msg(3, 3)])
    assert actions(with_lookup) == actions(without)
    counts = dict(with_lookup.monitoring["counts"])  # type: ignore[index]
    assert counts.pop("one_call_failed") == 1
    assert counts == without.monitoring["counts"]  # type: ignore[index]
    assert set(store.events["u-1"]) == {"t-1", "t-3"}  # enriched by the separate call


def test_a_batch_of_only_rejects_asks_nothing() -> None:
    lookup = ScriptedLookup(lambda r: pytest.fail("asked"))  # type: ignore[arg-type, return-value]
    out = run(scorer(lookup), [Inbound(b"not json", offset=1)])
    assert out.decisions == [] and len(out.dead_letters) == 1


# --- when the one call is made -------------------------------------------------------


def redis_parts(client: Any) -> tuple[Any, Any, Admission]:
    cache = LocalFirstCache(RedisDecisionCache(client, 60))
    admission = Admission(
        keys={}, replay=RedisReplayGuard(client), limiter=RedisRateLimiter(client, 10.0, 10.0, 1.0, 5.0)
    )
    return cache, RedisFeatureStore(client), admission


def test_built_on_one_server_with_every_part_in_redis() -> None:
    client = aioredis.Redis(port=1)  # never connected here
    cache, store, admission = redis_parts(client)
    assert isinstance(RedisBatchLookup.build(client, cache, store, admission), RedisBatchLookup)
    assert isinstance(RedisBatchLookup.build(client, cache.shared, store, None), RedisBatchLookup)


def test_not_built_on_a_cluster_nor_with_in_memory_or_foreign_parts() -> None:
    client = aioredis.Redis(port=1)
    cache, store, admission = redis_parts(client)
    cluster = RedisCluster(host="127.0.0.1", port=1)
    assert RedisBatchLookup.build(cluster, *redis_parts(cluster)) is None
    assert RedisBatchLookup.build(client, InMemoryDecisionCache(), store, admission) is None
    assert RedisBatchLookup.build(client, cache, InMemoryFeatureStore(), admission) is None
    in_memory_guard = Admission(keys={}, replay=InMemoryReplayGuard(), limiter=admission.limiter)
    assert RedisBatchLookup.build(client, cache, store, in_memory_guard) is None
    other = aioredis.Redis(port=2)
    assert RedisBatchLookup.build(client, cache, RedisFeatureStore(other), admission) is None
