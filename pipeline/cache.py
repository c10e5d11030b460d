"""The decision cache: a resend gets the decision it got before.

A transaction is recognised by its ``transaction_id`` (a resend) or by its
content hash (the same payment under a new id, e.g. a client retry that
re-generated the id). A hit is answered from the cache, marked ``cached``, and
never reaches the feature store, so nothing is counted twice.

:class:`LocalFirstCache` is what a worker uses: the decisions of its open
transactions in memory (a resend in a later batch of the same transaction),
then its partitions' resend index (pipeline/resend_index.py), which holds
every decision those partitions committed within the TTL. Every transaction
the worker decides is at its home partition (app/placement.py: one found
elsewhere is re-routed first), so a miss in both is an answer: not decided
before. Redis is asked only when configured as a second level
(``FRAUD_DECISION_CACHE_REDIS``), and its failure is then a miss.

Without an index (:class:`RedisDecisionCache` as the only shared level, as
the component benchmarks build it), what Redis could not answer within
``wait_s`` comes back as :data:`UNCHECKED`, and the scorer then marks the
decision *provisional*, which never approves (pipeline/scorer.py): a resend
is never answered with a decision that could contradict the first one
because Redis was slow. With an index, only an index that cannot be read
(its disk failing) leaves a lookup unchecked.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any, Protocol

import orjson

from app.contract import Transaction
from app.redis_keys import decision_keys
from pipeline.feature_store import TTLCache
from pipeline.resend_index import ResendIndex

__all__ = [
    "UNCHECKED",
    "DecisionCache",
    "HoldingCache",
    "InMemoryDecisionCache",
    "LocalFirstCache",
    "RedisDecisionCache",
]

log = logging.getLogger(__name__)


class _Unchecked:
    """A lookup that could not be made (the shared cache did not answer in time)."""

    def __repr__(self) -> str:
        return "UNCHECKED"


UNCHECKED: Any = _Unchecked()


class DecisionCache(Protocol):
    async def get_many(self, txs: Sequence[Transaction]) -> list[dict[str, Any] | None]:
        """Per transaction: its earlier decision, None (none), or :data:`UNCHECKED`; may raise."""
        ...

    async def put_many(self, items: Sequence[tuple[Transaction, bytes]]) -> None:
        """Store each transaction's decision, given as the record's JSON bytes as sent."""
        ...


class HoldingCache(DecisionCache, Protocol):
    """A worker's decision cache: besides lookups and stores, it holds the
    decisions of a transaction still open, for a resend in a later batch of
    it, and lets go of them if it aborts (:class:`LocalFirstCache`)."""

    def hold(self, items: Sequence[tuple[Transaction, bytes]]) -> None:
        """Keep these decisions locally, not yet in the shared cache: they were
        sent in a transaction not yet committed."""
        ...

    def release(self, items: Sequence[tuple[Transaction, bytes]]) -> None:
        """Forget held decisions whose transaction did not commit."""
        ...

    def committed(self, items: Sequence[tuple[Transaction, bytes]]) -> None:
        """Decisions whose transaction committed, as the resend index keeps
        them (pipeline/resend_index.py): into the index, if there is one."""
        ...


#: Store a batch's decisions in one command: SET key value EX ttl NX for each
#: KEYS[i], a decision's two keys (2j - 1, 2j) with its value ARGV[j + 1]
#: (ARGV[1] is the TTL): each value packed and sent once. NOTE: one command instead of
#: two pipelined SETs per transaction, whose packing in redis-py was 9 % of a
#: saturated worker's event loop. One Redis server only: a Redis Cluster refuses
#: a script over several slots, so it keeps the pipeline.
PUT_MANY_SCRIPT = """
for i = 1, #KEYS do
  redis.call('SET', KEYS[i], ARGV[math.floor((i + 1) / 2) + 1], 'EX', ARGV[1], 'NX')
end
return #KEYS
"""


class RedisDecisionCache:
    def __init__(self, client: Any, ttl_s: int, *, cluster: bool = False) -> None:
        """``cluster``: ``client`` is a ``RedisCluster`` (decided once from
        settings: app.redis_client.is_cluster), where one script may not span
        slots, so a batch's decisions go in a pipeline."""
        self._client = client
        self.ttl_s = ttl_s
        self._cluster = cluster
        self._put_many = client.register_script(PUT_MANY_SCRIPT)

    @property
    def client(self) -> Any:
        """The Redis client it talks to (the batch's one call needs every part on one)."""
        return self._client

    async def get_many(self, txs: Sequence[Transaction]) -> list[dict[str, Any] | None]:
        if not txs:
            return []
        keys = [k for tx in txs for k in decision_keys(tx)]
        # A Redis Cluster refuses an MGET across slots: it has the split-by-slot
        # form (one pipelined MGET per slot); one server takes one MGET.
        mget = getattr(self._client, "mget_nonatomic", None) or self._client.mget
        values = await mget(keys)
        out: list[dict[str, Any] | None] = []
        for i in range(len(txs)):
            raw = values[2 * i] or values[2 * i + 1]
            out.append(orjson.loads(raw) if raw else None)
        return out

    async def put_many(self, items: Sequence[tuple[Transaction, bytes]]) -> None:
        if not items:
            return
        if not self._cluster:
            keys: list[str] = []
            args: list[Any] = [self.ttl_s]
            for tx, blob in items:
                keys += decision_keys(tx)
                args.append(blob)
            # NX: the first decision stands; a racing re-score cannot replace it.
            await self._put_many(keys=keys, args=args)
            return
        pipe = self._client.pipeline(transaction=False)
        for tx, blob in items:
            for key in decision_keys(tx):
                # NX: the first decision stands; a racing re-score cannot replace it.
                pipe.set(key, blob, ex=self.ttl_s, nx=True)
        await pipe.execute()


class InMemoryDecisionCache:
    def __init__(self, ttl_s: float = 3600) -> None:
        self._items = TTLCache(ttl_s)

    async def get_many(self, txs: Sequence[Transaction]) -> list[dict[str, Any] | None]:
        now = time.monotonic()
        out = []
        for tx in txs:
            by_id, by_hash = decision_keys(tx)
            hit, value = self._items.get(by_id, now)
            if not hit:
                hit, value = self._items.get(by_hash, now)
            out.append(orjson.loads(value) if hit else None)
        return out

    async def put_many(self, items: Sequence[tuple[Transaction, bytes]]) -> None:
        now = time.monotonic()
        for tx, blob in items:
            for key in decision_keys(tx):
                if not self._items.get(key, now)[0]:
                    self._items.put(key, blob, now)


class LocalFirstCache:
    """This worker's held decisions, its resend index, then (if any) a shared cache (Redis).

    ``get_many`` never raises: see the module's docstring for what is
    :data:`UNCHECKED`. ``put_many`` stores locally first, then in the shared
    cache (its failure is raised for the caller to log).
    """

    def __init__(
        self,
        shared: DecisionCache | None,
        *,
        index: ResendIndex | None = None,
        capacity: int = 40_000,
        ttl_s: float = 3600,
        wait_s: float = 0.15,
        retry_every_s: float = 0.01,
        clock: Any = time.monotonic,
    ) -> None:
        if shared is None and index is None:
            raise ValueError("a decision cache needs a resend index, a shared cache, or both")
        self.shared = shared
        self.index = index
        self.capacity = capacity
        self.ttl_s = ttl_s
        self.wait_s = wait_s
        self.retry_every_s = retry_every_s
        self._clock = clock
        # NOTE: decisions kept as the bytes sent, not as dicts: a dict is
        # several objects the garbage collector walks in every full
        # collection, and 40,000 of them made those collections pauses of
        # 60-180 ms on the scoring loop (docs/performance.md). Bytes are
        # never tracked; a hit (a resend) pays one parse.
        self._items: OrderedDict[str, tuple[float, bytes]] = OrderedDict()
        self.unchecked = 0
        """Lookups left unchecked so far (the worker's metrics read it)."""

    @property
    def authoritative(self) -> bool:
        """Whether a miss here is an answer (an index), so a shared cache failing is a miss too."""
        return self.index is not None

    def _get_held(self, tx: Transaction, now: float) -> dict[str, Any] | None:
        for key in decision_keys(tx):
            item = self._items.get(key)
            if item is not None and item[0] > now:
                decision: dict[str, Any] = orjson.loads(item[1])
                return decision
        return None

    def get_local_many(self, txs: Sequence[Transaction]) -> list[dict[str, Any] | None]:
        """This worker's own decisions only (held, then its index): the
        batch's one-call lookup (pipeline/redis_batch.py) asks Redis about the
        rest itself when there is a shared cache. :data:`UNCHECKED` where the
        index could not be read."""
        now = self._clock()
        out: list[Any] = [self._get_held(tx, now) for tx in txs]
        if self.index is None:
            return out
        misses = [i for i, hit in enumerate(out) if hit is None]
        if not misses:
            return out
        try:
            found = self.index.get_many([txs[i] for i in misses])
        except Exception as exc:  # a disk error must not cost the batch: its decisions are provisional
            log.error("the resend index could not be read (%r): %d lookups unchecked", exc, len(misses))
            found = [UNCHECKED] * len(misses)
            self.unchecked += len(misses)  # counted here: the one-call lookup asks only this
        for i, hit in zip(misses, found):
            out[i] = hit if hit is UNCHECKED or hit is None else orjson.loads(hit)
        return out

    async def get_many(self, txs: Sequence[Transaction]) -> list[dict[str, Any] | None]:
        out: list[Any] = self.get_local_many(txs)
        if self.shared is None:
            misses = []
        elif self.index is None:
            misses = [i for i, hit in enumerate(out) if hit is None]
        else:  # a second level: asked about the index's misses, and about what the index could not answer
            misses = [i for i, hit in enumerate(out) if hit is None or hit is UNCHECKED]
        if misses:
            remote = await self._shared_many([txs[i] for i in misses])
            for i, hit in zip(misses, remote):
                if hit is UNCHECKED and self.authoritative and out[i] is None:
                    hit = None  # the index said: never decided; Redis only could have said more
                self.unchecked += hit is UNCHECKED and out[i] is not UNCHECKED  # the index's are counted
                out[i] = hit
        return out

    async def _shared_many(self, txs: list[Transaction]) -> list[Any]:
        assert self.shared is not None
        deadline = self._clock() + self.wait_s
        while True:
            try:
                return await self.shared.get_many(txs)
            except Exception as exc:
                if self._clock() + self.retry_every_s >= deadline:
                    log.warning("decision cache unavailable for %.0f ms (%r): %d lookups unanswered",
                                self.wait_s * 1000, exc, len(txs))  # fmt: skip
                    return [UNCHECKED] * len(txs)
                await asyncio.sleep(self.retry_every_s)

    async def put_many(self, items: Sequence[tuple[Transaction, bytes]]) -> None:
        self.hold(items)
        if self.shared is not None:
            await self.shared.put_many(items)

    def committed(self, items: Sequence[tuple[Transaction, bytes]]) -> None:
        """Decisions whose transaction committed (index bytes: resend_index.indexed_value):
        into the index. Their changelog records committed with them."""
        if self.index is not None:
            self.index.add(items)

    def hold(self, items: Sequence[tuple[Transaction, bytes]]) -> None:
        """Store locally only: decisions sent in a transaction not yet committed,
        so that a resend in a later batch of it is answered with them."""
        expires = self._clock() + self.ttl_s
        for tx, blob in items:
            for key in decision_keys(tx):
                if key not in self._items:  # the first decision stands, as in Redis (NX)
                    self._items[key] = (expires, blob)
        while len(self._items) > self.capacity:
            self._items.popitem(last=False)

    def release(self, items: Sequence[tuple[Transaction, bytes]]) -> None:
        """Forget held decisions whose transaction did not commit: they never
        became visible, and their records will be decided again."""
        for tx, blob in items:
            for key in decision_keys(tx):
                held = self._items.get(key)
                if held is not None and held[1] is blob:
                    del self._items[key]
