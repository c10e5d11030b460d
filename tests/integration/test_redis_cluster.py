"""The project's Redis code on a real 3-node Redis Cluster (local redis-servers).

The cluster is chosen the way an operator chooses it, by a ``redis+cluster://``
URL or ``FRAUD_REDIS_CLUSTER=true``, and every client comes from the factory
the processes use: the scorer built by ``Runtime.build_scorer`` as in the
worker, the feedback loop's quality store, the gateway's rate limiter, and the
CLI's ``materialize`` and ``report quality``. Batches span many users, so every
batch crosses slots and nodes.
"""

from __future__ import annotations

import asyncio
import json
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

from agents.feedback import quality_store
from agents.wiring import Runtime
from app.redis_client import async_client, is_cluster, sync_client
from app.redis_keys import MATERIALIZE_META_KEY, client_bucket_key, gateway_bucket_ids, profile_key, user_bucket_key
from app.settings import Settings, get_settings
from gateway.rest import ApiKeys, Gateway, Signer
from pipeline.auth import RedisReplayGuard
from pipeline.cache import RedisDecisionCache
from pipeline.feature_store import RedisFeatureStore
from pipeline.labels import Label
from pipeline.quality import Served
from pipeline.ratelimit import InMemoryRateLimiter, RedisRateLimiter
from pipeline.resend_index import MemoryStore, ResendIndex
from pipeline.scorer import Inbound
from pipeline.validate import validate
from tests.integration.workers import RULES, TxFactory
from tools import cli, stack
from tools.materialize import materialize
from tools.stack.process import spawn

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
            handles.append(spawn("redis-cluster", argv, f"redis://127.0.0.1:{port}/0", workdir / f"{port}.log"))
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


def _cli(argv: list[str], env: dict[str, str]) -> int:
    """``fraud-pipeline ARGV`` in this process, with the operator's environment ``env``."""
    with pytest.MonkeyPatch.context() as mp:
        for name, value in env.items():
            mp.setenv(name, value)
        get_settings.cache_clear()
        try:
            return cli.main(argv)
        finally:
            get_settings.cache_clear()


@pytest.fixture(scope="module")
def materialized_cluster(cluster_url: str, sim_frame: pd.DataFrame, tmp_path_factory: pytest.TempPathFactory) -> str:
    """Materialized by ``fraud-pipeline materialize``, the cluster named by the
    setting on a plain URL of one node (the other way to choose it)."""
    data = tmp_path_factory.mktemp("materialize") / "transactions.parquet"
    sim_frame.to_parquet(data)
    plain = cluster_url.replace("redis+cluster://", "redis://")
    env = {"FRAUD_REDIS_URL": plain, "FRAUD_REDIS_CLUSTER": "true"}
    assert _cli(["materialize", "--data", str(data), "--quiet"], env) == 0
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
        settings = Settings(redis_url=url, redis_timeout_s=2.0)
        client = async_client(settings)
        try:
            return await RedisFeatureStore(client, local_cache_ttl_s=0, cluster=is_cluster(settings)).enrich(txs)
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
            cache = RedisDecisionCache(client, 60, cluster=True)
            assert await cache.get_many(txs) == [None] * len(txs)
            await cache.put_many(
                [(tx, orjson.dumps({"transaction_id": tx.transaction_id, "action": "approve"})) for tx in txs]
            )
            hits = await cache.get_many(txs)  # one MGET per slot
            assert [h["transaction_id"] for h in hits] == [tx.transaction_id for tx in txs]

            guard = RedisReplayGuard(client, cluster=True)
            items = [(f"sig-{i}", f"0:{i}") for i in range(30)]
            assert await guard.check(items, 60) == [True] * 30
            assert await guard.check([("sig-3", "0:3"), ("sig-4", "1:99")], 60) == [True, False]

            # Same answers as the in-memory twin while no client bucket refuses ...
            users = [(f"pos-{i % 2}", f"u-cl-{i % 9}") for i in range(60)]
            clock = lambda: 1_900_000_000.0  # noqa: E731
            on_cluster = RedisRateLimiter(client, 1000, 1000, 1, 3, clock=clock, cluster=True)
            twin = InMemoryRateLimiter(1000, 1000, 1, 3, clock=clock)
            assert await on_cluster.allow(users) == await twin.allow(users)
            # ... and a client bucket still refuses, with its wait.
            tight = RedisRateLimiter(client, 1, 2, 100, 100, clock=clock, cluster=True)
            got = await tight.allow([("pos-tight", f"u-t-{i}") for i in range(4)])
            assert [d.allowed for d in got] == [True, True, False, False]
            assert {d.bucket for d in got[2:]} == {"client"} and got[2].retry_after_s == pytest.approx(1.0)
            # A user over their limit spends none of their client's tokens.
            one = RedisRateLimiter(client, 1, 2, 1, 1, clock=clock, cluster=True)
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
            limiter = RedisRateLimiter(client, 1e6, 1e6, 1, 1, clock=clock, cluster=True)
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
        assert runtime.cluster  # decided from the URL, once, for every part
        client = runtime.redis()
        scorer = runtime.build_scorer(client, runtime.decision_cache(client, ResendIndex(MemoryStore(), 3600)))
        assert scorer.lookup is None  # a script may not span slots: the separate calls
        now = time.time()
        batch = [Inbound(orjson.dumps(d), {}, now, 0, i) for i, d in enumerate(docs)]
        first = await scorer.score_batch(batch)
        scorer.cache.committed(first.indexed)  # type: ignore[attr-defined]  # as the loop after a commit
        again = await scorer.score_batch([Inbound(m.value, {}, now, 1, m.offset) for m in batch])
        return [orjson.loads(v) for _, v, *_ in first.decisions], [orjson.loads(v) for _, v, *_ in again.decisions]

    first, again = asyncio.run(go())
    assert len(first) == len(docs) and not any(d["degraded"] for d in first), [d["explanation"] for d in first][:3]
    assert all(d["action"] in ("approve", "review", "decline") for d in first)
    assert all(d["cached"] for d in again)
    assert [d["action"] for d in again] == [d["action"] for d in first]


def test_cli_materialize_wrote_every_profile_across_the_nodes(
    materialized_cluster: str, sim_frame: pd.DataFrame
) -> None:
    client = sync_client(Settings(redis_url=materialized_cluster))
    try:
        meta = client.hgetall(MATERIALIZE_META_KEY)
        users = sorted(set(sim_frame["user_id"]))
        assert int(meta[b"users"]) == len(users)
        pipe = client.pipeline(transaction=False)
        for user in users:
            pipe.exists(profile_key(user))
        assert sum(pipe.execute()) == len(users)
        # Spread over the cluster, not piled on the node the URL named.
        assert all(client.dbsize(target_nodes=node) > 0 for node in client.get_primaries())
    finally:
        client.close()


def test_feedback_quality_store_and_report_on_a_cluster(cluster_url: str, capsys: pytest.CaptureFixture[str]) -> None:
    """The feedback loop's store (as its agents build it): decisions and labels
    of transactions on every node join in either order, a redelivery counts
    once; ``report quality`` reads the figures back from the cluster."""
    app_id = "quality-on-cluster"
    settings = Settings(redis_url=cluster_url, app_id=app_id)
    now = time.time()
    served = [Served(f"t-q-{i}", "v1", "r1", "score", "decline" if i % 4 == 0 else "approve", 0.5, now - 60 + i)
              for i in range(40)]  # fmt: skip
    labels = [Label(f"t-q-{i}", "fraud" if i % 4 == 0 else "legit", "chargeback", now) for i in range(40)]

    async def go() -> None:
        store = quality_store(settings)
        try:
            assert await store.add_served(served[:20]) == 0  # labels come later
            assert await store.add_labels(labels) == 20  # ... and the rest before their decisions
            assert await store.add_served(served[20:]) == 20
            assert await store.add_served(served[:5]) == 5  # redelivered: joined again, not counted again
            joined, decided = await store.snapshot()
            assert len(joined) == 40 and sum(decided.values()) == 40
        finally:
            await store.client.aclose()

    asyncio.run(go())
    capsys.readouterr()
    assert _cli(["report", "quality", "--json"], {"FRAUD_REDIS_URL": cluster_url, "FRAUD_APP_ID": app_id}) == 0
    report = json.loads(capsys.readouterr().out)
    flagged = report["models"]["v1"]["actions"]["flagged"]
    assert report["models"]["v1"]["decisions"] == 40
    assert (flagged["labelled"], flagged["fraud"], flagged["precision"]) == (10, 10, 1.0)


def test_gateway_rate_limits_on_a_cluster(cluster_url: str) -> None:
    """The gateway's own client and buckets (``gw:``) on the cluster: Redis answers
    (None would be a request admitted because Redis could not say), and the
    API client's bucket refuses past its burst."""
    settings = Settings(redis_url=cluster_url, gateway_rate_per_s=0.001, gateway_burst=3, rate_user_per_s=1000,
                        rate_user_burst=1000, allow_unsigned=True)  # fmt: skip
    gw = Gateway(settings, ApiKeys({}), ApiKeys({}), Signer(settings.gateway_client_id, None))

    async def go() -> None:
        gw.start_redis()
        try:
            verdicts = [await gw.rate("shop-cl", f"u-gw-{i}") for i in range(5)]
            assert None not in verdicts, "Redis did not answer: the gateway failed open"
            assert [(v.allowed, v.bucket) for v in verdicts] == [(True, None)] * 3 + [(False, "client")] * 2
            client_id, user_id = gateway_bucket_ids("shop-cl", "u-gw-0")
            assert await gw.redis.exists(client_bucket_key(client_id), user_bucket_key(user_id)) == 2
        finally:
            await gw.stop()

    asyncio.run(go())
