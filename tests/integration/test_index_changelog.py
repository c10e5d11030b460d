"""The resend index's changelog, ``decisions``, on the real broker
(app/changelog.py): a new owner restores exactly what committed, from the
last TTL of decisions only, waits for a transaction still open when it
began, and a restarted worker reads only what was written since."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
import uuid
from pathlib import Path

import orjson
import pytest
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from confluent_kafka import Producer

from app.changelog import ChangelogRestore
from app.contract import Transaction
from pipeline.resend_index import ResendIndex, RocksStore

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

TTL_S = 3600


async def _topic(bootstrap: str, name: str, partitions: int = 2) -> None:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(name, partitions, 1)])
    finally:
        await admin.close()


def _tx(i: int) -> Transaction:
    return Transaction(f"t-{uuid.uuid4().hex[:8]}-{i}", f"u-{i % 7:03d}", 10.0 + i, "m-000001", time.time())


def _decision(tx: Transaction, action: str = "decline") -> bytes:
    return orjson.dumps({"transaction_id": tx.transaction_id, "user_id": tx.user_id, "action": action,
                         "fraud_score": 0.9, "latency_ms": {"total": 4.0}})  # fmt: skip


def _producer(bootstrap: str, tid: str) -> Producer:
    producer = Producer({"bootstrap.servers": bootstrap, "transactional.id": tid, "enable.idempotence": True,
                         "acks": "all", "transaction.timeout.ms": 10_000})  # fmt: skip
    producer.init_transactions(10.0)
    return producer


def _write(producer: Producer, topic: str, partition: int, txs: list[Transaction], at: float | None = None) -> None:
    """New decisions of ``txs`` as a worker produces them (``at``: their timestamp, else now)."""
    for tx in txs:
        producer.produce(topic, _decision(tx), tx.transaction_id.encode(), partition,
                         headers=[ResendIndex.entry_header(tx)], timestamp=int((at or time.time()) * 1000))  # fmt: skip


def _restorer(bootstrap: str, topic: str, path: Path, index_ttl_s: float = TTL_S) -> ChangelogRestore:
    index = ResendIndex(RocksStore(path, int(index_ttl_s)), index_ttl_s)
    return ChangelogRestore(topic, index, {"bootstrap.servers": bootstrap}, group_id=f"restore-{uuid.uuid4().hex[:6]}",
                            history_s=TTL_S)  # fmt: skip


def _found(index: ResendIndex, txs: list[Transaction]) -> list[bool]:
    return [hit is not None for hit in index.get_many(txs)]


def test_a_new_owner_restores_what_committed_and_nothing_else(kafka_bootstrap: str, tmp_path: Path) -> None:
    topic = f"idx-{uuid.uuid4().hex[:8]}"
    asyncio.run(_topic(kafka_bootstrap, topic))
    producer = _producer(kafka_bootstrap, f"{topic}-w1")
    committed, aborted, elsewhere = [_tx(i) for i in range(5)], [_tx(i) for i in range(5, 8)], [_tx(9)]
    producer.begin_transaction()
    _write(producer, topic, 0, committed)
    _write(producer, topic, 1, elsewhere)
    producer.commit_transaction(10.0)
    producer.begin_transaction()
    _write(producer, topic, 0, aborted)  # a zombie's, or a transaction that failed
    producer.abort_transaction(10.0)

    restore = _restorer(kafka_bootstrap, topic, tmp_path / "store")
    restore({0})
    index = restore.index
    assert _found(index, committed) == [True] * 5
    assert _found(index, aborted) == [False] * 3
    assert _found(index, elsewhere) == [False]  # partition 1 was not asked for
    # By content too: the same payment under a new id finds the first decision.
    again = dataclasses.replace(committed[0], transaction_id="a-new-id")
    [hit] = index.get_many([again])
    assert hit is not None and orjson.loads(hit)["transaction_id"] == committed[0].transaction_id
    index.close()


def test_a_restore_reads_only_the_last_ttl_of_decisions(kafka_bootstrap: str, tmp_path: Path) -> None:
    """``decisions`` keeps a week: a new owner starts at the first decision of
    the last TTL, not at the partition's start. Shown with an index whose own
    TTL is longer, which would keep the older decisions had they been read."""
    topic = f"idx-{uuid.uuid4().hex[:8]}"
    asyncio.run(_topic(kafka_bootstrap, topic))
    producer = _producer(kafka_bootstrap, f"{topic}-w1")
    older, recent = [_tx(i) for i in range(4)], [_tx(i) for i in range(4, 7)]
    producer.begin_transaction()
    _write(producer, topic, 0, older, at=time.time() - 2 * TTL_S)
    _write(producer, topic, 0, recent)
    producer.commit_transaction(10.0)

    counts: list[int] = []
    restore = _restorer(kafka_bootstrap, topic, tmp_path / "store", index_ttl_s=10 * TTL_S)
    restore.on_restored = lambda _p, entries, _took: counts.append(entries)
    restore({0})
    assert counts == [3]
    assert _found(restore.index, older + recent) == [False] * 4 + [True] * 3
    restore.index.close()


def _committed_then_open(
    bootstrap: str, topic: str, committed: list[Transaction], open_: list[Transaction]
) -> Producer:
    """``committed`` written in a committed transaction, then ``open_`` in one
    left open on the broker (the returned producer ends it)."""
    producer = _producer(bootstrap, f"{topic}-w1")
    producer.begin_transaction()
    _write(producer, topic, 0, committed)
    producer.commit_transaction(10.0)
    producer.begin_transaction()
    _write(producer, topic, 0, open_)
    producer.flush(10.0)  # on the broker, not yet ended
    return producer


def test_a_restore_waits_for_a_transaction_open_when_it_began(kafka_bootstrap: str, tmp_path: Path) -> None:
    """The previous owner's commit lands a moment after the new owner began
    restoring: the restore ends after it, with its entries."""
    topic = f"idx-{uuid.uuid4().hex[:8]}"
    asyncio.run(_topic(kafka_bootstrap, topic))
    before, late = [_tx(i) for i in range(3)], [_tx(i) for i in range(3, 6)]
    producer = _committed_then_open(kafka_bootstrap, topic, before, late)

    restore = _restorer(kafka_bootstrap, topic, tmp_path / "store")
    finished: list[float] = []
    worker = threading.Thread(target=lambda: (restore({0}), finished.append(time.monotonic())))
    worker.start()
    time.sleep(1.5)
    assert not finished, "the restore ended before the open transaction did"
    committed_at = time.monotonic()
    producer.commit_transaction(10.0)
    worker.join(30.0)
    assert finished and finished[0] >= committed_at
    assert _found(restore.index, before + late) == [True] * 6
    restore.index.close()


def test_a_transaction_open_past_any_live_ones_life_ends_the_restore_where_it_holds_the_partition(
    kafka_bootstrap: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A transaction the broker never ends (its markers never written, as after
    the only broker was killed and restarted) would hold the restore forever:
    past the bound it ends at the last stable offset, with what committed before
    it, says so, and restores the rest once the transaction ends."""
    topic = f"idx-{uuid.uuid4().hex[:8]}"
    asyncio.run(_topic(kafka_bootstrap, topic))
    before, held = [_tx(i) for i in range(3)], [_tx(i) for i in range(3, 6)]
    producer = _committed_then_open(kafka_bootstrap, topic, before, held)  # never ended while the restore waits

    restore = _restorer(kafka_bootstrap, topic, tmp_path / "store")
    restore.hanging_after_s = 2.0  # the product's bound is 30 s (app/changelog.py): the same rule, sooner
    started = time.monotonic()
    with caplog.at_level(logging.ERROR, logger="app.changelog"):
        restore({0})
    took = time.monotonic() - started
    assert 2.0 <= took < 8.0
    assert _found(restore.index, before) == [True] * 3
    assert _found(restore.index, held) == [False] * 3
    assert any("hanging transaction" in r.getMessage() and "offset 4" in r.getMessage() for r in caplog.records)

    producer.commit_transaction(10.0)  # ended at last (an operator's abort would end it too)
    restore({0})  # from where the last restore stopped
    assert _found(restore.index, before + held) == [True] * 6
    restore.index.close()


def test_a_restarted_worker_reads_only_what_was_written_since(kafka_bootstrap: str, tmp_path: Path) -> None:
    """Its store remembers how far each partition was restored; entries
    written after that (by another owner meanwhile) are read, the rest not."""
    topic = f"idx-{uuid.uuid4().hex[:8]}"
    asyncio.run(_topic(kafka_bootstrap, topic))
    producer = _producer(kafka_bootstrap, f"{topic}-w1")
    first, second = [_tx(i) for i in range(20)], [_tx(i) for i in range(20, 23)]
    producer.begin_transaction()
    _write(producer, topic, 0, first)
    producer.commit_transaction(10.0)

    counts: list[int] = []
    restore = _restorer(kafka_bootstrap, topic, tmp_path / "store")
    restore.on_restored = lambda _p, entries, _took: counts.append(entries)
    restore({0})
    restore.index.close()

    producer.begin_transaction()
    _write(producer, topic, 0, second)
    producer.commit_transaction(10.0)

    restarted = _restorer(kafka_bootstrap, topic, tmp_path / "store")
    restarted.on_restored = lambda _p, entries, _took: counts.append(entries)
    restarted({0})
    assert counts == [20, 3]
    assert _found(restarted.index, first + second) == [True] * 23
    restarted.index.close()


def test_a_changelog_created_again_under_its_name_is_restored_from_its_start(
    kafka_bootstrap: str, tmp_path: Path
) -> None:
    """A kept store remembers offsets of the log it read: once the topic is
    deleted and created again (its offsets from 0), entries the new log holds
    below the old offset are restored all the same, or their resends would be
    decided again."""
    topic = f"idx-{uuid.uuid4().hex[:8]}"
    asyncio.run(_topic(kafka_bootstrap, topic))
    old = [_tx(i) for i in range(30)]
    producer = _producer(kafka_bootstrap, f"{topic}-w1")
    producer.begin_transaction()
    _write(producer, topic, 0, old)
    producer.commit_transaction(10.0)
    restore = _restorer(kafka_bootstrap, topic, tmp_path / "store")
    restore({0})
    assert restore.index.restored_to(topic, 0) is not None and restore.index.restored_to(topic, 0) > 30
    restore.index.close()

    asyncio.run(_delete(kafka_bootstrap, topic))
    asyncio.run(_topic(kafka_bootstrap, topic))
    new = [_tx(i) for i in range(30, 35)]  # far fewer records than the store's offset
    producer = _producer(kafka_bootstrap, f"{topic}-w2")
    producer.begin_transaction()
    _write(producer, topic, 0, new)
    producer.commit_transaction(10.0)

    counts: list[int] = []
    again = _restorer(kafka_bootstrap, topic, tmp_path / "store")
    again.on_restored = lambda _p, entries, _took: counts.append(entries)
    again({0})
    assert counts == [5]
    assert _found(again.index, new) == [True] * 5
    again.index.close()


async def _delete(bootstrap: str, name: str) -> None:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        await admin.delete_topics([name])
    finally:
        await admin.close()
    # The broker deletes a topic in the background: wait until its name is free again.
    from confluent_kafka.admin import AdminClient

    client = AdminClient({"bootstrap.servers": bootstrap})
    for _ in range(100):
        if name not in client.list_topics(timeout=5).topics:
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"{name} still listed after its deletion")
