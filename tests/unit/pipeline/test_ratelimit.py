"""Token buckets, in memory: the semantics the Redis limiter must match."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest

from app.errors import ConfigError
from app.redis_keys import client_bucket_key, user_bucket_key
from pipeline.ratelimit import (
    ALLOWED,
    InMemoryRateLimiter,
    Limit,
    RateDecision,
)

WIDE = 1000.0  # a limit no test reaches


class FakeClock:
    def __init__(self, now: float = 1_700_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def allow(limiter: InMemoryRateLimiter, requests: Sequence[tuple[str, str]]) -> list[RateDecision]:
    return asyncio.run(limiter.allow(requests))


def denied(bucket: str, retry_after_s: float) -> RateDecision:
    return RateDecision(False, bucket, retry_after_s)  # type: ignore[arg-type]


def test_bucket_keys_byte_exact() -> None:
    assert client_bucket_key("pos-eu-1") == "fp:rl:{c:pos-eu-1}"
    assert user_bucket_key("u-42") == "fp:rl:{u:u-42}"


def test_client_burst_then_deny_with_retry_after() -> None:
    limiter = InMemoryRateLimiter(4.0, 3, WIDE, WIDE, clock=FakeClock())
    got = allow(limiter, [("c", f"u{i}") for i in range(5)])
    assert got == [ALLOWED] * 3 + [denied("client", 0.25)] * 2


def test_user_bucket_is_named() -> None:
    limiter = InMemoryRateLimiter(WIDE, WIDE, 0.5, 2, clock=FakeClock())
    got = allow(limiter, [("c", "u1"), ("c", "u1"), ("c", "u1"), ("c", "u2")])
    assert got == [ALLOWED, ALLOWED, denied("user", 2.0), ALLOWED]


def test_a_refused_request_takes_no_token_from_its_other_bucket() -> None:
    # u1 is over its own limit; its refused requests must not spend the client's tokens.
    limiter = InMemoryRateLimiter(1.0, 3, 1.0, 1, clock=FakeClock())
    got = allow(limiter, [("c", "u1"), ("c", "u1"), ("c", "u1"), ("c", "u2"), ("c", "u3"), ("c", "u4")])
    assert got == [ALLOWED, denied("user", 1.0), denied("user", 1.0), ALLOWED, ALLOWED, denied("client", 1.0)]


def test_the_longest_wait_names_the_bucket() -> None:
    limiter = InMemoryRateLimiter(2.0, 1, 0.5, 1, clock=FakeClock())
    assert allow(limiter, [("c", "u"), ("c", "u")]) == [ALLOWED, denied("user", 2.0)]


def test_refill_over_time_capped_at_burst() -> None:
    clock = FakeClock()
    limiter = InMemoryRateLimiter(2.0, 2, WIDE, WIDE, clock=clock)
    assert allow(limiter, [("c", "u")] * 3) == [ALLOWED, ALLOWED, denied("client", 0.5)]
    clock.now += 0.25  # half a token back
    assert allow(limiter, [("c", "u")]) == [denied("client", 0.25)]
    clock.now += 0.25  # waited the retry-after: one token
    assert allow(limiter, [("c", "u")] * 2) == [ALLOWED, denied("client", 0.5)]
    clock.now += 3600  # an hour refills to the burst, not beyond
    assert allow(limiter, [("c", "u")] * 3) == [ALLOWED, ALLOWED, denied("client", 0.5)]


def test_a_clock_behind_the_last_writer_refills_nothing() -> None:
    clock = FakeClock()
    limiter = InMemoryRateLimiter(1.0, 1, WIDE, WIDE, clock=clock)
    assert allow(limiter, [("c", "u")]) == [ALLOWED]
    clock.now -= 5  # another worker, 5 s behind
    assert allow(limiter, [("c", "u")]) == [denied("client", 1.0)]
    clock.now += 6  # one second after the first take
    assert allow(limiter, [("c", "u")]) == [ALLOWED]


def test_clients_and_users_have_separate_buckets() -> None:
    limiter = InMemoryRateLimiter(1.0, 1, 1.0, 1, clock=FakeClock())
    # The same string as a client id and a user id names two buckets.
    assert allow(limiter, [("x", "x"), ("y", "z")]) == [ALLOWED, ALLOWED]


def test_empty_batch() -> None:
    assert allow(InMemoryRateLimiter(1.0, 1, 1.0, 1), []) == []


def test_full_buckets_are_forgotten_past_the_bound() -> None:
    clock = FakeClock()
    limiter = InMemoryRateLimiter(WIDE, WIDE, 1.0, 1, clock=clock, max_buckets=10)
    allow(limiter, [("c", f"u{i}") for i in range(20)])
    clock.now += 1  # every user's bucket refilled
    allow(limiter, [("c", "fresh")])
    assert allow(limiter, [("c", "u0"), ("c", "fresh")]) == [ALLOWED, denied("user", 1.0)]
    assert len(limiter._buckets) <= 10


@pytest.mark.parametrize(("rate", "burst"), [(0.0, 1.0), (-1.0, 1.0), (1.0, 0.5), (1.0, float("inf"))])
def test_impossible_limits_are_config_errors(rate: float, burst: float) -> None:
    with pytest.raises(ConfigError):
        Limit(rate, burst)
    with pytest.raises(ConfigError):
        InMemoryRateLimiter(rate, burst, 1.0, 1.0)


@pytest.mark.parametrize(("bucket", "field"), [("client", "client-id"), ("user", "user_id")])
def test_rejection_names_the_bucket(bucket: str, field: str) -> None:
    why = denied(bucket, 0.25).rejection("t-1", "u-1")
    assert (why.code, why.field, why.transaction_id, why.user_id) == ("rate_limited", field, "t-1", "u-1")
    assert bucket in why.reason and "0.250 s" in why.reason
