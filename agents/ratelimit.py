"""Per-client and per-user token buckets, shared by all workers through Redis.

Each request (one transaction) costs a token from its client's bucket and one
from its user's bucket. A bucket holds at most ``burst`` tokens and refills at
``rate`` per second. A request passes only when *every* bucket it draws on has
the token, and then takes from all of them; otherwise it takes from none, so a
user over their limit does not spend their client's allowance (and cannot
starve that client's other users). A refused request learns which bucket
refused (the one it would wait longest for) and ``retry_after_s``, the wait
until it would pass if nothing else drew on the buckets meanwhile.

:class:`RedisRateLimiter` makes one ``EVALSHA`` per batch: the script reads
each distinct bucket once, decides the batch's requests in order, writes each
bucket back once and lets it expire after a full refill (a full bucket and a
missing one are the same, so idle users cost no memory).
:class:`InMemoryRateLimiter` runs the same arithmetic in Python, step for step,
and gives the same answers on the same sequence.

Time is the caller's clock (``clock()``, epoch seconds), not Redis ``TIME``:
tests drive it, and both limiters see the same numbers. Workers' clocks differ
by their NTP skew; a bucket is never refilled backwards (a worker behind the
last writer refills nothing), so skew can only delay a refill by that skew.

NOTE: one script call touches all of a batch's buckets, so they must live on
one Redis node; the hash tags ``{c:…}`` and ``{u:…}`` put a client's and a
user's bucket in different Redis Cluster slots. On a cluster, split the batch
by slot (and give up the all-or-nothing across client and user).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from redis.exceptions import NoScriptError

from agents.validate import Rejection
from app.errors import ConfigError

__all__ = [
    "ALLOWED",
    "BUCKETS",
    "COST",
    "TOKEN_BUCKET_SCRIPT",
    "Bucket",
    "InMemoryRateLimiter",
    "Limit",
    "RateDecision",
    "RateLimiter",
    "RedisRateLimiter",
    "client_bucket_key",
    "user_bucket_key",
]

Bucket = Literal["client", "user"]
#: Order of a request's buckets, in the plan and in the script's answer.
BUCKETS: tuple[Bucket, Bucket] = ("client", "user")
#: Tokens one transaction costs. The script takes it as an argument so a
#: weighted cost (by amount, say) needs no script change.
COST = 1.0

#: KEYS: the batch's distinct buckets. ARGV: now, cost, then (rate, burst) per
#: key, then per request the number of its buckets followed by their 1-based
#: indices into KEYS. Returns per request: the 1-based position of the bucket
#: that refused it (0 = allowed) and the retry-after seconds as a string (a Lua
#: number would be truncated to an integer reply). '%.17g' keeps every double
#: exact, so the stored state and answers match the Python twin bit for bit.
TOKEN_BUCKET_SCRIPT = """
local now, cost = tonumber(ARGV[1]), tonumber(ARGV[2])
local rate, burst, tokens, last = {}, {}, {}, {}
for i = 1, #KEYS do
  rate[i], burst[i] = tonumber(ARGV[1 + 2 * i]), tonumber(ARGV[2 + 2 * i])
  local state = redis.call('HMGET', KEYS[i], 'tokens', 'at')
  tokens[i], last[i] = tonumber(state[1]), tonumber(state[2])
  if tokens[i] == nil then
    tokens[i], last[i] = burst[i], now
  elseif now > last[i] then
    tokens[i], last[i] = math.min(burst[i], tokens[i] + (now - last[i]) * rate[i]), now
  end
end
local out, pos = {}, 3 + 2 * #KEYS
while pos <= #ARGV do
  local n = tonumber(ARGV[pos])
  local refused, wait = 0, 0
  for j = 1, n do
    local i = tonumber(ARGV[pos + j])
    if tokens[i] < cost and (cost - tokens[i]) / rate[i] > wait then
      refused, wait = j, (cost - tokens[i]) / rate[i]
    end
  end
  if refused == 0 then
    for j = 1, n do
      local i = tonumber(ARGV[pos + j])
      tokens[i] = tokens[i] - cost
    end
  end
  out[#out + 1] = refused
  out[#out + 1] = string.format('%.17g', wait)
  pos = pos + n + 1
end
for i = 1, #KEYS do
  redis.call('HSET', KEYS[i], 'tokens', string.format('%.17g', tokens[i]), 'at', string.format('%.17g', last[i]))
  redis.call('PEXPIRE', KEYS[i], math.ceil(burst[i] / rate[i] * 1000) + 1000)
end
return out
"""


def client_bucket_key(client_id: str) -> str:
    return f"fp:rl:{{c:{client_id}}}"


def user_bucket_key(user_id: str) -> str:
    return f"fp:rl:{{u:{user_id}}}"


@dataclass(frozen=True, slots=True)
class Limit:
    """A token bucket's shape: ``rate`` tokens per second, at most ``burst``."""

    rate: float
    burst: float

    def __post_init__(self) -> None:
        if not self.rate > 0:
            raise ConfigError(f"a rate limit must refill at > 0 per second, got {self.rate}")
        if not COST <= self.burst < float("inf"):
            raise ConfigError(f"a rate limit's burst must be >= {COST:g} (one transaction), got {self.burst}")


@dataclass(frozen=True, slots=True)
class RateDecision:
    """Whether one request may proceed; if not, which bucket refused and for how long."""

    allowed: bool
    bucket: Bucket | None = None
    retry_after_s: float = 0.0

    def rejection(self, transaction_id: str | None, user_id: str | None) -> Rejection:
        """The ``rate_limited`` rejection for a refused transaction.

        NOTE: do not put its ``reject`` decision in the decision cache: the
        resend after ``retry_after_s`` would get the cached reject back."""
        field = "client-id" if self.bucket == "client" else "user_id"
        reason = f"the {self.bucket} is over its rate limit; retry after {self.retry_after_s:.3f} s"
        return Rejection("rate_limited", field, reason, transaction_id, user_id)


ALLOWED = RateDecision(True)


class RateLimiter(Protocol):
    async def allow(self, requests: Sequence[tuple[str, str]]) -> list[RateDecision]:
        """Decide ``(client_id, user_id)`` requests in order, taking tokens for those allowed."""
        ...


@dataclass(frozen=True, slots=True)
class _Plan:
    """A batch laid out for the script: distinct keys, their limits, and each
    request's 0-based key indices (client first, as in :data:`BUCKETS`)."""

    keys: list[str]
    limits: list[Limit]
    requests: list[tuple[int, int]]


def _plan(requests: Sequence[tuple[str, str]], client: Limit, user: Limit) -> _Plan:
    index: dict[str, int] = {}
    limits: list[Limit] = []
    pairs: list[tuple[int, int]] = []
    for client_id, user_id in requests:
        pair = []
        for key, limit in ((client_bucket_key(client_id), client), (user_bucket_key(user_id), user)):
            if key not in index:
                index[key] = len(index)
                limits.append(limit)
            pair.append(index[key])
        pairs.append((pair[0], pair[1]))
    return _Plan(list(index), limits, pairs)


def _decision(refused: int, wait: float) -> RateDecision:
    return ALLOWED if refused == 0 else RateDecision(False, BUCKETS[refused - 1], wait)


class RedisRateLimiter:
    """Buckets in Redis, shared by every worker; one round trip per batch."""

    def __init__(
        self,
        client: Any,
        client_rate: float,
        client_burst: float,
        user_rate: float,
        user_burst: float,
        *,
        clock: Callable[[], float] = time.time,
    ) -> None:
        """``client`` is a ``redis.asyncio.Redis``. Redis errors propagate: the caller decides to fail open."""
        self._client = client
        self.client_limit = Limit(client_rate, client_burst)
        self.user_limit = Limit(user_rate, user_burst)
        self._clock = clock
        self._sha: str | None = None

    async def allow(self, requests: Sequence[tuple[str, str]]) -> list[RateDecision]:
        if not requests:
            return []
        try:
            return await self._allow(requests)
        except NoScriptError:
            # Redis restarted or ran SCRIPT FLUSH: load the script again, retry once.
            # NOTE: match the type: redis-py strips "NOSCRIPT" from the message.
            self._sha = None
            return await self._allow(requests)

    async def _allow(self, requests: Sequence[tuple[str, str]]) -> list[RateDecision]:
        if self._sha is None:
            self._sha = await self._client.script_load(TOKEN_BUCKET_SCRIPT)
        plan = _plan(requests, self.client_limit, self.user_limit)
        # repr(float) is the shortest exact form: Lua's tonumber gets the same double.
        args: list[str | int] = [repr(float(self._clock())), repr(COST)]
        for limit in plan.limits:
            args += (repr(float(limit.rate)), repr(float(limit.burst)))
        for pair in plan.requests:
            args += (len(pair), *(i + 1 for i in pair))
        reply = await self._client.evalsha(self._sha, len(plan.keys), *plan.keys, *args)
        return [_decision(int(reply[2 * n]), float(reply[2 * n + 1])) for n in range(len(requests))]


class InMemoryRateLimiter:
    """The same buckets in one process (tests, a single development worker)."""

    def __init__(
        self,
        client_rate: float,
        client_burst: float,
        user_rate: float,
        user_burst: float,
        *,
        clock: Callable[[], float] = time.time,
        max_buckets: int = 100_000,
    ) -> None:
        self.client_limit = Limit(client_rate, client_burst)
        self.user_limit = Limit(user_rate, user_burst)
        self._clock = clock
        self.max_buckets = max_buckets
        self._buckets: dict[str, tuple[float, float, Limit]] = {}  # key -> (tokens, at, limit)

    async def allow(self, requests: Sequence[tuple[str, str]]) -> list[RateDecision]:
        if not requests:
            return []
        now = float(self._clock())
        plan = _plan(requests, self.client_limit, self.user_limit)
        buckets = zip(plan.keys, plan.limits, strict=True)
        states = [_refill(self._buckets.get(key), limit, now) for key, limit in buckets]
        tokens = [t for t, _ in states]
        out = []
        for pair in plan.requests:  # as the script's second loop
            refused, wait = 0, 0.0
            for j, i in enumerate(pair, start=1):
                if tokens[i] < COST and (COST - tokens[i]) / plan.limits[i].rate > wait:
                    refused, wait = j, (COST - tokens[i]) / plan.limits[i].rate
            if refused == 0:
                for i in pair:
                    tokens[i] -= COST
            out.append(_decision(refused, wait))
        for i, key in enumerate(plan.keys):
            self._buckets[key] = (tokens[i], states[i][1], plan.limits[i])
        if len(self._buckets) > self.max_buckets:
            self._forget_full(now)
        return out

    def _forget_full(self, now: float) -> None:
        # A bucket that has refilled completely is the same as no bucket (Redis expires it).
        for key, (tokens, at, limit) in list(self._buckets.items()):
            if tokens + (now - at) * limit.rate >= limit.burst:
                del self._buckets[key]


def _refill(state: tuple[float, float, Limit] | None, limit: Limit, now: float) -> tuple[float, float]:
    """(tokens, at) of a bucket at ``now``: the script's first loop, in Python."""
    if state is None:
        return limit.burst, now
    tokens, at, _ = state
    if now > at:  # never refill backwards: another worker's clock may be ahead
        return min(limit.burst, tokens + (now - at) * limit.rate), now
    return tokens, at
