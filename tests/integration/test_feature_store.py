"""The online store against a real Redis: materialization, idempotence, and
no training/serving skew."""

from __future__ import annotations

import asyncio
import math

import numpy as np
import pandas as pd
import pytest
import redis
import redis.asyncio as aioredis

from app.contract import Transaction
from app.redis_keys import MATERIALIZE_META_KEY, merchant_key, profile_key, velocity_key
from pipeline.feature_store import RedisFeatureStore
from pipeline.features import (
    DAY_S,
    FEATURE_SET_VERSION,
    build_user_profiles,
    feature_matrix,
    feature_row,
    history_transactions,
    prepare_history,
    training_matrix,
)
from tools.materialize import materialize

pytestmark = pytest.mark.integration


def enrich(url: str, batches: list[list[Transaction]]) -> list:
    async def run() -> list:
        client = aioredis.Redis.from_url(url)
        store = RedisFeatureStore(client, local_cache_ttl_s=30)
        out = []
        for batch in batches:
            out += await store.enrich(batch)
        await client.aclose()
        return out

    return asyncio.run(run())


def test_materialize_round_trip_and_rerun_is_idempotent(
    sim_frame: pd.DataFrame, redis_client: redis.Redis, redis_url: str
) -> None:
    result = materialize(sim_frame, redis_client, ttl_s=3600, progress=False)
    history = prepare_history(sim_frame)
    expected = build_user_profiles(history, result.as_of)
    user = next(iter(expected))
    stored = redis_client.hgetall(profile_key(user))
    assert stored[b"feature_set"].decode() == FEATURE_SET_VERSION
    assert float(stored[b"as_of"]) == result.as_of
    assert 0 < redis_client.ttl(profile_key(user)) <= 3600
    assert redis_client.hget(MATERIALIZE_META_KEY, "users") == str(len(expected)).encode()

    snapshot = {key: redis_client.dump(key) for key in redis_client.scan_iter("fp:*")}
    materialize(sim_frame, redis_client, ttl_s=3600, progress=False)
    again = {key: redis_client.dump(key) for key in redis_client.scan_iter("fp:*")}
    assert snapshot == again  # same keys, same serialized values: a re-run changes nothing

    served = enrich(redis_url, [[Transaction("t-new", user, 10.0, "m-x", result.as_of + 60)]])[0]
    assert served.profile == expected[user]


def test_served_features_equal_training_features(
    sim_frame: pd.DataFrame, redis_client: redis.Redis, redis_url: str
) -> None:
    """Replay the last day through the live path; every vector must equal the
    training vector of the same transaction."""
    history = prepare_history(sim_frame)
    day = math.floor(history["ts"].max() / DAY_S) * DAY_S
    materialize(sim_frame[sim_frame["timestamp"] < pd.Timestamp(day, unit="s", tz="UTC")],
                redis_client, as_of=day, progress=False)
    # Merchant risk with labels: the materialized as-of-day snapshot is what training uses too.
    from pipeline.features import build_merchant_risk

    for merchant, risk in build_merchant_risk(history, day).items():
        redis_client.hset(merchant_key(merchant), mapping=risk.to_mapping())

    day_rows = history[history["ts"] >= day]
    txs = list(history_transactions(day_rows))
    batches = [txs[i : i + 32] for i in range(0, len(txs), 32)]
    served = enrich(redis_url, batches)
    live = feature_matrix(feature_row(tx, e.profile, e.merchant, e.velocity) for tx, e in zip(txs, served))
    trained, _, _ = training_matrix(history, day, day + DAY_S)
    assert len(txs) > 50
    np.testing.assert_array_equal(live, trained)


def test_velocity_is_idempotent_under_redelivery(redis_client: redis.Redis, redis_url: str) -> None:
    t = 1_800_000_000.0
    first = Transaction("t-1", "u-v", 10.0, "m", t)
    second = Transaction("t-2", "u-v", 5.0, "m", t + 60)
    results = enrich(redis_url, [[first], [second], [first, second], [second]])
    assert results[1].velocity[:3] == (2.0, 2.0, 2.0)
    assert results[-1].velocity == results[1].velocity  # redelivered: nothing counted twice
    assert redis_client.zcard(velocity_key("u-v")) == 2
    assert 0 < redis_client.ttl(velocity_key("u-v"))


def test_an_amount_is_read_after_the_last_bar_of_its_member(redis_client: redis.Redis, redis_url: str) -> None:
    """A velocity event's member is "id|amount": an id that holds bars and
    spaces of its own still gives its amount to the window's sums."""
    t = 1_800_000_000.0
    first = Transaction("a|b 1|", "u-bar", 10.25, "m", t)
    second = Transaction("|x|2", "u-bar", 5.5, "m", t + 60)
    results = enrich(redis_url, [[first], [second]])
    assert results[1].velocity == (2.0, 2.0, 2.0, 15.75, 15.75, 15.75)


def test_a_lost_script_is_reloaded(redis_client: redis.Redis, redis_url: str) -> None:
    async def run() -> tuple:
        client = aioredis.Redis.from_url(redis_url)
        store = RedisFeatureStore(client)
        a = await store.enrich([Transaction("t-a", "u-s", 1.0, "m", 1_800_000_000.0)])
        redis_client.script_flush()  # what a Redis restart does
        b = await store.enrich([Transaction("t-b", "u-s", 1.0, "m", 1_800_000_001.0)])
        await client.aclose()
        return a[0].velocity[0], b[0].velocity[0]

    assert asyncio.run(run()) == (1.0, 2.0)
