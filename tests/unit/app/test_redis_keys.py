"""The Redis key scheme byte for byte, and Redis Cluster readiness without a
cluster: what is read or written together shares a hash slot, and the client
factory picks the cluster client with each caller's timeouts."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Any

import pytest
from redis.crc import key_slot

from app import redis_keys
from app.contract import Transaction
from app.redis_client import BATCH_TIMEOUT_S, async_client, is_cluster, plain_url, sync_client
from app.redis_keys import (
    MATERIALIZE_META_KEY,
    client_bucket_key,
    content_hash,
    decision_hash_key,
    decision_id_key,
    decision_keys,
    gateway_bucket_ids,
    merchant_key,
    profile_key,
    quality_decided_key,
    quality_joined_at_key,
    quality_joined_key,
    quality_label_key,
    quality_prefix,
    quality_served_key,
    signature_key,
    user_bucket_key,
    velocity_key,
)
from app.settings import Settings
from pipeline.ratelimit import Limit, _plan, slot_groups


def _slot(key: str) -> int:
    return key_slot(key.encode())


def _tx(i: int) -> Transaction:
    return Transaction(
        transaction_id=f"t-{i:05d}", user_id=f"u-{i % 97:06d}", amount=10.0 + i, currency="EUR",
        merchant_id=f"m-{i % 13:06d}", timestamp=1_800_000_000.0 + i,
    )  # fmt: skip


def test_a_users_keys_share_one_slot() -> None:
    """Profile, velocity, rate bucket and both decision-cache entries of a user: one slot,
    so a batch's commands for that user go to one node."""
    for i in range(200):
        tx = _tx(i)
        slots = {_slot(k) for k in (profile_key(tx.user_id), velocity_key(tx.user_id), user_bucket_key(tx.user_id),
                                     *decision_keys(tx))}  # fmt: skip
        assert len(slots) == 1, (tx.user_id, slots)


# --- the literal keys: what is already stored is found by exactly these bytes ---------------


def test_feature_store_keys_byte_exact() -> None:
    assert profile_key("u-000042") == "fp:{u:u-000042}:profile"
    assert velocity_key("u-000042") == "fp:{u:u-000042}:vel"
    assert merchant_key("m-000007") == "fp:{m:m-000007}:risk"
    assert MATERIALIZE_META_KEY == "fp:meta"


def test_decision_key_scheme() -> None:
    tx = _tx(3)
    # The digest is part of the key: its fields and encoding are pinned with it.
    assert content_hash(tx) == "c2373295316b37a3c779353bec70a962"
    assert decision_keys(tx) == (
        "fp:dec:{u:u-000003}:id:t-00003",
        "fp:dec:{u:u-000003}:h:c2373295316b37a3c779353bec70a962",
    )
    assert decision_id_key("u-1", "t-1") == "fp:dec:{u:u-1}:id:t-1"
    assert decision_hash_key("u-1", "ab" * 16) == "fp:dec:{u:u-1}:h:" + "ab" * 16


def test_content_hash_covers_the_optional_fields() -> None:
    tx = Transaction(
        transaction_id="t-9", user_id="u-9", amount=12.5, currency="USD", merchant_id="m-9", device_id="d-1",
        lat=48.85, lon=2.35, timestamp=1_800_000_000.0,
    )  # fmt: skip
    assert content_hash(tx) == "c1f1422ef42d64c70bc1f9611af51ad9"
    # Not part of the payment's identity: the id, and fields outside the hash.
    assert content_hash(replace(tx, transaction_id="t-other", country="FR")) == content_hash(tx)
    assert content_hash(replace(tx, amount=12.51)) != content_hash(tx)


def test_rate_limit_keys_byte_exact() -> None:
    assert client_bucket_key("pos-eu-1") == "fp:rl:{c:pos-eu-1}"
    assert user_bucket_key("u-42") == "fp:rl:{u:u-42}"
    # The gateway's buckets, apart from the workers' for the same ids.
    client, user = gateway_bucket_ids("shop-1", "u-42")
    assert (client, user) == ("gw:shop-1", "gw:u-42")
    assert (client_bucket_key(client), user_bucket_key(user)) == ("fp:rl:{c:gw:shop-1}", "fp:rl:{u:gw:u-42}")


def test_signature_key_byte_exact() -> None:
    assert signature_key("a" * 64) == "fp:sig:" + "a" * 64


def test_quality_keys_byte_exact() -> None:
    prefix = quality_prefix("fraud-pipeline")
    assert prefix == "quality:fraud-pipeline:"
    assert quality_served_key(prefix, "t-1") == "quality:fraud-pipeline:fb:t-1"
    assert quality_label_key(prefix, "t-1") == "quality:fraud-pipeline:lab:t-1"
    assert quality_decided_key(prefix) == "quality:fraud-pipeline:decided"
    assert quality_joined_key(prefix) == "quality:fraud-pipeline:joined"
    assert quality_joined_at_key(prefix) == "quality:fraud-pipeline:joined-at"
    assert quality_served_key(redis_keys.QUALITY_PREFIX, "t-2") == "quality:fb:t-2"


def test_every_key_builder_is_pinned_here() -> None:
    """A builder added to app/redis_keys.py gets its literal key tested in this file."""
    tested = {
        "ACL_KEY_PATTERNS", "GATEWAY_NAMESPACE", "MATERIALIZE_META_KEY", "QUALITY_PREFIX", "client_bucket_key", "content_hash",
        "decision_hash_key", "decision_id_key", "decision_keys", "gateway_bucket_ids", "merchant_key", "profile_key",
        "quality_decided_key", "quality_joined_at_key", "quality_joined_key", "quality_label_key", "quality_prefix",
        "quality_served_key", "signature_key", "user_bucket_key", "velocity_key",
    }  # fmt: skip
    assert set(redis_keys.__all__) == tested


def test_acl_patterns_are_pinned_and_cover_each_roles_keys() -> None:
    """The Redis users' key patterns (SECURITY.md, *Redis users*), literally."""
    from fnmatch import fnmatchcase

    assert redis_keys.ACL_KEY_PATTERNS == {
        "worker": ("%R~fp:{u:*}:profile", "%R~fp:{m:*}:risk", "%R~fp:meta", "~fp:{u:*}:vel", "~fp:dec:*",
                   "~fp:rl:*", "~fp:sig:*", "~quality:*"),
        "gateway": ("~fp:rl:{c:gw:*}", "~fp:rl:{u:gw:*}"),
        "materialize": ("~fp:{u:*}:profile", "~fp:{m:*}:risk", "~fp:{u:*}:vel", "~fp:meta"),
    }  # fmt: skip
    gateway = [p.lstrip("~") for p in redis_keys.ACL_KEY_PATTERNS["gateway"]]
    for key in (client_bucket_key("gw:acme"), user_bucket_key("gw:u-1")):
        assert any(fnmatchcase(key, p) for p in gateway), key
    assert not any(fnmatchcase(client_bucket_key("pos-eu-1"), p) for p in gateway)


def test_the_stages_use_the_key_module() -> None:
    """One scheme: the stages' keys are the module's, not copies of it."""
    from pipeline import auth, cache, feature_store, quality, ratelimit
    from tools import materialize

    assert feature_store.profile_key is profile_key and materialize.velocity_key is velocity_key
    assert cache.decision_keys is decision_keys and ratelimit.user_bucket_key is user_bucket_key
    assert auth.signature_key is signature_key and quality.quality_served_key is quality_served_key


# --- slots ------------------------------------------------------------------------------------


def test_users_spread_over_slots() -> None:
    """The tag is the user, not a constant: users land on many slots (and nodes)."""
    assert len({_slot(profile_key(f"u-{i}")) for i in range(500)}) > 400
    assert _slot(merchant_key("m-1")) == _slot("{m:m-1}")
    assert _slot(client_bucket_key("pos-1")) == _slot("{c:pos-1}")


def test_rate_limit_calls_stay_in_one_slot() -> None:
    """On a cluster the limiter makes one script call per group: each group's keys share a slot."""
    requests = [(f"pos-{i % 3}", f"u-{i % 40}") for i in range(120)]
    plan = _plan(requests, Limit(100, 100), Limit(1, 5))
    for position in (0, 1):  # client buckets, then user buckets
        groups = slot_groups(plan.keys, {n: pair[position] for n, pair in enumerate(plan.requests)})
        assert sorted(n for g in groups for n in g) == list(range(len(requests)))
        for group in groups:
            assert group == sorted(group), "requests keep their order within a call"
            assert len({_slot(plan.keys[plan.requests[n][position]]) for n in group}) == 1


@pytest.mark.parametrize(
    ("url", "flag", "cluster", "plain"),
    [
        ("redis://127.0.0.1:6379/0", False, False, "redis://127.0.0.1:6379/0"),
        ("redis+cluster://10.0.0.5:7000", False, True, "redis://10.0.0.5:7000"),
        ("rediss+cluster://user:pw@node:7000", False, True, "rediss://user:pw@node:7000"),
        ("redis://node:7000", True, True, "redis://node:7000"),
    ],
)
def test_cluster_is_chosen_by_scheme_or_setting(url: str, flag: bool, cluster: bool, plain: str) -> None:
    assert is_cluster(Settings(redis_url=url, redis_cluster=flag)) is cluster
    assert plain_url(url) == plain


# --- the client factory -----------------------------------------------------------------------


def _kwargs(client: Any) -> dict[str, Any]:
    pool = getattr(client, "connection_pool", None)
    return dict(pool.connection_kwargs if pool is not None else client.connection_kwargs)


def _max_connections(client: Any) -> int:
    pool = getattr(client, "connection_pool", None)
    return pool.max_connections if pool is not None else client.connection_kwargs["max_connections"]


@pytest.mark.parametrize("url", ["redis://127.0.0.1:1/0", "redis+cluster://127.0.0.1:1"])
def test_async_client_defaults_to_the_hot_path_and_takes_each_callers_timeouts(url: str) -> None:
    """No connection is made here: the clients are only built and inspected."""
    settings = Settings(redis_url=url, redis_timeout_s=0.05, redis_pool_size=8)

    async def build() -> None:
        cluster = url.startswith("redis+cluster")
        hot = async_client(settings)
        assert type(hot).__name__ == ("RedisCluster" if cluster else "Redis")
        assert (_kwargs(hot)["socket_timeout"], _kwargs(hot)["socket_connect_timeout"]) == (0.05, 0.2)
        assert _max_connections(hot) == 8
        slow = async_client(settings, timeout_s=2.0, connect_timeout_s=3.0, max_connections=100)
        assert (_kwargs(slow)["socket_timeout"], _kwargs(slow)["socket_connect_timeout"]) == (2.0, 3.0)
        assert _max_connections(slow) == 100
        for client in (hot, slow):
            await client.aclose()

    asyncio.run(build())


def test_sync_client_is_a_batch_jobs() -> None:
    client = sync_client(Settings(redis_url="redis://127.0.0.1:1/0"))
    assert (_kwargs(client)["socket_timeout"], _kwargs(client)["socket_connect_timeout"]) == (BATCH_TIMEOUT_S,) * 2
    client.close()
    client = sync_client(Settings(redis_url="redis://127.0.0.1:1/0"), timeout_s=5.0, connect_timeout_s=1.0)
    assert (_kwargs(client)["socket_timeout"], _kwargs(client)["socket_connect_timeout"]) == (5.0, 1.0)
    client.close()
