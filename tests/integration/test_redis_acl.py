"""Redis ACL users (``tools.stack.start_redis(secure=True)``): each role reaches its own
keys only, and runs only the commands its code sends (app/redis_acl.py).

A private redis-server with ACLs; every client goes through ``app.redis_client``
with ``FRAUD_REDIS_USERNAME`` / ``FRAUD_REDIS_PASSWORD_FILE`` settings, as the
services do.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pandas as pd
import pytest
import redis

from app import redis_client
from app.contract import Transaction
from app.redis_acl import ROLE_CODE, SENDS, acl_commands
from app.redis_keys import (
    client_bucket_key,
    decision_id_key,
    gateway_bucket_ids,
    merchant_key,
    profile_key,
    velocity_key,
)
from app.settings import Settings
from pipeline.admission import Admission
from pipeline.auth import AuthResult, RedisReplayGuard
from pipeline.cache import RedisDecisionCache
from pipeline.feature_store import RedisFeatureStore
from pipeline.labels import Label
from pipeline.lookup import Request
from pipeline.quality import RedisQualityStore, Served
from pipeline.ratelimit import RedisRateLimiter
from pipeline.redis_batch import RedisBatchLookup
from pipeline.timing import StageClock
from tools import stack
from tools.materialize import materialize
from tools.stack.secure import write_acl

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
    url, workdir = secure_redis
    settings = Settings(redis_url="redis://" + url.split("@", 1)[1], redis_username="worker",
                        redis_password_file=stack.redis_password_path(workdir, "worker"))  # fmt: skip

    async def run() -> tuple[Any, Any, list[bool]]:
        client = redis_client.async_client(settings, timeout_s=5.0)
        try:
            tx = Transaction("t-acl", "u-acl", 10.0, "m-acl", 1_800_000_000.0)
            (enriched,) = await RedisFeatureStore(client).enrich([tx])
            cache = RedisDecisionCache(client, 60)
            await cache.put_many([(tx, orjson.dumps({"action": "approve"}))])
            fresh = await RedisReplayGuard(client).check([("sig-acl", "0:1")], 60)
            return enriched, await cache.get_many([tx]), fresh
        finally:
            await client.aclose()

    enriched, cached, fresh = asyncio.run(run())
    assert cached == [{"action": "approve"}] and fresh == [True]
    assert redis.Redis.from_url(url).exists(velocity_key("u-acl"))


# --- commands: an allow-list per role ---------------------------------------------------


def role_settings(url: str, workdir: Path, role: str, **extra: Any) -> Settings:
    return Settings(redis_url="redis://" + url.split("@", 1)[1], redis_username=role,
                    redis_password_file=stack.redis_password_path(workdir, role), **extra)  # fmt: skip


async def worker_code(settings: Settings) -> None:
    """What the scoring and feedback workers send, as they call it: enrichment, the
    decision cache, the replay guard, the per-client/per-user limiter, the quality
    join (both orders, past its bound) and ``report quality``'s snapshot."""
    client = redis_client.async_client(settings, timeout_s=5.0)
    try:
        txs = [Transaction(f"t-cmd-{i}", f"u-cmd-{i % 3}", 10.0 + i, "m-cmd", 1_800_000_000.0 + i) for i in range(6)]
        await RedisFeatureStore(client, local_cache_ttl_s=0).enrich(txs)
        cache = RedisDecisionCache(client, 60)
        assert await cache.get_many(txs) == [None] * len(txs)
        await cache.put_many([(tx, orjson.dumps({"action": "approve"})) for tx in txs])
        await RedisReplayGuard(client).check([("sig-cmd", "0:1")], 60)
        await RedisRateLimiter(client, 10.0, 5.0, 10.0, 5.0).allow([("pos-cmd", tx.user_id) for tx in txs])
        # The same three in one script call (one server): a resend, a signed first copy, its replay.
        admission = Admission(
            keys={}, replay=RedisReplayGuard(client), limiter=RedisRateLimiter(client, 10.0, 5.0, 10.0, 5.0)
        )
        lookup = RedisBatchLookup(client, cache, RedisFeatureStore(client, local_cache_ttl_s=0), admission)
        fresh = Transaction("t-cmd-one", "u-cmd-0", 99.5, "m-cmd", 1_800_000_100.0)
        signed = AuthResult("pos-cmd-one", "sig-cmd-one", 1_800_000_000_000)
        answer = await lookup.look_up([
            Request(txs[0], signed, "0:9"), Request(fresh, signed, "0:10"), Request(fresh, signed, "0:11"),
        ], StageClock())  # fmt: skip
        assert answer.hits[0] is not None and answer.follows[2] == 1 and answer.enrichments
        store = RedisQualityStore(client, prefix="quality:cmd:", max_joined=2)
        now = 1_800_000_000.0
        await store.add_served([Served(f"t-q-{i}", "v1", "r1", "score", "approve", 0.1, now) for i in range(3)])
        await store.add_labels([Label(f"t-q-{i}", "legit", "chargeback", now) for i in range(6)])
        await store.add_served([Served(f"t-q-{i}", "v1", "r1", "score", "approve", 0.1, now) for i in range(3, 6)])
        await store.snapshot()
    finally:
        await client.aclose()


async def gateway_code(settings: Settings) -> None:
    """The gateway's limiter on its ``gw:`` buckets, as gateway/rest.py builds it."""
    client = redis_client.async_client(settings, timeout_s=5.0)
    try:
        await RedisRateLimiter(client, 10.0, 5.0, 10.0, 5.0).allow([gateway_bucket_ids("acme", "u-1")])
    finally:
        await client.aclose()


@pytest.mark.parametrize("role", sorted(ROLE_CODE))
def test_each_roles_code_sends_exactly_its_commands_and_none_is_refused(
    role: str, tmp_path: Path, sim_frame: pd.DataFrame
) -> None:
    """Each role's code on a fresh ACL'd server (scripts not loaded yet, as after a
    restart): nothing refused (the ACL log stays empty), and the commands it sent
    are its table's, both ways: the cluster client's discovery aside, which one
    server never sees."""
    handle = stack.start_redis(workdir=tmp_path, secure=True)
    try:
        admin = redis.Redis.from_url(handle.url, decode_responses=True)
        admin.config_resetstat()
        settings = role_settings(handle.url, tmp_path, role)
        if role == "worker":
            asyncio.run(worker_code(settings))
        elif role == "gateway":
            asyncio.run(gateway_code(settings))
        else:
            materialize(sim_frame.head(2000), redis_client.sync_client(settings, timeout_s=10.0), progress=False)
        assert admin.acl_log() == []
        sent = {name.removeprefix("cmdstat_") for name in admin.info("commandstats")} - {"config|resetstat", "acl|log"}
        assert sent == set(acl_commands(role)) - set(SENDS["cluster discovery"])
    finally:
        handle.stop()


def dry_run(admin: Any, role: str, command: str) -> str | None:
    """``ACL DRYRUN``: would ``role`` be allowed ``command`` (``name`` or ``name|sub``)?
    Placeholder arguments are added until the arity fits; None for a container
    (``SCRIPT``, ``CLIENT``...), whose subcommands are checked one by one."""
    args = command.split("|")
    for _ in range(8):
        try:
            return str(admin.execute_command("ACL", "DRYRUN", role, *args))
        except redis.exceptions.ResponseError as exc:
            if "not found" in str(exc) and "|" not in command:
                return None
            if "wrong number of arguments" not in str(exc):
                raise
            args.append("0")
    raise AssertionError(f"no arity fits {command}")


#: Redis lets every user run its connection commands flagged ``no-auth``, whatever its ACL.
EVERYONE = {"auth", "hello", "quit", "reset"}


@pytest.mark.parametrize("role", sorted(ROLE_CODE))
def test_every_command_outside_a_roles_table_is_refused(secure_redis: tuple[str, Path], role: str) -> None:
    """Every command of every ACL category (``ACL CAT``), subcommands included: the
    role's own are allowed (``+command`` brings COMMAND's subcommands: the command
    table, no keys), every other one refused."""
    admin = redis.Redis.from_url(secure_redis[0], decode_responses=True)
    everything = {c for cat in admin.execute_command("ACL", "CAT") for c in admin.execute_command("ACL", "CAT", cat)}
    assert {"scan", "randomkey", "keys", "dbsize", "select", "script|flush", "function|load"} <= everything
    own = set(acl_commands(role))
    own |= {c for c in everything if c.split("|")[0] in own}  # a container's subcommands
    verdicts = {c: dry_run(admin, role, c) for c in everything | own}
    allowed = {c for c, verdict in verdicts.items() if verdict is not None and "no permissions to run" not in verdict}
    assert allowed - EVERYONE == own - EVERYONE


@pytest.mark.parametrize("role", sorted(ROLE_CODE))
def test_no_role_lists_keys_flushes_scripts_or_switches_databases(secure_redis: tuple[str, Path], role: str) -> None:
    """What let the gateway's user learn which user made which payment (``SCAN`` lists
    ``fp:dec:{u:<user>}:id:<txid>``), and what could wipe the workers' scripts."""
    admin = redis.Redis.from_url(secure_redis[0])
    admin.set(decision_id_key("u-1", "t-1"), b"{}")
    client = as_role(secure_redis, role)
    refused = [
        lambda: client.scan(0), lambda: client.randomkey(), lambda: client.keys("*"), lambda: client.dbsize(),
        lambda: client.execute_command("SELECT", 1), lambda: client.script_flush(), lambda: client.function_flush(),
        lambda: client.function_load("#!lua name=x\nredis.register_function('x', function() return 1 end)"),
    ]  # fmt: skip
    for call in refused:
        with pytest.raises(redis.exceptions.NoPermissionError):
            call()


# --- TLS: rediss:// -------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tls_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[int, Path, Path]]:
    """A redis-server serving TLS only (no plaintext port), its certificate signed by a
    throw-away CA, with the same ACL users: (port, CA file, workdir)."""
    import subprocess

    workdir = tmp_path_factory.mktemp("redis-tls")
    tls = workdir / "tls"
    tls.mkdir()
    (tls / "san.cnf").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    for args in (
        ["req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days", "2",
         "-subj", "/CN=test CA", "-addext", "basicConstraints=critical,CA:TRUE"],
        ["req", "-newkey", "rsa:2048", "-nodes", "-keyout", "redis.key", "-out", "redis.csr", "-subj", "/CN=localhost"],
        ["x509", "-req", "-in", "redis.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
         "-out", "redis.pem", "-days", "2", "-extfile", "san.cnf"],
    ):  # fmt: skip
        subprocess.run(["openssl", *args], cwd=tls, check=True, capture_output=True, timeout=60)
    admin = write_acl(workdir / "users.acl", workdir)
    port = stack.free_port()
    proc = subprocess.Popen(
        ["redis-server", "--port", "0", "--tls-port", str(port), "--bind", "127.0.0.1", "--save", "",
         "--appendonly", "no", "--tls-cert-file", str(tls / "redis.pem"), "--tls-key-file", str(tls / "redis.key"),
         "--tls-ca-cert-file", str(tls / "ca.pem"), "--tls-auth-clients", "no",
         "--aclfile", str(workdir / "users.acl"), "--dir", str(workdir)],
        stdout=(workdir / "redis.log").open("wb"), stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        probe = redis.Redis(host="127.0.0.1", port=port, ssl=True, ssl_ca_certs=str(tls / "ca.pem"),
                            username="admin", password=admin, socket_timeout=1.0)  # fmt: skip
        for _ in range(100):
            try:
                probe.ping()
                break
            except redis.exceptions.ConnectionError:
                time.sleep(0.1)
        else:
            raise AssertionError((workdir / "redis.log").read_text())
        yield port, tls / "ca.pem", workdir
    finally:
        proc.terminate()
        proc.wait(timeout=15)


def test_a_role_reaches_redis_over_tls_with_its_user(tls_redis: tuple[int, Path, Path]) -> None:
    """``rediss://`` + ``FRAUD_REDIS_SSL_CAFILE``: the worker user's command works over
    TLS, and its ACL still applies."""
    port, ca, workdir = tls_redis
    settings = Settings(redis_url=f"rediss://127.0.0.1:{port}/0", redis_ssl_cafile=ca, redis_username="worker",
                        redis_password_file=stack.redis_password_path(workdir, "worker"))  # fmt: skip
    client = redis_client.sync_client(settings, timeout_s=5.0)
    assert client.mget([decision_id_key("u-tls", "t-tls")]) == [None]
    client.zadd(velocity_key("u-tls"), {"e1": 1.0})
    with pytest.raises(redis.exceptions.NoPermissionError):
        client.hset(profile_key("u-tls"), "txn_count_30d", 1)


def test_a_client_that_does_not_trust_the_ca_or_speaks_plaintext_gets_nothing(
    tls_redis: tuple[int, Path, Path],
) -> None:
    port, _, workdir = tls_redis
    password = stack.redis_password_path(workdir, "worker")
    untrusting = Settings(redis_url=f"rediss://127.0.0.1:{port}/0", redis_username="worker",
                          redis_password_file=password)  # system CAs only  # fmt: skip
    with pytest.raises(redis.exceptions.ConnectionError, match="CERTIFICATE_VERIFY_FAILED|certificate verify failed"):
        redis_client.sync_client(untrusting, timeout_s=2.0).ping()
    plaintext = Settings(redis_url=f"redis://127.0.0.1:{port}/0", redis_username="worker", redis_password_file=password)
    with pytest.raises(redis.exceptions.ConnectionError):
        redis_client.sync_client(plaintext, timeout_s=2.0).ping()
