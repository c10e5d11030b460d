"""The worker's Redis code on a real 3-node Redis Cluster (local redis-servers).

The cluster is chosen the way an operator chooses it, by a ``redis+cluster://``
URL, and the scorer is built by ``Runtime.build_scorer`` as in the worker.
Batches span many users, so every batch crosses slots and nodes.
"""

from __future__ import annotations

import asyncio
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pandas as pd
import pytest
import redis

from agents.score import Runtime
from app.redis_client import async_client, sync_client
from app.settings import Settings
from pipeline.auth import RedisReplayGuard
from pipeline.cache import RedisDecisionCache
from pipeline.feature_store import RedisFeatureStore
from pipeline.ratelimit import InMemoryRateLimiter, RedisRateLimiter
from pipeline.scorer import Inbound
from pipeline.validate import validate
from tests.integration.workers import RULES, TxFactory
from tools import stack
from tools.materialize import materialize

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

NODES = 3


def _cluster_ports() -> list[int]:
    """Ports whose cluster bus (port + 10000) is free too."""
    ports: list[int] = []
    while len(ports) < NODES:
        port = stack.free_port()
        if port + 10000 > 65535 or port in ports:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
        ports.append(port)
    return ports


def _cluster_ok(client: redis.Redis) -> bool:
    info = client.execute_command("CLUSTER INFO")  # parsed to a dict by redis-py
    if isinstance(info, bytes):
        info = dict(line.split(":", 1) for line in info.decode().split() if ":" in line)
    return str(info.get("cluster_state")) == "ok"


@pytest.fixture(scope="module")
def cluster_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    workdir = tmp_path_factory.mktemp("redis-cluster")
    handles = []
    try:
        ports = _cluster_ports()
        for port in ports:
            argv = [
                "redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                "--cluster-enabled", "yes", "--cluster-config-file", str(workdir / f"nodes-{port}.conf"),
                "--cluster-node-timeout", "5000", "--dir", str(workdir),
            ]  # fmt: skip
            handles.append(stack._spawn("redis-cluster", argv, f"redis://127.0.0.1:{port}/0", workdir / f"{port}.log"))
        for h in handles:
            stack.wait_redis_ready(h.url, pid=h.pid, log_path=h.log_path)
        subprocess.run(
            ["redis-cli", "--cluster", "create", *(f"127.0.0.1:{p}" for p in ports), "--cluster-replicas", "0",
             "--cluster-yes"],
            check=True, capture_output=True, timeout=60,
        )  # fmt: skip
        deadline = time.monotonic() + 30
        for port in ports:
            client = redis.Redis(port=port)
            while not _cluster_ok(client):
                assert time.monotonic() < deadline, "the cluster did not become ok"
                time.sleep(0.2)
            client.close()
        yield f"redis+cluster://127.0.0.1:{ports[0]}"
    finally:
        for h in handles:
            h.stop()


@pytest.fixture(scope="module")
def materialized_cluster(cluster_url: str, sim_frame: pd.DataFrame) -> str:
    client = sync_client(Settings(redis_url=cluster_url))
    try:
        materialize(sim_frame, client, progress=False)
    finally:
        client.close()
    return cluster_url


def _txs(frame: pd.DataFrame, n: int, prefix: str) -> list[Any]:
    make = TxFactory(frame, prefix)
    now = time.time()
    out = []
    for _ in range(n):
        tx = validate(orjson.dumps(make()), now)
        assert not hasattr(tx, "code"), tx
        out.append(tx)
    return out


def test_enrichment_on_a_cluster_equals_one_server(
    materialized_cluster: str, redis_client: redis.Redis, redis_url: str, sim_frame: pd.DataFrame
) -> None:
    """The same batch enriched through the cluster and through one server (both
    materialized from the same data) gives the same profiles, merchants and velocity."""
    materialize(sim_frame, redis_client, progress=False)
    txs = _txs(sim_frame, 64, "t-cl-enrich")

    async def enrich(url: str) -> list[Any]:
        client = async_client(Settings(redis_url=url, redis_timeout_s=2.0))
        try:
            return await RedisFeatureStore(client, local_cache_ttl_s=0).enrich(txs)
        finally:
            await client.aclose()

    on_cluster = asyncio.run(enrich(materialized_cluster))
    on_server = asyncio.run(enrich(redis_url))
    assert sum(e.profile is not None for e in on_cluster) == len(txs)
    assert repr(on_cluster) == repr(on_server)  # repr: NaN (no transactions that day) != NaN


def test_cache_replay_guard_and_limiter_across_slots(cluster_url: str, sim_frame: pd.DataFrame) -> None:
    txs = _txs(sim_frame, 40, "t-cl-cache")

    async def go() -> None:
        client = async_client(Settings(redis_url=cluster_url, redis_timeout_s=2.0))
        try:
            cache = RedisDecisionCache(client, 60)
            assert await cache.get_many(txs) == [None] * len(txs)
            await cache.put_many([(tx, {"transaction_id": tx.transaction_id, "action": "approve"}) for tx in txs])
            hits = await cache.get_many(txs)  # one MGET per slot
            assert [h["transaction_id"] for h in hits] == [tx.transaction_id for tx in txs]

            guard = RedisReplayGuard(client)
            items = [(f"sig-{i}", f"0:{i}") for i in range(30)]
            assert await guard.check(items, 60) == [True] * 30
            assert await guard.check([("sig-3", "0:3"), ("sig-4", "1:99")], 60) == [True, False]

            # Same answers as the in-memory twin while no client bucket refuses ...
            users = [(f"pos-{i % 2}", f"u-cl-{i % 9}") for i in range(60)]
            clock = lambda: 1_900_000_000.0  # noqa: E731
            on_cluster = RedisRateLimiter(client, 1000, 1000, 1, 3, clock=clock)
            twin = InMemoryRateLimiter(1000, 1000, 1, 3, clock=clock)
            assert await on_cluster.allow(users) == await twin.allow(users)
            # ... and a client bucket still refuses, with its wait.
            tight = RedisRateLimiter(client, 1, 2, 100, 100, clock=clock)
            got = await tight.allow([("pos-tight", f"u-t-{i}") for i in range(4)])
            assert [d.allowed for d in got] == [True, True, False, False]
            assert {d.bucket for d in got[2:]} == {"client"} and got[2].retry_after_s == pytest.approx(1.0)
            # A user over their limit spends none of their client's tokens.
            one = RedisRateLimiter(client, 1, 2, 1, 1, clock=clock)
            got = await one.allow([("pos-one", "u-a"), ("pos-one", "u-a"), ("pos-one", "u-b"), ("pos-one", "u-c")])
            expected = [(True, None), (False, "user"), (True, None), (False, "client")]
            assert [(d.allowed, d.bucket) for d in got] == expected
        finally:
            await client.aclose()

    asyncio.run(go())


def test_a_batch_of_many_users_stays_within_the_pool_on_a_cluster(cluster_url: str) -> None:
    """200 users (their buckets spread over ~all slots) in one batch, a pool of 2
    connections per node: the limiter sends one pipeline, not a call per slot
    at once (which raised MaxConnectionsError on the cluster client)."""

    async def go() -> None:
        client = async_client(Settings(redis_url=cluster_url, redis_timeout_s=2.0, redis_pool_size=2))
        try:
            clock = lambda: 1_900_000_000.0  # noqa: E731
            limiter = RedisRateLimiter(client, 1e6, 1e6, 1, 1, clock=clock)
            users = [("pos-many", f"u-many-{i}") for i in range(200)]
            assert all(d.allowed for d in await limiter.allow(users))
            # Each user's single token is spent: the same batch again is refused, user by user.
            again = await limiter.allow(users)
            assert [(d.allowed, d.bucket) for d in again] == [(False, "user")] * 200
        finally:
            await client.aclose()

    asyncio.run(go())


def test_scorer_built_for_a_cluster_url(
    materialized_cluster: str, sim_frame: pd.DataFrame, trained_registry: Path, tmp_path: Path
) -> None:
    """Runtime.build_scorer with a redis+cluster:// URL: a batch is scored in full
    (not degraded: every Redis step worked), and its resend is answered from the cache."""
    rules = tmp_path / "rules.json"
    rules.write_text(orjson.dumps(RULES).decode())
    settings = Settings(
        redis_url=materialized_cluster, registry_dir=trained_registry, rules_path=rules, allow_unsigned=True,
        redis_timeout_s=2.0, model_budget_ms=2000,
    )  # fmt: skip
    runtime = Runtime.load(settings)
    make = TxFactory(sim_frame, "t-cl-score")
    docs = [make() for _ in range(48)]

    async def go() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        scorer = runtime.build_scorer()
        now = time.time()
        batch = [Inbound(orjson.dumps(d), {}, now, 0, i) for i, d in enumerate(docs)]
        first = await scorer.score_batch(batch)
        await scorer.cache.put_many(first.to_cache)
        again = await scorer.score_batch([Inbound(m.value, {}, now, 1, m.offset) for m in batch])
        return [orjson.loads(v) for _, v in first.decisions], [orjson.loads(v) for _, v in again.decisions]

    first, again = asyncio.run(go())
    assert len(first) == len(docs) and not any(d["degraded"] for d in first), [d["explanation"] for d in first][:3]
    assert all(d["action"] in ("approve", "review", "decline") for d in first)
    assert all(d["cached"] for d in again)
    assert [d["action"] for d in again] == [d["action"] for d in first]
