"""The batch's decision cache, admission and enrichment in one Redis call.

On one Redis server the scorer asks Redis once per micro-batch, not three or
four times (cache, replay guard, rate limiter, feature store)::

    requests ─ held decisions, resend index ─────┬─ hit ──────────────────► cached
                                                 └─ one script call:
        1. decision cache, by id and content    ─┬─ hit ─────────────────────► cached
           (only with FRAUD_DECISION_CACHE_REDIS)│
                                              ├─ 2nd copy in the batch ───► follows its first
        2. admission of first copies: replay  │
           guard (signed) + token buckets ────┼─ refused ─────────────────► rejected
        3. enrichment of the admitted ────────┴─ velocity, profile, merchant ─► scored

The script itself applies that order, so a resend is never charged a token or
a velocity event and a refused transaction is never enriched, as when the
steps are separate calls. It is composed of the very Lua functions those calls
run (:data:`~pipeline.auth.REPLAY_CHECK_FUNCTION`,
:data:`~pipeline.ratelimit.TOKEN_BUCKET_FUNCTION`,
:data:`~pipeline.feature_store.BATCH_ENRICH_FUNCTION`): each rule is written
once, and both paths leave Redis in the same state
(tests/integration/test_redis_batch.py).

Why: redis-py's cost per command (a socket write, parsing the reply, asyncio
futures) was ~11 % of a worker's CPU, and a batch's fixed costs dominate at
low rates (docs/performance.md).

It answers the scorer's :class:`~pipeline.lookup.BatchLookup` protocol, as
the separate calls do (:class:`~pipeline.lookup.SeparateCalls`). A Redis
Cluster refuses a script over keys of several slots, and the in-memory fakes
have no Redis: :meth:`RedisBatchLookup.build` then returns None and the
scorer makes the separate calls. It also falls back to them for a batch
whose call fails (:class:`~app.errors.BatchLookupError`,
:class:`~pipeline.lookup.OneCallFirst`), so a Redis outage decides exactly
as before: provisional, fail open, degraded.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

import orjson

from app.errors import BatchLookupError, FeatureStoreError
from app.redis_client import is_cluster_client
from app.redis_keys import content_hash, decision_keys, merchant_key, profile_key, signature_key, velocity_key
from pipeline.admission import Admission, verdicts_of
from pipeline.auth import REPLAY_CHECK_FUNCTION, RedisReplayGuard, first_delivery, replay_ttl_s
from pipeline.cache import UNCHECKED, LocalFirstCache, RedisDecisionCache
from pipeline.feature_store import BATCH_ENRICH_FUNCTION, VELOCITY_RETENTION_S, RedisFeatureStore, velocity_args
from pipeline.lookup import BatchAnswer, Request
from pipeline.ratelimit import COST, TOKEN_BUCKET_FUNCTION, RedisRateLimiter, rate_decision
from pipeline.timing import Laps
from pipeline.validate import Rejection

__all__ = ["BATCH_SCRIPT", "RedisBatchLookup"]

#: ARGV header: m (transactions), b (buckets), s (signatures), p (profiles),
#: q (merchants), now (the limiter's clock), cost, replay TTL, velocity
#: retention, whether to look in the decision cache (1: Redis is a second
#: level under the resend index; 0: the index alone answers, pipeline/cache.py).
HEADER = 10
#: After the header and the b buckets' (rate, burst), one ARGV holds every
#: transaction's row, as a JSON array of arrays (cjson in the script); each
#: row: 1-2 its in-batch identities (transaction id and content hash, as small
#: integers), 3-4 its client and user bucket (0: no limiter), 5 its signature
#: (0: none or no replay guard), 6 its delivery, 7-10 its velocity arguments
#: (velocity_args, strings), 11-12 its profile and merchant (0: held locally).
#: NOTE: one argument, not twelve per transaction: redis-py encodes each
#: argument on its own, 12-14 % of the loop's time at 64 records under cProfile
#: (docs/performance.md).

#: KEYS: each transaction's two decision keys (2m; none when the script does
#: not look in the decision cache), then its velocity key (m), the b buckets,
#: the s signatures. Profiles and merchants are read only, so
#: they are ARGV after the transactions (see BATCH_ENRICH_SCRIPT). Returns
#: {per transaction: its cached decision, the 1-based number of the earlier
#: copy it follows, or 0 (a first copy); the replay guard's reply for the
#: signed first copies; the token buckets' reply for the first copies; the
#: admitted (enriched) transactions' numbers; the profiles and merchants read
#: (numbers); the enrichment's reply}.
BATCH_SCRIPT = (
    REPLAY_CHECK_FUNCTION
    + TOKEN_BUCKET_FUNCTION
    + BATCH_ENRICH_FUNCTION
    + """
local m, b, p = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[4])
local T = HEADER + 2 * b
local rows = cjson.decode(ARGV[T + 1])
local function at(i, k) return rows[i][k] end
local cached = ARGV[10] == '1'
-- where the velocity keys start: after the decision keys, if any
local V = cached and 2 * m or 0

-- 1. the decision cache: a hit is answered; a second copy follows its first (lookup.in_batch_copies)
local status, leaders, first = {}, {}, {}
for i = 1, m do
  local hit = false
  if cached then
    local found = redis.call('MGET', KEYS[2 * i - 1], KEYS[2 * i])
    hit = found[1] or found[2]
  end
  if hit then
    status[i] = hit
  else
    local leader = first[at(i, 1)] or first[at(i, 2)]
    if leader then
      status[i] = leader
    else
      status[i] = 0
      leaders[#leaders + 1] = i
      first[at(i, 1)], first[at(i, 2)] = i, i
    end
  end
end

-- 2. admission of the first copies, both checks on each (Admission.admit)
local signed, sig_keys, sig_args = {}, {}, {ARGV[8]}
for _, i in ipairs(leaders) do
  local sig = tonumber(at(i, 5))
  if sig > 0 then
    signed[#signed + 1] = i
    sig_keys[#sig_keys + 1] = KEYS[V + m + b + sig]
    sig_args[#sig_args + 1] = at(i, 6)
  end
end
local firsts = {}
if #signed > 0 then firsts = replay_check(sig_keys, sig_args) end
local rates = {}
if b > 0 and #leaders > 0 then
  -- only the buckets these draw on, in index order (RedisRateLimiter._script_args)
  local used, seen = {}, {}
  for _, i in ipairs(leaders) do
    for k = 3, 4 do
      local x = tonumber(at(i, k))
      if not seen[x] then seen[x] = true; used[#used + 1] = x end
    end
  end
  table.sort(used)
  local keys, args, pos = {}, {ARGV[6], ARGV[7]}, {}
  for n, x in ipairs(used) do
    pos[x] = n
    keys[n] = KEYS[V + m + x]
    args[#args + 1] = ARGV[HEADER - 1 + 2 * x]
    args[#args + 1] = ARGV[HEADER + 2 * x]
  end
  for _, i in ipairs(leaders) do
    args[#args + 1] = 2
    args[#args + 1] = pos[tonumber(at(i, 3))]
    args[#args + 1] = pos[tonumber(at(i, 4))]
  end
  rates = token_buckets(keys, args)
end
local refused = {}
for n, i in ipairs(signed) do
  if firsts[n] ~= '' and firsts[n] ~= at(i, 6) then refused[i] = true end
end
if #rates > 0 then
  for n, i in ipairs(leaders) do
    if rates[2 * n - 1] ~= 0 then refused[i] = true end
  end
end

-- 3. enrichment of the admitted
local admitted, profiles, merchants, seen_p, seen_m = {}, {}, {}, {}, {}
local keys, args = {}, {0, 0, ARGV[9]}
for _, i in ipairs(leaders) do
  if not refused[i] then
    admitted[#admitted + 1] = i
    keys[#keys + 1] = KEYS[V + i]
    for k = 7, 10 do args[#args + 1] = at(i, k) end
    local x, y = tonumber(at(i, 11)), tonumber(at(i, 12))
    if x > 0 and not seen_p[x] then seen_p[x] = true; profiles[#profiles + 1] = x end
    if y > 0 and not seen_m[y] then seen_m[y] = true; merchants[#merchants + 1] = y end
  end
end
local features = {}
if #admitted > 0 then
  args[1], args[2] = #admitted, #profiles
  local tail = T + 1
  for _, x in ipairs(profiles) do args[#args + 1] = ARGV[tail + x] end
  for _, y in ipairs(merchants) do args[#args + 1] = ARGV[tail + p + y] end
  features = enrich(keys, args)
end
return {status, firsts, rates, admitted, profiles, merchants, features}
""".replace("HEADER", str(HEADER))
)


class _OnRedis(Protocol):
    """A part the one call stands in for: Redis-backed, on this client."""

    @property
    def client(self) -> Any: ...


@dataclass(slots=True)
class _Call:
    """One call's KEYS and ARGV, and what reading its reply needs."""

    keys: list[str]
    args: list[Any]
    profiles: list[str]
    merchants: list[str]
    signed: list[int]
    """The transactions (0-based) whose signature the script checks if they lead."""
    now: float
    """Monotonic time the local profile cache was consulted at."""


class RedisBatchLookup:
    """The batch's cache lookup, admission and enrichment as one script call."""

    def __init__(
        self,
        client: Any,
        cache: LocalFirstCache | RedisDecisionCache,
        store: RedisFeatureStore,
        admission: Admission | None = None,
    ) -> None:
        """``client``: the one Redis server that ``cache``, ``store`` and
        ``admission``'s guard and limiter use (see :meth:`build`)."""
        self._local = cache if isinstance(cache, LocalFirstCache) else None
        #: Whether the script looks in Redis's decision cache (not when a resend index alone answers).
        self._check_cache = self._local is None or self._local.shared is not None
        self._store = store
        self._replay = admission is not None and admission.replay is not None
        self._replay_ttl_s = replay_ttl_s(admission.window_s) if admission is not None else 0
        limiter = admission.limiter if admission is not None else None
        if limiter is not None and not isinstance(limiter, RedisRateLimiter):
            raise TypeError(f"the one-call lookup takes a RedisRateLimiter, not {type(limiter).__name__}")
        self._limiter = limiter
        # EVALSHA, loading the script again when Redis lost it (NOSCRIPT: restart, SCRIPT FLUSH).
        self._script = client.register_script(BATCH_SCRIPT)

    @classmethod
    def build(cls, client: Any, cache: Any, store: Any, admission: Admission | None = None) -> RedisBatchLookup | None:
        """The lookup when every part is Redis on ``client`` and it is one server;
        else None (a Redis Cluster, in-memory parts): the separate calls."""
        shared = cache.shared if isinstance(cache, LocalFirstCache) else cache
        parts: list[tuple[object, type[_OnRedis]]] = [(store, RedisFeatureStore)]
        if shared is not None:
            parts.append((shared, RedisDecisionCache))
        if admission is not None:
            if admission.replay is not None:
                parts.append((admission.replay, RedisReplayGuard))
            if admission.limiter is not None:
                parts.append((admission.limiter, RedisRateLimiter))
        on_redis = [part for part, kind in parts if isinstance(part, kind)]
        if is_cluster_client(client) or len(on_redis) < len(parts):
            return None
        if any(part.client is not client for part in on_redis):
            return None  # a part on another server: its keys are not where the script runs
        return cls(client, cache, store, admission)

    async def look_up(self, requests: Sequence[Request], laps: Laps) -> BatchAnswer:
        """Each request's cached decision, first copy, admission verdict and
        features. Raises BatchLookupError when the call fails (nothing of it
        may be assumed done or not done). Laps nothing: the scorer charges
        the whole lookup to ``cache``, the first stage it serves."""
        hits: list[Any] = (
            self._local.get_local_many([r.tx for r in requests]) if self._local else [None] * len(requests)
        )
        # What the index could not answer (its disk failing): asked of Redis if it is a
        # second level, and provisional unless Redis answers.
        unread = [i for i, hit in enumerate(hits) if hit is UNCHECKED]
        for i in unread:
            hits[i] = None
        remote = [i for i, hit in enumerate(hits) if hit is None]
        if not remote:
            return BatchAnswer(hits, [None] * len(requests), [None] * len(requests), [])
        call = self._call([requests[i] for i in remote])
        try:
            reply = await self._script(keys=call.keys, args=call.args)
        except Exception as exc:
            raise BatchLookupError(len(remote), f"Redis call failed: {exc!r}") from exc
        answer = self._read(hits, requests, remote, call, reply)
        unchecked = frozenset(requests[i].tx.transaction_id for i in unread if answer.hits[i] is None)
        return replace(answer, unchecked=unchecked) if unchecked else answer

    def _call(self, requests: Sequence[Request]) -> _Call:
        """KEYS and ARGV for ``requests`` (see BATCH_SCRIPT)."""
        txs = [r.tx for r in requests]
        now = time.monotonic()
        profiles, merchants = self._store.uncached(txs, now)
        profile_no = {u: n for n, u in enumerate(profiles, start=1)}
        merchant_no = {m: n for n, m in enumerate(merchants, start=1)}
        if self._limiter is not None:
            plan, clock = self._limiter.plan([(r.auth.client_id, r.tx.user_id) for r in requests])
            buckets, limits, pairs = plan.keys, plan.limits, [(c + 1, u + 1) for c, u in plan.requests]
        else:
            buckets, limits, pairs, clock = [], [], [(0, 0)] * len(requests), 0.0
        signed = [i for i, r in enumerate(requests) if self._replay and r.auth.signature]
        signature_no = {i: n for n, i in enumerate(signed, start=1)}
        # NOTE: the decision keys only when the script reads them: they are 256 of
        # a 128-record batch's ~1,100 keys and arguments, each encoded by redis-py
        # and parsed by Redis.
        keys = [k for tx in txs for k in decision_keys(tx)] if self._check_cache else []
        keys += [velocity_key(tx.user_id) for tx in txs]
        keys += buckets
        keys += [signature_key(requests[i].auth.signature or "") for i in signed]
        args: list[Any] = [
            len(requests), len(buckets), len(signed), len(profiles), len(merchants),
            repr(clock), repr(COST), self._replay_ttl_s, int(VELOCITY_RETENTION_S), int(self._check_cache),
        ]  # fmt: skip
        for limit in limits:
            args += (repr(float(limit.rate)), repr(float(limit.burst)))
        # In-batch identities as small numbers, one space for both kinds, as
        # Scorer._answer_from_cache's first_in_batch.
        identity: dict[str, int] = {}
        rows = []
        for i, (r, (client_bucket, user_bucket)) in enumerate(zip(requests, pairs)):
            tx = r.tx
            rows.append((
                identity.setdefault(tx.transaction_id, len(identity) + 1),
                identity.setdefault(content_hash(tx), len(identity) + 1),
                client_bucket, user_bucket, signature_no.get(i, 0), r.delivery,
                *velocity_args(tx), profile_no.get(tx.user_id, 0), merchant_no.get(tx.merchant_id, 0),
            ))  # fmt: skip
        args.append(orjson.dumps(rows))
        args += [profile_key(u) for u in profiles]
        args += [merchant_key(m) for m in merchants]
        return _Call(keys, args, profiles, merchants, signed, now)

    def _read(
        self,
        hits: list[dict[str, Any] | None],
        requests: Sequence[Request],
        remote: list[int],
        call: _Call,
        reply: list[Any],
    ) -> BatchAnswer:
        """The answer: ``hits`` (this worker's own) completed for the ``remote``
        requests from the script's reply, with their copies, verdicts and features."""
        status, firsts, rates, admitted, profiles, merchants, features = reply
        follows: list[int | None] = [None] * len(requests)
        verdicts: list[Rejection | None] = [None] * len(requests)
        leaders: list[int] = []  # 0-based, within remote
        for n, (i, st) in enumerate(zip(remote, status)):
            if isinstance(st, bytes):
                hits[i] = orjson.loads(st)
            elif st:
                follows[i] = remote[st - 1]
            else:
                leaders.append(n)
        # Verdicts as Admission.admit gives them, from the same answers the script admitted by.
        items = [
            (requests[remote[n]].auth, requests[remote[n]].delivery, requests[remote[n]].tx.transaction_id,
             requests[remote[n]].tx.user_id)
            for n in leaders
        ]  # fmt: skip
        signed_at = set(call.signed)
        signed = [k for k, n in enumerate(leaders) if n in signed_at]
        first = [first_delivery(f, items[k][1]) for k, f in zip(signed, firsts)]
        decisions = [rate_decision(int(rates[2 * k]), float(rates[2 * k + 1])) for k in range(len(rates) // 2)]
        admitted_here = []
        for n, verdict in zip(leaders, verdicts_of(items, signed, first, decisions)):
            verdicts[remote[n]] = verdict
            if verdict is None:
                admitted_here.append(n + 1)
        if admitted_here != list(admitted):
            raise BatchLookupError(len(remote), f"the script admitted {admitted}, the verdicts {admitted_here}")
        txs = [requests[remote[n - 1]].tx for n in admitted]
        try:
            enrichments = self._store.enrichments(
                txs, features, [call.profiles[x - 1] for x in profiles], [call.merchants[y - 1] for y in merchants],
                call.now,
            )  # fmt: skip
        except Exception as exc:  # as RedisFeatureStore.enrich: the batch degrades, nothing else
            error = exc if isinstance(exc, FeatureStoreError) else FeatureStoreError(repr(exc))
            return BatchAnswer(hits, follows, verdicts, None, error)
        return BatchAnswer(hits, follows, verdicts, enrichments)
