"""The batch's one Redis call against a real redis-server: the same outcomes
and the same Redis state as the three calls it replaces.

Each example scores the same generated batches twice, on two databases of one
server seeded alike: once with the scorer's separate calls (decision cache,
then admission, then enrichment), once with :class:`RedisBatchLookup`. The
batches mix new transactions, signed and unsigned, second copies within a
batch, resends of decided ones (answered by this worker's memory or by Redis),
the same payment under a new id, redeliveries and replays of a signed record,
and users over their rate.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import numpy as np
import orjson
import pytest
import redis
import redis.asyncio as aioredis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from app.redis_keys import merchant_key, profile_key, velocity_key
from pipeline.admission import Admission
from pipeline.auth import RedisReplayGuard, sign
from pipeline.cache import LocalFirstCache, RedisDecisionCache
from pipeline.feature_store import RedisFeatureStore
from pipeline.features import FEATURE_NAMES, MerchantRisk, UserProfile
from pipeline.model import Prediction
from pipeline.ratelimit import RedisRateLimiter
from pipeline.redis_batch import RedisBatchLookup
from pipeline.resend_index import MemoryStore, ResendIndex
from pipeline.scorer import BatchOutput, Inbound, Scorer
from tests.factories import RULES

pytestmark = pytest.mark.integration

KEYS = {"pos-1": bytes(range(32)), "pos-2": bytes(range(1, 33))}
START = 1_800_000_000.0
USERS = ("u-a", "u-b", "u-c", "u-none")  # u-none has no profile
MERCHANTS = ("m-1", "m-2", "m-none")  # m-none has no risk
#: Rates low enough that a batch of a few transactions of one user runs out.
LIMITS = (3.0, 5.0, 0.5, 2.0)  # client rate, client burst, user rate, user burst


class Clock:
    def __init__(self) -> None:
        self.now = START

    def __call__(self) -> float:
        return self.now


class FeatureModel:
    """Scores each row from its features, so a difference in enrichment shows in the decisions."""

    version = "feature-model-1"

    def predict(self, matrix: np.ndarray, explain_above: float | None = 0.0) -> Prediction:
        assert matrix.shape[1] == len(FEATURE_NAMES)
        scores = (np.nan_to_num(matrix.astype(np.float64)).sum(axis=1) % 97) / 97
        return Prediction(scores, [[("amount_usd", 0.5)] for _ in scores])


def seed(client: redis.Redis) -> None:
    """Profiles, merchant risk and an old velocity event: read by enrichment, never written."""
    for n, user in enumerate(USERS[:-1]):
        profile = UserProfile(3 + n, 10, 30, 20.0, 25.0, 30.0, 5.0, 40.0 + n, -3.0, frozenset({"d-1"}), START - 9e5, START - 3600)
        client.hset(profile_key(user), mapping=profile.to_mapping())
    for n, merchant in enumerate(MERCHANTS[:-1]):
        risk = MerchantRisk(5, 20, 60, 0.01 * n, 0.02, 0.03, float(n), START - 3600)
        client.hset(merchant_key(merchant), mapping=risk.to_mapping())
    client.zadd(velocity_key("u-a"), {"t-old|12.5": START - 600})


# --- generated traffic -------------------------------------------------------------


@dataclass
class Traffic:
    """Turns drawn steps into records, remembering what was sent."""

    clock: Clock
    sent: list[Inbound] = field(default_factory=list)
    offset: int = 0
    serial: int = 0

    def record(self, value: bytes, headers: dict[str, bytes] | None = None, offset: int | None = None) -> Inbound:
        if offset is None:
            self.offset += 1
            offset = self.offset
        msg = Inbound(value, headers or {}, self.clock.now, partition=0, offset=offset)
        self.sent.append(msg)
        return msg

    def new(self, user: str, merchant: str, amount: float, client: str | None, txid: str | None = None) -> Inbound:
        self.serial += 1
        doc = {
            "transaction_id": txid or tx_id(self.serial),
            "user_id": user,
            "amount": amount,
            "merchant_id": merchant,
            "device_id": "d-1",
            "timestamp": datetime.fromtimestamp(self.clock.now - 2.0, UTC).isoformat(),
        }
        value = orjson.dumps(doc)
        headers = sign(value, client, KEYS[client], int(self.clock.now * 1000)) if client else None
        return self.record(value, headers)

    def step(self, kind: str, pick: int, user: str, merchant: str, amount: float, client: str | None) -> Inbound:
        if not self.sent or kind == "new":
            return self.new(user, merchant, amount, client)
        earlier = self.sent[pick % len(self.sent)]
        if kind == "copy":  # the same record's bytes again as a new record: a resend or, signed, a replay
            return self.record(earlier.value, earlier.headers)
        if kind == "redeliver":  # the very same record (partition and offset) again
            return self.record(earlier.value, earlier.headers, earlier.offset)
        if kind == "new_id":  # the same payment under a new transaction id
            doc = orjson.loads(earlier.value)
            self.serial += 1
            doc["transaction_id"] = tx_id(self.serial)
            return self.record(orjson.dumps(doc))
        # "same_id": another payment reusing a transaction id
        txid = orjson.loads(earlier.value)["transaction_id"]
        return self.new(user, merchant, amount, client, txid=txid)


def tx_id(serial: int) -> str:
    """Printable, as validation requires, with what JSON escapes and what is
    not ASCII: the one call carries each transaction's row as JSON."""
    return f't-{serial} "q\\ü€'


steps = st.tuples(
    st.sampled_from(["new", "new", "copy", "redeliver", "new_id", "same_id"]),
    st.integers(0, 1000),
    st.sampled_from(USERS),
    st.sampled_from(MERCHANTS),
    st.sampled_from([5.0, 40.0, 900.0, 4000.0]),
    st.sampled_from([None, "pos-1", "pos-2"]),
)
#: Batches, each with how far the clock moves before it (buckets refill).
batches = st.lists(st.tuples(st.lists(steps, min_size=1, max_size=9), st.sampled_from([0.0, 0.5, 2.0, 30.0])),
                   min_size=1, max_size=4)  # fmt: skip


# --- the two paths ---------------------------------------------------------------------


def build(client: Any, clock: Clock, one_call: bool, wait_s: float = 0.05, shared: bool = True) -> Scorer:
    """A scorer as the worker builds it (agents/wiring.py), with the one call or
    without; ``shared``: decisions cached in Redis (``FRAUD_DECISION_CACHE_REDIS``),
    else in a resend index alone (the default: the script reads no decision keys)."""
    store = RedisFeatureStore(client, local_cache_ttl_s=30)
    cache = LocalFirstCache(
        RedisDecisionCache(client, 3600) if shared else None,
        index=None if shared else ResendIndex(MemoryStore(), 3600), wait_s=wait_s, retry_every_s=0.01,
    )  # fmt: skip
    admission = Admission(
        keys=KEYS, allow_unsigned=True, replay=RedisReplayGuard(client),
        limiter=RedisRateLimiter(client, *LIMITS, clock=clock),
    )  # fmt: skip
    lookup = RedisBatchLookup.build(client, cache, store, admission) if one_call else None
    assert (lookup is not None) == one_call
    return Scorer(
        model=FeatureModel(), rules=RULES, store=store, cache=cache, admission=admission,
        wall_clock=clock, model_budget_s=5.0, lookup=lookup,
    )  # fmt: skip


def normalized(out: BatchOutput) -> dict[str, Any]:
    """What a batch produced, less what only time measures (latencies, stage times)."""

    def decision(doc: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in doc.items() if k != "latency_ms"}

    def feedback(doc: dict[str, Any]) -> dict[str, Any]:
        return {**doc, "decision": decision(doc["decision"])}

    monitoring = dict(out.monitoring or {})
    monitoring.pop("stage_ms", None)
    return {
        "decisions": [(k, decision(orjson.loads(v))) for k, v, *_ in out.decisions],
        "dead_letters": [(k, orjson.loads(v)) for k, v in out.dead_letters],
        "feedback": [(k, feedback(orjson.loads(v))) for k, v in out.feedback],
        "monitoring": monitoring,
        "outcomes": dict(out.outcomes),
        "to_cache": [(tx, decision(orjson.loads(blob))) for tx, blob in out.to_cache],
    }


def state(client: redis.Redis) -> dict[bytes, Any]:
    """Every key's value (decisions less their latencies) and whether it expires."""
    out: dict[bytes, Any] = {}
    for key in client.scan_iter(count=1000):
        kind = client.type(key)
        if kind == b"zset":
            value: Any = client.zrange(key, 0, -1, withscores=True)
        elif kind == b"hash":
            value = client.hgetall(key)
        else:
            value = client.get(key)
            if key.startswith(b"fp:dec:"):
                value = {k: v for k, v in orjson.loads(value).items() if k != "latency_ms"}
        out[key] = (value, client.ttl(key) > 0)
    return out


def db_urls(redis_url: str) -> tuple[str, str]:
    base = redis_url.rsplit("/", 1)[0] if redis_url.count("/") > 2 else redis_url
    return base + "/1", base + "/2"


@pytest.fixture
def two_dbs(redis_url: str) -> Iterator[tuple[str, str]]:
    urls = db_urls(redis_url)
    yield urls
    for url in urls:
        redis.Redis.from_url(url).flushdb()


async def score_both(
    urls: tuple[str, str], plan: list[tuple[list[Any], float]], shared: bool = True
) -> list[tuple[Any, Any]]:
    """Each batch through both paths, in turn; the outputs, normalized, pair by pair."""
    clock = Clock()
    traffic = Traffic(clock)
    clients = [aioredis.Redis.from_url(url) for url in urls]
    scorers = [build(clients[0], clock, one_call=False, shared=shared),
               build(clients[1], clock, one_call=True, shared=shared)]  # fmt: skip
    pairs = []
    try:
        for drawn, advance in plan:
            clock.now += advance
            batch = [traffic.step(*s) for s in drawn]
            outs = []
            for scorer in scorers:
                out = await scorer.score_batch(batch)
                await scorer.cache.put_many(out.to_cache)  # what the agent does once decisions are delivered
                scorer.cache.committed(out.indexed)  # type: ignore[attr-defined]
                outs.append(normalized(out))
            pairs.append((outs[0], outs[1]))
    finally:
        for client in clients:
            await client.aclose()
    return pairs


# --- equivalence -----------------------------------------------------------------------


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(plan=batches)
@pytest.mark.parametrize("shared", [True, False], ids=["redis-cache", "index-alone"])
def test_one_call_decides_and_writes_as_the_separate_calls(two_dbs: tuple[str, str], shared: bool, plan: Any) -> None:
    syncs = [redis.Redis.from_url(url) for url in two_dbs]
    for client in syncs:
        client.flushdb()
        seed(client)
    for separate, one_call in asyncio.run(score_both(two_dbs, plan, shared)):
        assert one_call == separate
    assert state(syncs[1]) == state(syncs[0])
    for client in syncs:
        client.close()


@pytest.mark.parametrize("shared", [True, False], ids=["redis-cache", "index-alone"])
def test_the_generated_traffic_reaches_every_branch(two_dbs: tuple[str, str], shared: bool) -> None:
    """A fixed mix in which each branch occurs, so the property is not vacuous."""
    u, m = "u-a", "m-1"
    plan = [
        ([("new", 0, u, m, 5.0, "pos-1"), ("copy", 0, u, m, 5.0, None), ("new", 0, "u-none", "m-none", 40.0, None),
          ("new", 0, u, m, 40.0, "pos-2"), ("new", 0, u, m, 900.0, "pos-1")], 0.0),
        ([("copy", 0, u, m, 5.0, None), ("redeliver", 3, u, m, 5.0, None), ("new_id", 2, u, m, 5.0, None),
          ("copy", 4, u, m, 5.0, None), ("new", 0, "u-b", "m-2", 40.0, "pos-1")], 0.5),
    ]  # fmt: skip
    for client in (redis.Redis.from_url(url) for url in two_dbs):
        client.flushdb()
        seed(client)
    pairs = asyncio.run(score_both(two_dbs, plan, shared))
    for separate, one_call in pairs:
        assert one_call == separate
    counts = [p[0]["monitoring"]["counts"] for p in pairs]
    assert counts[0]["cached"] >= 1  # the in-batch copy
    assert counts[0].get("rejected_rate_limited", 0) >= 1  # u-a's third in one batch
    assert counts[1]["cached"] >= 2  # resent: answered from memory and by content
    assert counts[1].get("rejected_replayed", 0) >= 1  # the rate-limited signed record sent again


# --- Redis down or not answering --------------------------------------------------------


@pytest.fixture
def silent_port() -> Iterator[int]:
    """A port that accepts connections and never answers (a stalled Redis)."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(64)
    try:
        yield server.getsockname()[1]
    finally:
        server.close()


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.mark.parametrize("where", ["down", "stalled"])
def test_without_redis_the_one_call_decides_as_the_separate_calls(
    where: str, request: pytest.FixtureRequest
) -> None:
    """Provisional (never approve), degraded, admitted (fail open, counted)."""
    port = free_port() if where == "down" else request.getfixturevalue("silent_port")

    async def run() -> list[dict[str, Any]]:
        clock = Clock()
        traffic = Traffic(clock)
        batch = [traffic.new("u-a", "m-1", 5.0, "pos-1"), traffic.new("u-b", "m-2", 40.0, None)]
        batch.append(traffic.record(batch[0].value, batch[0].headers))  # a second copy
        outs = []
        for one_call in (False, True):
            client = aioredis.Redis(port=port, socket_timeout=0.05, socket_connect_timeout=0.05)
            out = await build(client, clock, one_call, wait_s=0.02).score_batch(batch)
            await client.aclose()
            outs.append(normalized(out))
        return outs

    separate, one_call = asyncio.run(run())
    counts = one_call["monitoring"]["counts"]
    assert counts.pop("one_call_failed") == 1  # then the separate calls, as without the lookup
    assert one_call == separate
    assert counts["provisional"] == counts["degraded"] == 2 and counts["cached"] == 1
    assert counts["replay_guard_unavailable"] == counts["rate_limiter_unavailable"] == 1
    assert all(doc["action"] != "approve" for _, doc in one_call["decisions"])


def test_a_lost_script_is_loaded_again(two_dbs: tuple[str, str]) -> None:
    """NOSCRIPT (a restart, SCRIPT FLUSH): loaded again and run, in the same call."""
    sync = redis.Redis.from_url(two_dbs[1])
    sync.flushdb()
    seed(sync)

    async def run() -> BatchOutput:
        clock = Clock()
        client = aioredis.Redis.from_url(two_dbs[1])
        scorer = build(client, clock, one_call=True)
        traffic = Traffic(clock)
        await scorer.score_batch([traffic.new("u-a", "m-1", 5.0, "pos-1")])
        await client.script_flush()
        out = await scorer.score_batch([traffic.new("u-b", "m-2", 5.0, "pos-1")])
        await client.aclose()
        return out

    counts = asyncio.run(run()).monitoring["counts"]  # type: ignore[index]
    assert "one_call_failed" not in counts and counts.get("degraded", 0) == 0
    assert sync.exists(velocity_key("u-b"))
