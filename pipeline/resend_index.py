"""The resend index: every decision a partition committed, kept with the partition.

A resend carries its user's key, so it lands on the same partition as the
payment it repeats (its *home*, app/placement.py). The worker that owns a
partition therefore needs nobody else to tell a resend from a first sight: it
needs every decision committed for that partition within
``FRAUD_DECISION_CACHE_TTL_S``, by transaction id and by content, and this
index holds them.

Its changelog is ``decisions`` itself, as Kafka Streams restores a table read
from a topic from that topic: a decision is produced on its transaction's own
partition (partition *p* of ``transactions`` is answered on partition *p* of
``decisions``), in the very Kafka transaction that carries the consumed
offsets, so what a partition of ``decisions`` holds is exactly what was
committed for that partition: a zombie's or an aborted transaction's
decisions never become visible. A new decision carries its content hash in a
header (``CONTENT_HASH``), the one part of its index entry the record leaves
out; cached answers, rejections and decisions of records away from their home
carry none and are not entries. Each decision is then kept twice:

- as its record in ``decisions`` (no extra record, no extra partition in the
  transaction);
- once that transaction committed, in this worker's local store (RocksDB
  through ``rocksdict``, on disk: an hour at 5,000 TPS does not fit a
  worker's memory).

A partition's new owner restores the partition's entries from ``decisions``
(``read_committed``, from the first record of the last
``FRAUD_DECISION_CACHE_TTL_S`` to its end) before it decides the partition's
first record (app/changelog.py). The local store only shortens that: it
remembers up to which offset each partition was restored, and entries are
facts (committed decisions, each key's first), so what it holds from an
earlier ownership is never wrong.

Redis is not asked whether a transaction was decided before: for a record
at its home partition a miss here is an answer (pipeline/cache.py).
"""

from __future__ import annotations

import struct
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, Protocol

import orjson

from app.changelog import Record
from app.contract import Transaction
from app.redis_keys import content_hash, decision_hash_key, decision_id_key, decision_keys

__all__ = ["CONTENT_HASH", "IndexStore", "MemoryStore", "ResendIndex", "RocksStore", "indexed_value"]

#: The header of a new decision that makes it an index entry: its
#: transaction's content hash (app/redis_keys.py, ``content_hash``).
CONTENT_HASH = "decision-content-hash"

#: What a decision's index entry leaves out: they differ per delivery and a
#: cached answer carries its own (pipeline/scorer.py, ``_emit_cached``).
PER_DELIVERY = ("latency_ms", "correlation_id")

_EXPIRES = struct.Struct(">d")
_CHECKPOINT = b"\x00restored-to/"


def indexed_value(record: dict[str, Any]) -> dict[str, Any]:
    """A decision record as the index keeps it."""
    # NOTE: a copy less the per-delivery fields, not a filtering comprehension:
    # 0.12 against 0.9 µs a decision, in the same order.
    kept = record.copy()
    for name in PER_DELIVERY:
        kept.pop(name, None)
    return kept


class IndexStore(Protocol):
    """Bytes to bytes, on disk or in memory."""

    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]: ...

    def write(self, puts: Sequence[tuple[bytes, bytes]]) -> None:
        """Store every pair, all or none."""
        ...

    def close(self) -> None: ...


class MemoryStore:
    """An :class:`IndexStore` in a dict: for tests and the benchmark's baseline."""

    def __init__(self) -> None:
        self.items: dict[bytes, bytes] = {}

    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        return [self.items.get(k) for k in keys]

    def write(self, puts: Sequence[tuple[bytes, bytes]]) -> None:
        self.items.update(puts)

    def close(self) -> None:
        pass


class RocksStore:
    """An :class:`IndexStore` in RocksDB (``rocksdict``), at ``path``.

    A bloom filter answers most misses (a first sight, the common case)
    without reading a block: in a batch read of a store opened again with
    ~490,000 keys, 0.5 µs a key against 7.9 µs without (most of it reading
    and decompressing blocks). RocksDB's own TTL drops entries older than ``ttl_s`` at
    compaction, which bounds the disk; an entry's expiry is also in its value
    (restored entries are written late), and reads check that one.
    """

    def __init__(self, path: Path, ttl_s: int) -> None:
        from rocksdict import AccessType, Rdict

        path.mkdir(parents=True, exist_ok=True)
        self.path = path
        # NOTE: the options go to the default column family too. Given only as
        # the database's options, they apply when the store is created; a
        # store opened again gets a default column family with RocksDB's
        # defaults, no filter (its OPTIONS file says filter_policy=nullptr),
        # and each miss then reads and decompresses a block of every file.
        options = _options()
        self._db = Rdict(str(path), options, column_families={"default": _options()},
                         access_type=AccessType.with_ttl(max(1, int(ttl_s))))  # fmt: skip

    def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        if not keys:
            return []
        found = self._db.get(list(keys))
        return list(found) if found is not None else [None] * len(keys)

    def write(self, puts: Sequence[tuple[bytes, bytes]]) -> None:
        from rocksdict import WriteBatch

        batch = WriteBatch(raw_mode=True)
        for key, value in puts:
            batch.put(key, value)
        self._db.write(batch)

    def close(self) -> None:
        self._db.close()


def _checkpoint(topic: str, partition: int) -> bytes:
    """Where the store keeps how far it restored a changelog partition: by the
    topic's name too, since one store outlives a rename of the changelog
    (another ``FRAUD_TOPIC_DECISIONS``), whose offsets count from 0 again."""
    return _CHECKPOINT + topic.encode() + b"/" + str(partition).encode()


def _options() -> Any:
    """The store's options: raw bytes, and a bloom filter on whole keys in
    the files and in the memtable, where the last minute of entries is."""
    from rocksdict import BlockBasedOptions, Options

    options = Options(raw_mode=True)
    table = BlockBasedOptions()
    table.set_bloom_filter(10, False)
    options.set_block_based_table_factory(table)
    options.set_memtable_prefix_bloom_ratio(0.02)
    options.set_memtable_whole_key_filtering(True)
    options.create_if_missing(True)
    return options


class ResendIndex:
    """The decisions of the partitions a worker owns, by both decision keys."""

    def __init__(self, store: IndexStore, ttl_s: float, *, clock: Callable[[], float] = time.time) -> None:
        """``clock``: wall-clock seconds (entries restored by another process
        expire by their record's timestamp)."""
        self.store = store
        self.ttl_s = ttl_s
        self._clock = clock

    # -- the scoring path ---------------------------------------------------------

    def get_many(self, txs: Sequence[Transaction]) -> list[bytes | None]:
        """Each transaction's decision (its index bytes), by id, else by content; None: none within the TTL."""
        if not txs:
            return []
        keys = [k.encode() for tx in txs for k in decision_keys(tx)]
        found = self.store.get_many(keys)
        now = self._clock()
        out: list[bytes | None] = []
        for i in range(len(txs)):
            out.append(_live(found[2 * i], now) or _live(found[2 * i + 1], now))
        return out

    def add(self, items: Sequence[tuple[Transaction, bytes]]) -> None:
        """Decisions whose transaction committed (their index bytes)."""
        if not items:
            return
        expires = _EXPIRES.pack(self._clock() + self.ttl_s)
        puts = []
        for tx, value in items:
            for key in decision_keys(tx):
                puts.append((key.encode(), expires + value))
        self.store.write(puts)

    # -- the changelog: decisions ----------------------------------------------------

    @staticmethod
    def entry_header(tx: Transaction) -> tuple[str, bytes]:
        """The header that makes a new decision of ``tx`` an index entry."""
        return CONTENT_HASH, content_hash(tx).encode()

    def restore(self, records: Iterable[Record], topic: str, restored_to: dict[int, int] | None = None) -> int:
        """Apply records of ``decisions``, and record up to which offset each
        partition of ``topic`` is restored, in one write. Only new decisions
        (those with a ``CONTENT_HASH`` header) are entries. Returns how many
        entries were live (the rest had expired)."""
        now = self._clock()
        puts: list[tuple[bytes, bytes]] = []
        live = 0
        for value, headers, ts in records:
            expires_at = ts + self.ttl_s
            if not value or not headers or expires_at <= now:
                continue
            digest = next((v for k, v in headers if k == CONTENT_HASH), None)
            if not digest:
                continue
            try:
                record = orjson.loads(value)
            except orjson.JSONDecodeError:
                continue  # not a worker's decision (only workers may write here): never an entry
            if not isinstance(record, dict):
                continue
            user, txid = record.get("user_id"), record.get("transaction_id")
            if not isinstance(user, str) or not isinstance(txid, str):
                continue
            stored = _EXPIRES.pack(expires_at) + orjson.dumps(indexed_value(record))
            by_id = decision_id_key(user, txid).encode()
            by_hash = decision_hash_key(user, digest.decode("ascii", "replace")).encode()
            puts += ((by_id, stored), (by_hash, stored))
            live += 1
        for partition, offset in (restored_to or {}).items():
            puts.append((_checkpoint(topic, partition), str(offset).encode()))
        if puts:
            self.store.write(puts)
        return live

    def restored_to(self, topic: str, partition: int) -> int | None:
        """The offset this store restored ``topic``'s ``partition`` up to, if ever."""
        (raw,) = self.store.get_many([_checkpoint(topic, partition)])
        return int(raw) if raw is not None else None

    def close(self) -> None:
        self.store.close()


def _live(stored: bytes | None, now: float) -> bytes | None:
    if stored is None or _EXPIRES.unpack_from(stored)[0] <= now:
        return None
    return stored[_EXPIRES.size :]
