"""The Redis rate limiter and replay guard against a real redis-server.

The in-memory twins define the semantics; here the Redis ones must give the
same answers on the same sequence, share state between workers, and survive
the loss of their script.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import random
from collections.abc import Awaitable, Callable
from typing import TypeVar

import pytest
import redis
import redis.asyncio as aioredis

from app.redis_keys import client_bucket_key, signature_key, user_bucket_key
from pipeline.auth import InMemoryReplayGuard, RedisReplayGuard
from pipeline.ratelimit import (
    ALLOWED,
    TOKEN_BUCKET_SCRIPT,
    InMemoryRateLimiter,
    RateDecision,
    RedisRateLimiter,
)

pytestmark = pytest.mark.integration

T = TypeVar("T")
LIMITS = (4.0, 3.0, 0.5, 2.0)  # client rate, client burst, user rate, user burst


class FakeClock:
    def __init__(self, now: float = 1_700_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def run(redis_url: str, scenario: Callable[[aioredis.Redis], Awaitable[T]]) -> T:
    """Run ``scenario`` with an asyncio client made inside its own event loop."""

    async def go() -> T:
        client = aioredis.Redis.from_url(redis_url)
        try:
            return await scenario(client)
        finally:
            await client.aclose()

    return asyncio.run(go())


def test_redis_limiter_matches_in_memory_on_the_same_sequence(redis_client: redis.Redis, redis_url: str) -> None:
    rng = random.Random(7)
    clock = FakeClock()
    memory = InMemoryRateLimiter(*LIMITS, clock=clock)
    steps = [0.0, 0.05, 0.125, 0.3, 1.0, 2.5, -0.5]  # -0.5: a worker whose clock is behind

    async def scenario(client: aioredis.Redis) -> list[tuple[list[RateDecision], list[RateDecision]]]:
        shared = RedisRateLimiter(client, *LIMITS, clock=clock)
        pairs = []
        for _ in range(80):
            clock.now += rng.choice(steps)
            batch = [(rng.choice("ab"), f"u{rng.randrange(6)}") for _ in range(rng.randint(1, 12))]
            pairs.append((await shared.allow(batch), await memory.allow(batch)))
        return pairs

    pairs = run(redis_url, scenario)
    for n, (from_redis, from_memory) in enumerate(pairs):
        assert from_redis == from_memory, f"batch {n}"
    seen = {d.bucket for got, _ in pairs for d in got}
    assert seen == {None, "client", "user"}, "the sequence should exercise both buckets"


def test_buckets_are_shared_across_workers(redis_client: redis.Redis, redis_url: str) -> None:
    clock = FakeClock()

    async def scenario(client: aioredis.Redis) -> list[list[RateDecision]]:
        other = aioredis.Redis.from_url(redis_url)  # a second worker, its own pool
        try:
            one = RedisRateLimiter(client, 1.0, 2, 100.0, 100, clock=clock)
            two = RedisRateLimiter(other, 1.0, 2, 100.0, 100, clock=clock)
            return [await one.allow([("c", "u1")]), await two.allow([("c", "u2")]), await one.allow([("c", "u3")])]
        finally:
            await other.aclose()

    assert run(redis_url, scenario) == [[ALLOWED], [ALLOWED], [RateDecision(False, "client", 1.0)]]


def test_bucket_state_and_expiry(redis_client: redis.Redis, redis_url: str) -> None:
    clock = FakeClock(1000.5)

    async def scenario(client: aioredis.Redis) -> list[RateDecision]:
        return await RedisRateLimiter(client, *LIMITS, clock=clock).allow([("pos-1", "u-1")])

    assert run(redis_url, scenario) == [ALLOWED]
    assert redis_client.hgetall(client_bucket_key("pos-1")) == {b"tokens": b"2", b"at": b"1000.5"}
    assert redis_client.hgetall(user_bucket_key("u-1")) == {b"tokens": b"1", b"at": b"1000.5"}
    # A full bucket is the same as none: each expires once it would have refilled.
    assert 0 < redis_client.pttl(client_bucket_key("pos-1")) <= math.ceil(3 / 4 * 1000) + 1000
    assert 0 < redis_client.pttl(user_bucket_key("u-1")) <= math.ceil(2 / 0.5 * 1000) + 1000


def test_noscript_after_script_flush_is_recovered(redis_client: redis.Redis, redis_url: str) -> None:
    clock = FakeClock()

    async def scenario(client: aioredis.Redis) -> list[list[RateDecision]]:
        limiter = RedisRateLimiter(client, 1.0, 1, 100.0, 100, clock=clock)
        first = await limiter.allow([("c", "u")])
        await asyncio.to_thread(redis_client.script_flush)  # as after a Redis restart
        return [first, await limiter.allow([("c", "u")])]

    assert run(redis_url, scenario) == [[ALLOWED], [RateDecision(False, "client", 1.0)]]
    # The limiter loaded it again by itself.
    assert redis_client.script_exists(hashlib.sha1(TOKEN_BUCKET_SCRIPT.encode()).hexdigest()) == [True]


REPLAY_SEQUENCE = [
    [("a" * 64, "0:10")],
    [("a" * 64, "0:10"), ("b" * 64, "0:11")],  # a redelivery, and a new one
    [("a" * 64, "5:99"), ("c" * 64, "0:12"), ("c" * 64, "0:13"), ("c" * 64, "0:12")],
    [("b" * 64, "0:11"), ("b" * 64, "1:4")],
]


def test_redis_replay_guard_matches_in_memory(redis_client: redis.Redis, redis_url: str) -> None:
    async def scenario(client: aioredis.Redis) -> list[list[bool]]:
        guard = RedisReplayGuard(client)
        return [await guard.check(batch, 60) for batch in REPLAY_SEQUENCE]

    async def in_memory() -> list[list[bool]]:
        guard = InMemoryReplayGuard()
        return [await guard.check(batch, 60) for batch in REPLAY_SEQUENCE]

    got = run(redis_url, scenario)
    assert got == asyncio.run(in_memory())
    assert got == [[True], [True, True], [False, True, False, True], [True, False]]
    assert redis_client.get(signature_key("a" * 64)) == b"0:10"
    assert 0 < redis_client.ttl(signature_key("a" * 64)) <= 60


def test_replay_marks_are_shared_across_workers(redis_client: redis.Redis, redis_url: str) -> None:
    async def scenario(client: aioredis.Redis) -> list[list[bool]]:
        other = aioredis.Redis.from_url(redis_url)
        try:
            one, two = RedisReplayGuard(client), RedisReplayGuard(other)
            return [
                await one.check([("d" * 64, "2:1")], 60),
                await two.check([("d" * 64, "7:1")], 60),  # replayed onto another partition
                await two.check([("d" * 64, "2:1")], 60),  # the original, redelivered after a rebalance
                await one.check([], 60),
            ]
        finally:
            await other.aclose()

    assert run(redis_url, scenario) == [[True], [False], [True], []]
