"""The project's Redis clients through a failover: a primary, 2 replicas, 3 Sentinels
(real redis-server and redis-sentinel processes, ``tools/redis_ha.py``).

Every client comes from the factory the processes use, named by a
``redis+sentinel://`` URL. The primary is killed with SIGKILL; a replica is
promoted; the same client objects (no restart, no rebuild) then work against
the new primary. The fast test covers the worker's scoring stores, the
gateway's limiter and the feedback loop's store in this process; the worker
test (marked ``cluster``: ``make test-cluster``) runs a real worker under load.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pandas as pd
import pytest
from workers import (
    Collector,
    Topics,
    TxFactory,
    Workers,
    make_producer,
    report,
    send_paced,
    tally,
    tx_msg,
    worker_env,
)

from agents.feedback import quality_store
from app.redis_client import async_client, sync_client
from app.settings import Settings
from gateway.rest import ApiKeys, Gateway, Signer
from pipeline.cache import RedisDecisionCache
from pipeline.labels import Label
from pipeline.quality import Served
from pipeline.validate import validate
from tools import redis_ha, stack
from tools.materialize import materialize

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]


@pytest.fixture
def ha(tmp_path: Path) -> Iterator[redis_ha.RedisHA]:
    """A fresh replicated Redis per test: each test kills its primary."""
    ports = stack.free_ports(6)
    started = redis_ha.start_redis_ha(ports[:3], ports[3:], tmp_path / "redis-ha")
    try:
        yield started
    finally:
        started.stop()


def _kill_primary(ha: redis_ha.RedisHA) -> tuple[str, float]:
    """SIGKILL the primary (by its PID); return its address and when (monotonic)."""
    primary = redis_ha.topology([h.url for h in ha.sentinels]).primary
    [node] = [h for h in ha.nodes if h.url.split("//")[1].startswith(primary)]
    os.kill(node.pid, signal.SIGKILL)
    return primary, time.monotonic()


def _new_primary(ha: redis_ha.RedisHA, old: str, timeout: float = 30.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            view = redis_ha.topology([h.url for h in ha.sentinels])
        except Exception:  # a Sentinel busy electing: ask again
            view = None
        if view is not None and view.primary != old and "failover" not in view.flags:
            return view.primary
        time.sleep(0.1)
    raise AssertionError(f"no replica promoted within {timeout:g} s")


def test_the_url_names_sentinels_service_and_database(ha: redis_ha.RedisHA) -> None:
    client = sync_client(Settings(redis_url=ha.url), timeout_s=2)
    try:
        client.set("fp:probe", "1")
        host, port = redis_ha.topology([h.url for h in ha.sentinels]).primary.split(":")
        assert client.connection_pool.get_master_address() == (host, int(port))
    finally:
        client.close()


def test_worker_gateway_and_feedback_stores_follow_a_failover(ha: redis_ha.RedisHA, sim_frame: pd.DataFrame) -> None:
    """Written before the kill, read after it from the promoted replica, through
    the same client objects; writes go on without a rebuild or a restart."""
    settings = Settings(redis_url=ha.url, redis_timeout_s=1.0, app_id="ha-quality", allow_unsigned=True,
                        gateway_rate_per_s=1000, gateway_burst=1000, rate_user_per_s=1000, rate_user_burst=1000)  # fmt: skip
    make = TxFactory(sim_frame, "t-ha")
    now = time.time()
    txs = [tx for tx in (validate(orjson.dumps(make()), now) for _ in range(20)) if not hasattr(tx, "code")]

    async def until_it_works(op: Any, timeout: float = 30.0) -> tuple[Any, float]:
        start = time.monotonic()
        while True:
            try:
                return await op(), time.monotonic() - start
            except Exception:  # the dead primary's connection, or no primary yet
                if time.monotonic() - start > timeout:
                    raise
                await asyncio.sleep(0.1)

    async def go() -> dict[str, float]:
        client = async_client(settings)  # the worker's scoring client, as Runtime builds it
        cache = RedisDecisionCache(client, 600)
        store = quality_store(settings)
        gw = Gateway(settings, ApiKeys({}), ApiKeys({}), Signer(settings.gateway_client_id, None))
        gw.start_redis()
        try:
            await cache.put_many(
                [(tx, orjson.dumps({"transaction_id": tx.transaction_id, "action": "approve"})) for tx in txs[:10]]
            )
            await store.add_served([Served("t-ha-1", "v1", "r1", "score", "approve", 0.1, now)])
            assert await gw.rate("shop-ha", "u-ha") is not None
            # WAIT: the replicas acknowledged what was written, so a promoted one has it.
            assert await client.execute_command("WAIT", 2, 2000) == 2

            old, killed = await asyncio.to_thread(_kill_primary, ha)
            new = await asyncio.to_thread(_new_primary, ha, old)
            promoted_s = time.monotonic() - killed
            hits, cache_s = await until_it_works(lambda: cache.get_many(txs[:10]))
            assert [h["transaction_id"] for h in hits] == [tx.transaction_id for tx in txs[:10]]
            await until_it_works(
                lambda: cache.put_many([(tx, orjson.dumps({"transaction_id": tx.transaction_id})) for tx in txs[10:]])
            )
            verdict, _ = await until_it_works(lambda: _answered(gw.rate("shop-ha", "u-ha")))
            assert verdict.allowed
            joined, _ = await until_it_works(lambda: store.add_labels([_label("t-ha-1", now)]))
            assert joined == 1  # the decision served before the failover is there to join
            assert new != old
            return {"promoted_s": promoted_s, "cache_s": cache_s}
        finally:
            await gw.stop()
            await store.client.aclose()
            await client.aclose()

    timings = asyncio.run(go())
    # Sentinel's down-after (2 s) plus an election: a few seconds, not tens.
    assert timings["promoted_s"] < 15, timings


async def _answered(call: Any) -> Any:
    """The gateway answers None when Redis could not say (it fails open): not yet."""
    verdict = await call
    if verdict is None:
        raise ConnectionError("the gateway's Redis did not answer")
    return verdict


def _label(tx_id: str, at: float) -> Label:
    return Label(tx_id, "legit", "chargeback", at)


@pytest.mark.cluster  # minutes of load
@pytest.mark.timeout(300)
def test_a_worker_under_load_follows_a_failover_without_a_restart(
    ha: redis_ha.RedisHA, kafka_bootstrap: str, sim_frame: pd.DataFrame, trained_registry: Path, tmp_path: Path
) -> None:
    """A real worker (its own process, default timeouts) scores 40 TPS for 30 s;
    the Redis primary is killed 10 s in. Every transaction is decided once, the
    worker's PID never changes, and full (not degraded) decisions resume once a
    replica is promoted."""
    admin = sync_client(Settings(redis_url=ha.url), timeout_s=30)
    try:
        materialize(sim_frame, admin, progress=False)
        admin.execute_command("WAIT", 2, 10000)
    finally:
        admin.close()
    topics = Topics.unique("ha")
    asyncio.run(topics.create(kafka_bootstrap, 4))
    env = worker_env(bootstrap=kafka_bootstrap, redis_url=ha.url, topics=topics, registry=trained_registry,
                     workdir=tmp_path, partitions=4)  # fmt: skip
    workers = Workers(tmp_path, env)
    make = TxFactory(sim_frame, f"t-haw-{topics.transactions[-6:]}")
    sent: list[Any] = []

    async def scenario() -> tuple[Any, dict[str, float]]:
        async with Collector(kafka_bootstrap, topics, 4) as col:
            worker = workers.start()
            await worker.wait_for_log("Ready", 120)
            producer = make_producer(kafka_bootstrap)
            await producer.start()
            try:
                load = asyncio.create_task(
                    send_paced(producer, topics.transactions, lambda i: tx_msg(make()), rate=40, duration=30, sent=sent)
                )
                await asyncio.sleep(10)
                old, killed = await asyncio.to_thread(_kill_primary, ha)
                killed_at = time.time()
                await asyncio.to_thread(_new_primary, ha, old)
                promoted_s = time.monotonic() - killed
                await load
            finally:
                await producer.stop()
            await col.wait_all(sent, 90)
            assert worker.alive() and len(workers.started) == 1, workers.logs()
            after = [(d["_seen_at"], d["degraded"]) for d in col.decisions if d["_seen_at"] > killed_at]
            degraded = [seen for seen, is_degraded in after if is_degraded]
            full = [seen for seen, is_degraded in after if not is_degraded and seen > max(degraded, default=0)]
            assert full, "no full decision after the failover"
            # The window of degraded decisions (the worker decides by rules while
            # Redis has no primary): it ends once the promoted replica answers.
            return col, {"promoted_s": promoted_s, "degraded": len(degraded),
                         "recover_s": max(degraded, default=killed_at) - killed_at}  # fmt: skip

    try:
        col, times = asyncio.run(scenario())
    finally:
        workers.stop_all()
    t = tally(col, sent, by="transaction")
    provisional = sum(bool(d.get("provisional")) for d in col.decisions)
    report(t.line("redis-failover", provisional=provisional, degraded=int(times["degraded"]),
                  promoted_s=f"{times['promoted_s']:.1f}", recover_s=f"{times['recover_s']:.1f}"))  # fmt: skip
    assert (t.lost, t.duplicated, len(t.mismatched)) == (0, 0, 0), t.line("redis-failover")
    assert provisional == 0, "a resend is told from a first sight without Redis (the resend index)"
    assert times["recover_s"] < 15, times
