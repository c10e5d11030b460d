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

from app.contract import Transaction
from app.errors import BatchLookupError, FeatureStoreError
from pipeline.admission import Admission
from pipeline.auth import UNSIGNED, InMemoryReplayGuard, RedisReplayGuard
from pipeline.cache import InMemoryDecisionCache, LocalFirstCache, RedisDecisionCache
from pipeline.feature_store import Enrichment, InMemoryFeatureStore, RedisFeatureStore
from pipeline.features import velocity_from_events
from pipeline.lookup import BatchAnswer, Request, SeparateCalls
from pipeline.ratelimit import InMemoryRateLimiter, RateDecision, RedisRateLimiter
from pipeline.redis_batch import RedisBatchLookup
from pipeline.scorer import BatchOutput, Inbound, Scorer
from pipeline.timing import Laps
from pipeline.validate import Rejection
from tests.factories import RULES, ConstantModel, tx_bytes

NO_VELOCITY = velocity_from_events(np.array([]), np.array([]), 0.0)


class Trips:
    """A RoundTrips observer that remembers each (operation, failed)."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, bool]] = []

    def observe_round_trip(self, op: str, seconds: float, failed: bool) -> None:
        assert seconds >= 0
        self.seen.append((op, failed))


class Stages:
    """A stage clock that remembers the order of its laps."""

    def __init__(self) -> None:
        self.laps: list[str] = []

    def lap(self, stage: str) -> None:
        self.laps.append(stage)


class ScriptedLookup:
    """Answers each batch with ``answer(requests)``; remembers what it was asked."""

    def __init__(self, answer: Callable[[Sequence[Request]], BatchAnswer]) -> None:
        self.answer = answer
        self.asked: list[list[Request]] = []

    async def look_up(self, requests: Sequence[Request], laps: Laps) -> BatchAnswer:
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
    docs = [orjson.loads(v) for _, v, *_ in out.decisions]
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
    (doc,) = [orjson.loads(v) for _, v, *_ in out.decisions]
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


def test_a_failed_call_is_a_failed_round_trip_then_each_separate_call_is_timed() -> None:
    def fail(requests: Sequence[Request]) -> BatchAnswer:
        raise BatchLookupError(len(requests), "Redis call failed: TimeoutError()")

    trips = Trips()
    s = Scorer(
        model=ConstantModel(0.05, version="low-1"), rules=RULES, store=InMemoryFeatureStore(),
        cache=InMemoryDecisionCache(), lookup=ScriptedLookup(fail), round_trips=trips,
    )  # fmt: skip
    run(s, [msg(1, 1)])
    run(s, [Inbound(b"not json", offset=2)])  # nothing valid: nothing asked, nothing timed
    assert trips.seen == [("batch_lookup", True), ("cache_get", False), ("enrich", False)]


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


# --- the separate calls ------------------------------------------------------------


def tx(i: int, user: str = "u-1") -> Transaction:
    return Transaction(f"t-{i}", user, 10.0 + i, "m-1", time.time())


def ask(lookup: SeparateCalls, txs: list[Transaction], stages: Laps | None = None) -> BatchAnswer:
    requests = [Request(t, UNSIGNED, f"0:{n}") for n, t in enumerate(txs)]
    return asyncio.run(lookup.look_up(requests, stages or Stages()))


class Down:
    """A decision cache and a rate limiter whose Redis does not answer."""

    async def get_many(self, txs: Sequence[Transaction]) -> list[dict[str, Any] | None]:
        raise TimeoutError("Timeout reading from socket")

    async def put_many(self, items: Sequence[tuple[Transaction, bytes]]) -> None:
        raise TimeoutError("Timeout writing to socket")

    async def allow(self, requests: Sequence[tuple[str, str]]) -> list[RateDecision]:
        raise TimeoutError("Timeout reading from socket")


def test_the_separate_calls_answer_cache_then_admission_then_features_and_time_each() -> None:
    cache = InMemoryDecisionCache()
    decided = tx(1)
    asyncio.run(cache.put_many([(decided, orjson.dumps({"action": "decline"}))]))
    store = InMemoryFeatureStore()
    one_per_user = InMemoryRateLimiter(1000, 1000, 0.001, 1)
    trips, stages = Trips(), Stages()
    lookup = SeparateCalls(cache, store, Admission(keys={}, allow_unsigned=True, limiter=one_per_user), trips)
    answer = ask(lookup, [decided, tx(2), tx(2), tx(3), tx(4, user="u-2")], stages)
    assert answer.hits == [{"action": "decline"}, None, None, None, None]  # a resend: answered, nothing more
    assert answer.follows == [None, None, 1, None, None]  # t-2's second copy follows its first
    assert [v.code if v else None for v in answer.verdicts] == [None, None, None, "rate_limited", None]
    assert answer.enrichments is not None and len(answer.enrichments) == 2  # t-2 and t-4, the admitted
    assert set(store.events) == {"u-1", "u-2"} and set(store.events["u-1"]) == {"t-2"}  # t-3 was never enriched
    assert answer.unchecked == frozenset() and answer.incidents == () and answer.enrich_error is None
    assert stages.laps == ["cache", "validate", "features"]
    assert trips.seen == [("cache_get", False), ("rate_limit", False), ("enrich", False)]


def test_what_the_separate_calls_cannot_ask_is_unchecked_admitted_or_unenriched() -> None:
    store = InMemoryFeatureStore()
    trips = Trips()
    lookup = SeparateCalls(Down(), store, Admission(keys={}, allow_unsigned=True, limiter=Down()), trips)
    answer = ask(lookup, [tx(1), tx(2)])
    assert answer.hits == [None, None] and answer.unchecked == {"t-1", "t-2"}  # provisional, never approved
    assert answer.verdicts == [None, None] and answer.incidents == ("rate_limiter_unavailable",)  # fail open
    assert trips.seen == [("cache_get", True), ("rate_limit", True), ("enrich", False)]
    store.fail = RuntimeError("down")
    answer = ask(lookup, [tx(3)])
    assert answer.enrichments is None and isinstance(answer.enrich_error, FeatureStoreError)
