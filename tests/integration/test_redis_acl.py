"""Redis ACL users (``tools.stack.start_redis(secure=True)``): each role reaches its own keys only.

A private redis-server with ACLs; every client goes through ``app.redis_client``
with ``FRAUD_REDIS_USERNAME`` / ``FRAUD_REDIS_PASSWORD_FILE`` settings, as the
services do.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
import redis

from app import redis_client
from app.redis_keys import client_bucket_key, decision_id_key, merchant_key, profile_key, velocity_key
from app.settings import Settings
from pipeline.ratelimit import RedisRateLimiter
from tools import stack
from tools.materialize import materialize

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def secure_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """(admin URL, the folder of the users' password files)."""
    workdir = tmp_path_factory.mktemp("redis-acl")
    handle = stack.start_redis(workdir=workdir, secure=True)
    try:
        yield handle.url, workdir
    finally:
        handle.stop()


def as_role(secure_redis: tuple[str, Path], role: str) -> Any:
    url, workdir = secure_redis
    plain = "redis://" + url.split("@", 1)[1]  # the URL without the admin's credentials
    settings = Settings(
        redis_url=plain, redis_username=role, redis_password_file=stack.redis_password_path(workdir, role)
    )
    return redis_client.sync_client(settings, timeout_s=5.0)


def keyspace(admin: Any) -> dict[bytes, bytes | None]:
    """Every key and its serialized value (DUMP), read as admin: a refused command changes neither."""
    return {key: admin.dump(key) for key in admin.scan_iter(count=1000)}


def test_the_default_user_is_off(secure_redis: tuple[str, Path]) -> None:
    url, _ = secure_redis
    anonymous = redis.Redis.from_url("redis://" + url.split("@", 1)[1])
    with pytest.raises(redis.exceptions.AuthenticationError):
        anonymous.ping()


def test_a_worker_reads_features_but_cannot_write_them(secure_redis: tuple[str, Path]) -> None:
    admin = redis.Redis.from_url(secure_redis[0])
    admin.hset(profile_key("u-1"), mapping={"txn_count_30d": 3})
    worker = as_role(secure_redis, "worker")
    assert worker.hgetall(profile_key("u-1")) == {b"txn_count_30d": b"3"}
    before = keyspace(admin)
    with pytest.raises(redis.exceptions.NoPermissionError):
        worker.hset(profile_key("u-1"), "txn_count_30d", 999)
    with pytest.raises(redis.exceptions.NoPermissionError):
        worker.hset(merchant_key("m-1"), "risk", 0)
    assert keyspace(admin) == before
    # What it does write: velocity, its decision cache, its buckets.
    worker.zadd(velocity_key("u-1"), {"e1": 1.0})
    worker.set(decision_id_key("u-1", "t-1"), b"{}")
    worker.set(client_bucket_key("pos-eu-1"), b"1")
    with pytest.raises(redis.exceptions.NoPermissionError):
        worker.flushdb()


def test_the_materialize_user_writes_features(secure_redis: tuple[str, Path], sim_frame: pd.DataFrame) -> None:
    job = as_role(secure_redis, "materialize")
    result = materialize(sim_frame.head(2000), job, progress=False)
    assert result is not None
    admin = redis.Redis.from_url(secure_redis[0])
    assert admin.exists(profile_key(str(sim_frame["user_id"].iloc[0])))
    with pytest.raises(redis.exceptions.NoPermissionError):
        job.get(decision_id_key("u-1", "t-1"))


def test_the_gateway_user_has_its_buckets_and_no_decisions(secure_redis: tuple[str, Path]) -> None:
    admin = redis.Redis.from_url(secure_redis[0])
    admin.set(decision_id_key("u-1", "t-1"), b'{"action": "approve"}')
    admin.hset(profile_key("u-1"), mapping={"txn_count_30d": 3})
    gateway = as_role(secure_redis, "gateway")
    before = keyspace(admin)
    with pytest.raises(redis.exceptions.NoPermissionError):
        gateway.get(decision_id_key("u-1", "t-1"))
    with pytest.raises(redis.exceptions.NoPermissionError):
        gateway.hgetall(profile_key("u-1"))  # the features
    with pytest.raises(redis.exceptions.NoPermissionError):
        gateway.set(decision_id_key("u-1", "t-1"), b'{"action": "approve"}')  # a forged cached approve
    assert keyspace(admin) == before

    async def limit() -> list[Any]:
        url, workdir = secure_redis
        settings = Settings(redis_url="redis://" + url.split("@", 1)[1], redis_username="gateway",
                            redis_password_file=stack.redis_password_path(workdir, "gateway"))  # fmt: skip
        client = redis_client.async_client(settings, timeout_s=5.0)
        try:
            limiter = RedisRateLimiter(client, 10.0, 5.0, 10.0, 5.0)
            return await limiter.allow([("gw:acme", "gw:u-1")])  # the gateway's own bucket ids
        finally:
            await client.aclose()

    (decision,) = asyncio.run(limit())
    assert decision.allowed


def test_the_worker_user_runs_the_scoring_path(secure_redis: tuple[str, Path]) -> None:
    """Enrichment (one script: reads the profile, appends velocity), the decision
    cache and the replay guard, as the worker calls them, under the worker user."""
    from app.contract import Transaction
    from pipeline.auth import RedisReplayGuard
    from pipeline.cache import RedisDecisionCache
    from pipeline.feature_store import RedisFeatureStore

    url, workdir = secure_redis
    settings = Settings(redis_url="redis://" + url.split("@", 1)[1], redis_username="worker",
                        redis_password_file=stack.redis_password_path(workdir, "worker"))  # fmt: skip

    async def run() -> tuple[Any, Any, list[bool]]:
        client = redis_client.async_client(settings, timeout_s=5.0)
        try:
            tx = Transaction("t-acl", "u-acl", 10.0, "m-acl", 1_800_000_000.0)
            (enriched,) = await RedisFeatureStore(client).enrich([tx])
            cache = RedisDecisionCache(client, 60)
            await cache.put_many([(tx, {"action": "approve"})])
            fresh = await RedisReplayGuard(client).check([("sig-acl", "0:1")], 60)
            return enriched, await cache.get_many([tx]), fresh
        finally:
            await client.aclose()

    enriched, cached, fresh = asyncio.run(run())
    assert cached == [{"action": "approve"}] and fresh == [True]
    assert redis.Redis.from_url(url).exists(velocity_key("u-acl"))
