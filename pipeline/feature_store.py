"""The online feature store: profiles, merchant risk and velocity state.

:class:`RedisFeatureStore` does one round trip per micro-batch: one script call
(a pipeline on a Redis Cluster) that reads each user's profile and each
merchant's risk (unless held in the short local cache) and updates-then-reads
each user's velocity sorted set. The sorted
set's member is the transaction id (with its amount), so a redelivered or
re-scored transaction is added once: velocity is idempotent under redelivery.

:class:`InMemoryFeatureStore` implements the same protocol over dicts, for
tests that exercise the agent without Redis.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from app.contract import Transaction
from app.errors import FeatureStoreError
from app.redis_keys import merchant_key, profile_key, velocity_key
from pipeline.feature_defs import VELOCITY_MAX_EVENTS
from pipeline.features import (
    DAY_S,
    FEATURE_SET_VERSION,
    MERCHANT_FIELDS,
    PROFILE_FIELDS,
    MerchantRisk,
    UserProfile,
    velocity_batch,
    velocity_from_events,
)

__all__ = [
    "Enrichment",
    "FeatureStore",
    "InMemoryFeatureStore",
    "RedisFeatureStore",
    "BATCH_ENRICH_FUNCTION",
    "BATCH_ENRICH_SCRIPT",
    "TTLCache",
    "velocity_args",
    "velocity_member",
]

#: Velocity events older than this (relative to the transaction) are pruned.
#: Two days: the 24 h window plus the oldest transaction validation accepts.
VELOCITY_RETENTION_S = 2 * DAY_S


#: A user's velocity set keeps at most this many newest events (twice what the
#: features read: an event that arrives late still finds its window's newest).
VELOCITY_KEEP_EVENTS = 2 * VELOCITY_MAX_EVENTS

#: Add the transaction to the user's velocity set, prune events past retention
#: and past VELOCITY_KEEP_EVENTS, refresh the TTL and return the newest
#: VELOCITY_MAX_EVENTS events of the 24 h window ending at the transaction,
#: with their times. One command instead of four per transaction:
#: on 2 cores the client-side cost of each pipelined command is what counts.
#: The features themselves are computed in Python by velocity_from_events, the
#: same function training uses.
VELOCITY_SCRIPT = f"""
redis.call('ZADD', KEYS[1], ARGV[2], ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', '(' .. ARGV[3])
redis.call('ZREMRANGEBYRANK', KEYS[1], 0, -{VELOCITY_KEEP_EVENTS + 1})
redis.call('EXPIRE', KEYS[1], ARGV[5])
return redis.call('ZRANGE', KEYS[1], ARGV[2], '(' .. ARGV[4], 'BYSCORE', 'REV', 'LIMIT', 0, {VELOCITY_MAX_EVENTS}, 'WITHSCORES')
"""


#: The whole batch in one command (one Redis server): for each transaction the
#: steps of VELOCITY_SCRIPT, then HMGET of the profiles and merchants not in
#: the local cache. KEYS: the n velocity keys. ARGV: n, p, retention (s), then
#: per transaction member, time, prune before, window start, then the p profile
#: keys and the merchant keys. Returns n velocity replies (ZRANGE's own: member,
#: time, ...), then each hash's values in PROFILE_FIELDS or MERCHANT_FIELDS
#: order (HMGET: nil for a field, or a hash, that is not there).
#: NOTE: the replies are returned as ZRANGE gives them, and the worker takes
#: each member's amount (after its last '|'): a string.match per event in Lua
#: cost Redis ~0.6 us an event, a third of the script at 30 events a user
#: (users near VELOCITY_MAX_EVENTS), against ~0.1 us or less in the worker
#: (bench/velocity.py, docs/performance.md).
#: NOTE: the feature keys are read, never written, so they are ARGV, not KEYS:
#: Redis checks a script's declared KEYS against the caller's ACL as writable
#: (it cannot tell how a script uses them), and the worker's ACL user may only
#: read features (SECURITY.md, *Redis users*); an undeclared key is checked per
#: command (HMGET: a read). One server only, as this script already is.
#: NOTE: each pipelined command costs the worker ~30-50 us of Python in
#: redis-py (packing, parsing, futures); a batch of 32 sent ~70 of them, the
#: biggest single cost of a saturated worker's event loop. A Redis Cluster
#: refuses a script across slots, so there the pipeline below is kept.
#: A Lua function of (KEYS, ARGV): the batch's one-call script
#: (pipeline/redis_batch.py) enriches its admitted transactions with it.
BATCH_ENRICH_FUNCTION = """
local function enrich(KEYS, ARGV)
local n, p, keep = tonumber(ARGV[1]), tonumber(ARGV[2]), ARGV[3]
local out = {}
for i = 1, n do
  local a = 3 + (i - 1) * 4
  redis.call('ZADD', KEYS[i], ARGV[a + 2], ARGV[a + 1])
  redis.call('ZREMRANGEBYSCORE', KEYS[i], '-inf', '(' .. ARGV[a + 3])
  redis.call('ZREMRANGEBYRANK', KEYS[i], 0, -KEEP_EVENTS_PLUS_ONE)
  redis.call('EXPIRE', KEYS[i], keep)
  -- member, time, member, time, ...: the worker reads each member's amount
  out[i] = redis.call('ZRANGE', KEYS[i], ARGV[a + 2], '(' .. ARGV[a + 4], 'BYSCORE', 'REV', 'LIMIT', 0, MAX_EVENTS, 'WITHSCORES')
end
local first = 3 + n * 4
local profile, merchant = {PROFILE_FIELDS}, {MERCHANT_FIELDS}
for j = first + 1, #ARGV do
  out[n + j - first] = redis.call('HMGET', ARGV[j], unpack(j <= first + p and profile or merchant))
end
return out
end
""".replace("KEEP_EVENTS_PLUS_ONE", str(VELOCITY_KEEP_EVENTS + 1)).replace("MAX_EVENTS", str(VELOCITY_MAX_EVENTS))
BATCH_ENRICH_FUNCTION = BATCH_ENRICH_FUNCTION.replace(
    "PROFILE_FIELDS", ", ".join(f"'{f}'" for f in PROFILE_FIELDS)
).replace("MERCHANT_FIELDS", ", ".join(f"'{f}'" for f in MERCHANT_FIELDS))
BATCH_ENRICH_SCRIPT = BATCH_ENRICH_FUNCTION + "return enrich(KEYS, ARGV)\n"


def velocity_args(tx: Transaction) -> list[str]:
    """A transaction's four arguments to BATCH_ENRICH_FUNCTION: member, time,
    prune before, window start (repr: the shortest exact form of each double)."""
    return [
        velocity_member(tx), repr(tx.timestamp),
        repr(tx.timestamp - VELOCITY_RETENTION_S), repr(tx.timestamp - DAY_S),
    ]  # fmt: skip


def velocity_member(tx: Transaction) -> str:
    """Sorted-set member of a transaction: its id makes re-adding a no-op."""
    return f"{tx.transaction_id}|{tx.amount_usd!r}"


def _amounts(members: Sequence[bytes | str]) -> np.ndarray:
    """Velocity members' amounts: each member's text after its last '|'
    (velocity_member). The client returns bytes (no decode_responses); str is read too."""
    sep: Any = "|" if members and isinstance(members[0], str) else b"|"
    return np.array([m.rpartition(sep)[2] for m in members], dtype=np.float64)


@dataclass(frozen=True, slots=True)
class Enrichment:
    """What the store knows about one transaction's user and merchant."""

    profile: UserProfile | None
    merchant: MerchantRisk | None
    velocity: tuple[float, ...]

    def feature_age_s(self, now: float) -> float | None:
        return None if self.profile is None else now - self.profile.as_of


class FeatureStore(Protocol):
    async def enrich(self, txs: Sequence[Transaction]) -> list[Enrichment]:
        """Profiles, merchant risk and velocity (after adding each transaction)."""
        ...

    async def close(self) -> None: ...


class TTLCache:
    """A small dict whose entries expire; bounded so it cannot grow forever."""

    def __init__(self, ttl_s: float, max_items: int = 100_000) -> None:
        self.ttl_s = ttl_s
        self.max_items = max_items
        self._items: dict[str, tuple[float, Any]] = {}

    def get(self, key: str, now: float) -> tuple[bool, Any]:
        hit = self._items.get(key)
        if hit is None or hit[0] < now:
            return False, None
        return True, hit[1]

    def put(self, key: str, value: Any, now: float) -> None:
        if len(self._items) >= self.max_items:
            # Drop the oldest insertions (dicts keep insertion order).
            for old in list(self._items)[: self.max_items // 10 or 1]:
                del self._items[old]
        self._items[key] = (now + self.ttl_s, value)

    def __len__(self) -> int:
        return len(self._items)


def _profile(values: Sequence[Any], user_id: str) -> UserProfile | None:
    """A user's profile from its hash's PROFILE_FIELDS (HMGET); None when the
    hash is not there. Raises FeatureStoreError on one of another feature set."""
    if all(v is None for v in values):
        return None
    _check_feature_set(values[-1], profile_key(user_id))
    return UserProfile.from_values(values)


def _merchant(values: Sequence[Any]) -> MerchantRisk | None:
    """A merchant's risk from its hash's MERCHANT_FIELDS (HMGET); None when it is not there."""
    return None if all(v is None for v in values) else MerchantRisk.from_values(values)


def _check_feature_set(version: bytes | str | None, key: str) -> None:
    if isinstance(version, bytes):
        version = version.decode()
    if version != FEATURE_SET_VERSION:
        raise FeatureStoreError(
            f"{key} has feature set {version!r}, this code computes {FEATURE_SET_VERSION!r}: "
            "re-run `fraud-pipeline materialize`"
        )


class RedisFeatureStore:
    """Redis-backed store; one pipeline per batch over a pooled connection."""

    def __init__(self, client: Any, *, local_cache_ttl_s: float = 30.0, cluster: bool = False) -> None:
        """``client`` is a ``redis.asyncio.Redis`` (its pool is shared with the
        decision cache), or a ``RedisCluster`` when ``cluster`` (decided once
        from settings: app.redis_client.is_cluster)."""
        self._client = client
        self._profiles = TTLCache(local_cache_ttl_s)
        self._merchants = TTLCache(local_cache_ttl_s)
        self._velocity_sha: str | None = None
        self._cluster = cluster
        # EVALSHA, falling back to loading the script when Redis lost it (restart, SCRIPT FLUSH).
        self._batch_script = client.register_script(BATCH_ENRICH_SCRIPT)

    @property
    def client(self) -> Any:
        """The Redis client it talks to (the batch's one call needs every part on one)."""
        return self._client

    async def enrich(self, txs: Sequence[Transaction]) -> list[Enrichment]:
        from redis.exceptions import NoScriptError

        try:
            try:
                return await self._enrich(txs)
            except NoScriptError:
                # Redis restarted (or SCRIPT FLUSH) and lost the script: load it, retry once.
                self._velocity_sha = None
                return await self._enrich(txs)
        except Exception as exc:
            raise FeatureStoreError(f"Redis pipeline failed: {exc!r}") from exc

    async def _enrich(self, txs: Sequence[Transaction]) -> list[Enrichment]:
        if not self._cluster:
            return await self._enrich_in_one_call(txs)
        if self._velocity_sha is None:
            self._velocity_sha = await self._client.script_load(VELOCITY_SCRIPT)
        now = time.monotonic()
        pipe = self._client.pipeline(transaction=False)
        plan: list[tuple[bool, bool]] = []
        for tx in txs:
            need_profile = not self._profiles.get(tx.user_id, now)[0]
            need_merchant = not self._merchants.get(tx.merchant_id, now)[0]
            if need_profile:
                pipe.hmget(profile_key(tx.user_id), PROFILE_FIELDS)
            if need_merchant:
                pipe.hmget(merchant_key(tx.merchant_id), MERCHANT_FIELDS)
            # One command per transaction for the velocity state (see VELOCITY_SCRIPT).
            # NOTE: execute_command, which is what evalsha() sends: redis-py's cluster
            # pipeline blocks the evalsha() method, not the command (one key, one slot).
            pipe.execute_command(
                "EVALSHA", self._velocity_sha, 1, velocity_key(tx.user_id),
                velocity_member(tx), repr(tx.timestamp), repr(tx.timestamp - VELOCITY_RETENTION_S),
                repr(tx.timestamp - DAY_S), int(VELOCITY_RETENTION_S),
            )
            plan.append((need_profile, need_merchant))
        replies = iter(await pipe.execute())
        out: list[Enrichment] = []
        for tx, (need_profile, need_merchant) in zip(txs, plan):
            if need_profile:
                self._profiles.put(tx.user_id, _profile(next(replies), tx.user_id), now)
            if need_merchant:
                self._merchants.put(tx.merchant_id, _merchant(next(replies)), now)
            out.append(
                Enrichment(
                    profile=self._profiles.get(tx.user_id, now)[1],
                    merchant=self._merchants.get(tx.merchant_id, now)[1],
                    velocity=_velocity(next(replies), tx),  # member, score, member, score, ...
                )
            )
        return out

    async def _enrich_in_one_call(self, txs: Sequence[Transaction]) -> list[Enrichment]:
        now = time.monotonic()
        profiles, merchants = self.uncached(txs, now)
        keys = [velocity_key(tx.user_id) for tx in txs]
        args: list[Any] = [len(txs), len(profiles), int(VELOCITY_RETENTION_S)]
        for tx in txs:
            args += velocity_args(tx)
        args += [profile_key(u) for u in profiles]  # read only: ARGV, not KEYS (see BATCH_ENRICH_SCRIPT)
        args += [merchant_key(m) for m in merchants]
        replies = await self._batch_script(keys=keys, args=args)
        return self.enrichments(txs, replies, profiles, merchants, now)

    def uncached(self, txs: Sequence[Transaction], now: float) -> tuple[list[str], list[str]]:
        """The users and merchants of ``txs`` not held locally at ``now``, each once, in order."""
        profiles = list(dict.fromkeys(tx.user_id for tx in txs if not self._profiles.get(tx.user_id, now)[0]))
        merchants = list(
            dict.fromkeys(tx.merchant_id for tx in txs if not self._merchants.get(tx.merchant_id, now)[0])
        )
        return profiles, merchants

    def enrichments(
        self, txs: Sequence[Transaction], replies: Sequence[Any], profiles: Sequence[str],
        merchants: Sequence[str], now: float,
    ) -> list[Enrichment]:  # fmt: skip
        """Read a BATCH_ENRICH_FUNCTION reply for ``txs``, which fetched the hashes of
        ``profiles`` and ``merchants`` (held locally from now on): the features of each.
        Raises FeatureStoreError on a profile of another feature set."""
        hashes = iter(replies[len(txs):])
        for user_id in profiles:
            self._profiles.put(user_id, _profile(next(hashes), user_id), now)
        for merchant_id in merchants:
            self._merchants.put(merchant_id, _merchant(next(hashes)), now)
        # Every transaction's events (member, time, ...) parsed and windowed at once.
        n = len(txs)
        events = replies[:n]
        lengths = np.fromiter((len(r) // 2 for r in events), dtype=np.int64, count=n)
        times = np.array([t for r in events for t in r[1::2]], dtype=np.float64)
        amounts = _amounts([m for r in events for m in r[0::2]])
        velocity = velocity_batch(times, amounts, lengths, np.array([tx.timestamp for tx in txs]))
        return [
            Enrichment(
                profile=self._profiles.get(tx.user_id, now)[1],
                merchant=self._merchants.get(tx.merchant_id, now)[1],
                velocity=tuple(row),
            )
            for tx, row in zip(txs, velocity.tolist())
        ]

    async def close(self) -> None:
        return None  # the client belongs to whoever built it


def _velocity(flat: Sequence[Any], tx: Transaction) -> tuple[float, ...]:
    """Velocity features from a ZRANGEBYSCORE WITHSCORES reply (member, score, ...)."""
    times = np.array(flat[1::2], dtype=np.float64)
    amounts = _amounts(flat[0::2])
    return velocity_from_events(times, amounts, tx.timestamp)


class InMemoryFeatureStore:
    """The same protocol over dicts: profiles and merchants set by the test."""

    def __init__(
        self,
        profiles: Mapping[str, UserProfile] | None = None,
        merchants: Mapping[str, MerchantRisk] | None = None,
    ) -> None:
        self.profiles = dict(profiles or {})
        self.merchants = dict(merchants or {})
        self.events: dict[str, dict[str, tuple[float, float]]] = {}
        self.fail: Exception | None = None

    async def enrich(self, txs: Sequence[Transaction]) -> list[Enrichment]:
        if self.fail is not None:
            raise FeatureStoreError(f"in-memory store set to fail: {self.fail!r}")
        out = []
        for tx in txs:
            events = self.events.setdefault(tx.user_id, {})
            events[tx.transaction_id] = (tx.timestamp, tx.amount_usd)
            window = [v for v in events.values() if tx.timestamp - DAY_S < v[0] <= tx.timestamp]
            times = np.array([t for t, _ in window], dtype=np.float64)
            amounts = np.array([a for _, a in window], dtype=np.float64)
            out.append(
                Enrichment(
                    profile=self.profiles.get(tx.user_id),
                    merchant=self.merchants.get(tx.merchant_id),
                    velocity=velocity_from_events(times, amounts, tx.timestamp),
                )
            )
        return out

    async def close(self) -> None:
        return None
