"""The resend index (pipeline/resend_index.py): what a partition committed, by id
and by content, for a TTL; restored from the decision records of ``decisions``."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import orjson
import pytest

from app.contract import Transaction
from pipeline.resend_index import IndexStore, MemoryStore, ResendIndex, RocksStore, indexed_value

TTL_S = 100.0


def tx(i: int, **over: object) -> Transaction:
    base = Transaction(f"t-{i}", f"u-{i % 3}", 10.0 + i, "m-1", 1_700_000_000.0 + i)
    return dataclasses.replace(base, **over)  # type: ignore[arg-type]


def decision(t: Transaction, action: str = "decline") -> bytes:
    return orjson.dumps({"transaction_id": t.transaction_id, "action": action})


@pytest.fixture(params=["memory", "rocksdb"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> IndexStore:
    if request.param == "memory":
        return MemoryStore()
    return RocksStore(tmp_path / "index", int(TTL_S))


def test_a_committed_decision_is_found_by_id_and_by_content(store: IndexStore) -> None:
    clock = [1000.0]
    index = ResendIndex(store, TTL_S, clock=lambda: clock[0])
    first = tx(1)
    index.add([(first, decision(first))])

    same_id = dataclasses.replace(first, amount=99.0)  # a resend whose content changed: by its id
    new_id = dataclasses.replace(first, transaction_id="t-retry")  # a retry under a new id: by content
    other = tx(2)
    found = index.get_many([first, same_id, new_id, other])
    assert [orjson.loads(f)["transaction_id"] if f else None for f in found] == ["t-1", "t-1", "t-1", None]


def test_an_entry_expires_after_the_ttl(store: IndexStore) -> None:
    clock = [1000.0]
    index = ResendIndex(store, TTL_S, clock=lambda: clock[0])
    index.add([(tx(1), decision(tx(1)))])
    clock[0] += TTL_S - 1
    assert index.get_many([tx(1)]) != [None]
    clock[0] += 2
    assert index.get_many([tx(1)]) == [None]


def record(t: Transaction, action: str = "decline", **extra: object) -> bytes:
    """A decision record as produced to ``decisions``: the per-delivery fields in it."""
    return orjson.dumps({"transaction_id": t.transaction_id, "user_id": t.user_id, "action": action,
                         "latency_ms": {"total": 3.0}, "correlation_id": "c", **extra})  # fmt: skip


def test_decision_records_restore_what_was_added(store: IndexStore) -> None:
    """Another worker's index, restored from its partition of ``decisions``:
    the same answers, expiring by the records' timestamps; only new decisions
    (their entry header) are entries; how far each partition was read is kept."""
    clock = [1000.0]
    txs = [tx(i) for i in range(5)]
    records = [(record(t), [ResendIndex.entry_header(t), ("decision-signature", b"s")], 990.0) for t in txs]
    old = tx(7)
    records.append((record(old), [ResendIndex.entry_header(old)], 1000.0 - TTL_S - 1))  # expired already
    # A cached answer and a rejection carry no entry header: not entries.
    cached, rejected = tx(8), tx(9)
    records += [(record(cached, cached=True), [("decision-signature", b"s")], 995.0), (record(rejected, "reject"), None, 995.0)]
    # Nothing a worker wrote: skipped, not a restore that fails on every assignment.
    records += [(b"\xff not json", [ResendIndex.entry_header(tx(10))], 995.0), (b"[1]", [ResendIndex.entry_header(tx(11))], 995.0)]

    index = ResendIndex(store, TTL_S, clock=lambda: clock[0])
    assert index.restored_to("dec", 0) is None
    assert index.restore(records, "dec", {0: 42}) == 5
    assert index.restored_to("dec", 0) == 42 and index.restored_to("dec", 1) is None
    assert index.restored_to("other-dec", 0) is None  # another topic's offsets count from 0 again
    assert [f is not None for f in index.get_many([*txs, old, cached, rejected])] == [True] * 5 + [False] * 3
    renamed = dataclasses.replace(txs[2], transaction_id="t-new")
    assert orjson.loads(index.get_many([renamed])[0] or b"null")["transaction_id"] == "t-2"
    # As the worker itself adds it: the decision less what differs per delivery.
    assert orjson.loads(index.get_many([txs[1]])[0] or b"null") == {"transaction_id": "t-1", "user_id": "u-1", "action": "decline"}
    clock[0] = 990.0 + TTL_S + 1
    assert index.get_many(txs) == [None] * 5


def test_the_rocksdb_store_keeps_entries_across_a_restart(tmp_path: Path) -> None:
    index = ResendIndex(RocksStore(tmp_path / "i", int(TTL_S)), TTL_S)
    index.add([(tx(1), decision(tx(1)))])
    index.restore([], "dec", {3: 17})
    index.close()
    again = ResendIndex(RocksStore(tmp_path / "i", int(TTL_S)), TTL_S)
    assert again.get_many([tx(1)]) != [None] and again.restored_to("dec", 3) == 17
    again.close()


def test_a_reopened_rocksdb_store_keeps_its_bloom_filter(tmp_path: Path) -> None:
    """A restarted worker opens its store again: misses (a first sight, most
    records) must still be answered by the filter, not by reading a block of
    every file. RocksDB writes the options it runs with to an OPTIONS file."""

    def filter_policy() -> list[str]:
        newest = max((tmp_path / "i").glob("OPTIONS-*"), key=lambda p: int(p.name.split("-")[1]))
        return [line.strip() for line in newest.read_text().splitlines() if line.strip().startswith("filter_policy=")]

    for _ in range(2):
        store = RocksStore(tmp_path / "i", int(TTL_S))
        store.write([(b"k", b"v")])
        assert filter_policy() == ["filter_policy=bloomfilter"]
        store.close()


def test_an_entry_leaves_out_what_differs_per_delivery() -> None:
    record = {"transaction_id": "t", "action": "approve", "latency_ms": {"total": 3.0}, "correlation_id": "c"}
    assert indexed_value(record) == {"transaction_id": "t", "action": "approve"}
