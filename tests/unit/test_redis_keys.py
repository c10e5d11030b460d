"""Redis Cluster readiness, without a cluster: what is read or written together
shares a hash slot, and the client factory picks the cluster client."""

from __future__ import annotations

import pytest
from redis.crc import key_slot

from app.contract import Transaction
from app.redis_client import is_cluster, plain_url
from app.settings import Settings
from pipeline.cache import content_hash, decision_keys
from pipeline.feature_store import merchant_key, profile_key, velocity_key
from pipeline.ratelimit import Limit, _plan, client_bucket_key, slot_groups, user_bucket_key


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


def test_decision_key_scheme() -> None:
    tx = _tx(3)
    assert decision_keys(tx) == (
        "fp:dec:{u:u-000003}:id:t-00003",
        f"fp:dec:{{u:u-000003}}:h:{content_hash(tx)}",
    )


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
