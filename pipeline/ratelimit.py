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

On a Redis Cluster one script call may only touch keys of one slot, and the
hash tags ``{c:…}`` and ``{u:…}`` put a client's and a user's bucket in
different slots. There the limiter asks in two steps (two round trips, each
one script call per slot, in parallel): first the users' buckets, then the
clients' buckets for the requests their user admitted. A user over their limit
still spends none of their client's allowance; what is given up is the other
direction: a request its client refuses has already spent its user's token.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from redis.exceptions import NoScriptError

from app.errors import ConfigError
from app.redis_keys import client_bucket_key, user_bucket_key
from pipeline.validate import Rejection

__all__ = [
    "ALLOWED",
    "BUCKETS",
    "COST",
    "TOKEN_BUCKET_FUNCTION",
    "TOKEN_BUCKET_SCRIPT",
    "Bucket",
    "BucketPlan",
    "InMemoryRateLimiter",
    "Limit",
    "RateDecision",
    "RateLimiter",
    "RedisRateLimiter",
    "rate_decision",
    "slot_groups",
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
#: Written as a Lua function of (KEYS, ARGV) so that the batch's one-call script
#: (pipeline/redis_batch.py) runs this very rule on its share of the batch.
TOKEN_BUCKET_FUNCTION = """
local function token_buckets(KEYS, ARGV)
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
end
"""
TOKEN_BUCKET_SCRIPT = TOKEN_BUCKET_FUNCTION + "return token_buckets(KEYS, ARGV)\n"


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
class BucketPlan:
    """A batch laid out for the script: distinct keys, their limits, and each
    request's 0-based key indices (client first, as in :data:`BUCKETS`)."""

    keys: list[str]
    limits: list[Limit]
    requests: list[tuple[int, int]]


def _plan(requests: Sequence[tuple[str, str]], client: Limit, user: Limit) -> BucketPlan:
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
    return BucketPlan(list(index), limits, pairs)


def slot_groups(keys: Sequence[str], bucket_of: dict[int, int]) -> list[list[int]]:
    """Requests (their numbers, in order) grouped by the Redis Cluster slot of
    their bucket. ``bucket_of``: request number -> index into ``keys``."""
    from redis.crc import key_slot

    groups: dict[int, list[int]] = {}
    for n, i in bucket_of.items():
        groups.setdefault(key_slot(keys[i].encode()), []).append(n)
    return list(groups.values())



def rate_decision(refused: int, wait: float) -> RateDecision:
    """A request's answer from the script's pair (refusing bucket's position, wait)."""
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
        cluster: bool = False,
    ) -> None:
        """``client`` is a ``redis.asyncio.Redis``, or a ``RedisCluster`` when
        ``cluster`` (decided once from settings: app.redis_client.is_cluster).
        Redis errors propagate: the caller decides to fail open."""
        self._client = client
        self.client_limit = Limit(client_rate, client_burst)
        self.user_limit = Limit(user_rate, user_burst)
        self._clock = clock
        self._sha: str | None = None
        self._cluster = cluster

    @property
    def client(self) -> Any:
        """The Redis client it talks to (the batch's one call needs every part on one)."""
        return self._client

    def plan(self, requests: Sequence[tuple[str, str]]) -> tuple[BucketPlan, float]:
        """``requests`` laid out for the token-bucket function, and the time
        they are decided at (the batch's one-call script, pipeline/redis_batch.py)."""
        return _plan(requests, self.client_limit, self.user_limit), float(self._clock())

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
        now = float(self._clock())
        if self._cluster:
            return await self._allow_by_slot(plan, now)
        reply = await self._call(plan, [list(pair) for pair in plan.requests], now)
        return [rate_decision(int(reply[2 * n]), float(reply[2 * n + 1])) for n in range(len(requests))]

    async def _call(self, plan: BucketPlan, requests: Sequence[Sequence[int]], now: float) -> list[Any]:
        """One script call for ``requests`` (each a list of indices into ``plan.keys``),
        passing only the keys they use."""
        return await self._client.evalsha(self._sha, *self._script_args(plan, requests, now))  # type: ignore[no-any-return]

    def _script_args(self, plan: BucketPlan, requests: Sequence[Sequence[int]], now: float) -> list[Any]:
        used = sorted({i for request in requests for i in request})
        local = {i: n for n, i in enumerate(used)}
        # repr(float) is the shortest exact form: Lua's tonumber gets the same double.
        args: list[str | int] = [repr(now), repr(COST)]
        for i in used:
            args += (repr(float(plan.limits[i].rate)), repr(float(plan.limits[i].burst)))
        for request in requests:
            args += (len(request), *(local[i] + 1 for i in request))
        keys = [plan.keys[i] for i in used]
        return [len(keys), *keys, *args]

    async def _allow_by_slot(self, plan: BucketPlan, now: float) -> list[RateDecision]:
        """Redis Cluster: users' buckets first, then clients' for the admitted (module docstring)."""
        out: list[RateDecision] = [ALLOWED] * len(plan.requests)
        for position, bucket in ((1, "user"), (0, "client")):
            todo = [n for n, d in enumerate(out) if d.allowed]
            groups = slot_groups(plan.keys, {n: plan.requests[n][position] for n in todo})
            # NOTE: one cluster pipeline (a connection per node), not one call per
            # slot in parallel: a batch of 48 users made ~16 concurrent calls per
            # node, past the pool's 8 connections, and the async cluster client
            # raises MaxConnectionsError instead of waiting. execute_command, as
            # the feature store: the cluster pipeline blocks the evalsha() method.
            pipe = self._client.pipeline()
            for group in groups:
                pipe.execute_command(
                    "EVALSHA", self._sha, *self._script_args(plan, [[plan.requests[n][position]] for n in group], now)
                )
            replies = await pipe.execute()
            for group, reply in zip(groups, replies):
                for k, n in enumerate(group):
                    if int(reply[2 * k]):
                        out[n] = RateDecision(False, bucket, float(reply[2 * k + 1]))  # type: ignore[arg-type]
        return out


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
            out.append(rate_decision(refused, wait))
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
