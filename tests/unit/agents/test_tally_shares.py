"""The merchant tally: each partition of ``labels`` counted into its own share
by its one owner, every worker's copy the sum of the shares; a batch's offsets
move only once its shares are written, and a batch read again counts once."""

from __future__ import annotations

import asyncio
import time
import zlib
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

import orjson
import pytest
from confluent_kafka import KafkaError, KafkaException, Message, TopicPartition

from agents.tally import TallyCounter, TallyProducer, TallyReader
from app.errors import TallyError
from pipeline.labels import Label, MerchantTally, TallyView, parse_tally_key, tally_key, tally_writes

LABELS, TALLY = "labels", "app-merchant-tally"


def label(txid: str, verdict: str = "fraud", merchant: str | None = "m-1") -> Label:
    return Label(txid, verdict, "chargeback", 1000.0, merchant)


def test_a_merchant_s_tally_is_the_sum_of_its_shares() -> None:
    view = TallyView()
    assert view.get("m-1") is None  # no label yet
    view.put("m-1", 0, MerchantTally(2, 5))
    view.put("m-1", 3, MerchantTally(1, 0))
    view.put("m-2", 3, MerchantTally(0, 4))
    assert (view.get("m-1").fraud, view.get("m-1").legit) == (3, 5)  # type: ignore[union-attr]
    view.put("m-1", 0, MerchantTally(4, 5))  # a share's newer value replaces it
    assert (view.get("m-1").fraud, view.get("m-1").legit) == (5, 5)  # type: ignore[union-attr]
    view.put("m-1", 0, None)  # deleted
    view.put("m-1", 3, None)
    assert view.get("m-1") is None and len(view) == 1


def test_labels_count_into_the_share_of_their_partition_and_a_batch_read_again_counts_once() -> None:
    view = TallyView()
    batch = [(0, label("t1")), (1, label("t2", "legit")), (0, label("t3")), (1, label("t4", merchant=None))]
    changed = tally_writes(view, batch)
    assert {k: (t.fraud, t.legit) for k, t in changed.items()} == {("m-1", 0): (2, 0), ("m-1", 1): (0, 1)}
    for (merchant, part), tally in changed.items():
        view.put(merchant, part, tally)
    assert tally_writes(view, batch) == {}  # the same labels again: nothing moves
    # A changed verdict moves the count, in the share that counted the first one.
    moved = tally_writes(view, [(0, label("t1", "legit"))])
    assert {k: (t.fraud, t.legit) for k, t in moved.items()} == {("m-1", 0): (1, 1)}


def test_a_share_key_names_its_merchant_and_partition() -> None:
    assert parse_tally_key(tally_key("m:1", 3)) == ("m:1", 3)
    assert parse_tally_key(b"m-1") is None and parse_tally_key(b'["m-1", "3"]') is None


def labels_record(partition: int, offset: int, txid: str, merchant: str | None = "m-1") -> Message:
    doc: dict[str, Any] = {"transaction_id": txid, "label": "fraud", "source": "analyst"}
    if merchant is not None:
        doc["merchant_id"] = merchant
    return Message(topic=LABELS, partition=partition, offset=offset, value=orjson.dumps(doc))


class Log:
    """A topic in memory: what the tally's producer writes and its reader reads."""

    def __init__(self, partitions: int) -> None:
        self.parts: list[list[tuple[bytes, bytes | None]]] = [[] for _ in range(partitions)]

    def end(self) -> dict[int, int]:
        return {p: len(records) for p, records in enumerate(self.parts)}


class LogProducer:
    """The calls TallyProducer makes of ``confluent_kafka.Producer``."""

    def __init__(self, log: Log, fail: bool = False) -> None:
        self.log, self.fail = log, fail
        self.pending: list[Any] = []

    def produce(self, topic: str, value: bytes, key: bytes, on_delivery: Any) -> None:
        self.pending.append((key, value, on_delivery))

    def flush(self, timeout: float) -> int:
        for key, value, on_delivery in self.pending:
            if self.fail:
                on_delivery("broker refused", None)
            else:
                self.log.parts[zlib.crc32(key) % len(self.log.parts)].append((key, value))
                on_delivery(None, None)
        self.pending = []
        return 0


class LogConsumer:
    """The calls TallyReader makes of ``confluent_kafka.Consumer``."""

    def __init__(self, log: Log, refusals: int = 0) -> None:
        self.log, self.refusals = log, refusals
        self.at: dict[int, int] = {}

    def list_topics(self, topic: str, timeout: float) -> Any:
        partitions = {p: None for p in range(len(self.log.parts))}
        return SimpleNamespace(topics={topic: SimpleNamespace(error=None, partitions=partitions)})

    def get_watermark_offsets(self, tp: TopicPartition, timeout: float) -> tuple[int, int]:
        if self.refusals:  # as right after a partition's leader was lost
            self.refusals -= 1
            raise KafkaException(KafkaError(KafkaError.NOT_LEADER_FOR_PARTITION))
        return 0, len(self.log.parts[tp.partition])

    def assign(self, tps: list[TopicPartition]) -> None:
        self.at = {tp.partition: 0 for tp in tps}

    def consume(self, n: int, timeout: float) -> list[Message]:
        got = []
        for p, offset in self.at.items():
            for key, value in self.log.parts[p][offset:]:
                got.append(Message(topic=TALLY, partition=p, offset=offset, key=key, value=value))
                offset += 1
            self.at[p] = offset
        if not got:
            time.sleep(0.005)  # as a consume waiting for records
        return got

    def position(self, tps: list[TopicPartition]) -> list[TopicPartition]:
        return [TopicPartition(TALLY, tp.partition, self.at[tp.partition]) for tp in tps]

    def close(self) -> None:
        pass


class Labels:
    """The tally group's side of AtLeastOnce: hands out batches, records what was marked done."""

    def __init__(self, batches: list[list[Message]], log: Log) -> None:
        self.batches, self.log = batches, log
        self.marked: list[list[tuple[int | None, int | None]]] = []

    async def take(self, max_records: int, within_s: float) -> list[Message]:
        return self.batches.pop(0) if self.batches else []

    async def ends(self, topic: str) -> dict[int, int]:
        return self.log.end()

    async def done(self, records: Sequence[Message]) -> None:
        self.marked.append([(r.partition(), r.offset()) for r in records])


def counter(log: Log, batches: list[list[Message]], *, fail: bool = False) -> tuple[TallyCounter, Labels, TallyReader]:
    labels = Labels(batches, log)
    reader = TallyReader(TALLY, {}, TallyView(), consumer_factory=lambda c: LogConsumer(log))
    producer = TallyProducer(TALLY, {}, producer_factory=lambda c: LogProducer(log, fail))
    return TallyCounter(labels, reader, producer), labels, reader  # type: ignore[arg-type]


def test_two_owners_count_their_partitions_and_every_copy_holds_the_sum() -> None:
    log = Log(partitions=4)

    async def scenario() -> tuple[TallyView, list[Labels]]:
        first, a, ra = counter(log, [[labels_record(0, 0, "t1"), labels_record(0, 1, "t2", merchant=None)],
                                     [labels_record(0, 2, "t3")]])  # fmt: skip
        second, b, rb = counter(log, [[labels_record(1, 0, "t4"), labels_record(1, 1, "t4")]])
        for reader in (ra, rb):
            await reader.start()
        await first.step()
        await second.step()
        await first.step()  # on top of its own last write: 2 in its share, not 1
        # A worker started now restores the whole tally from the topic.
        copy = TallyReader(TALLY, {}, TallyView(), consumer_factory=lambda c: LogConsumer(log))
        await copy.start()
        await copy.reached(copy.start_ends)
        for reader in (ra, rb, copy):
            await reader.close()
        return copy.view, [a, b]

    view, (a, b) = asyncio.run(scenario())
    assert (view.get("m-1").fraud, view.get("m-1").legit) == (3, 0)  # type: ignore[union-attr]
    assert a.marked == [[(0, 0), (0, 1)], [(0, 2)]] and b.marked == [[(1, 0), (1, 1)]]


def test_a_batch_whose_shares_are_not_written_is_not_marked_counted() -> None:
    log = Log(partitions=2)

    async def scenario() -> Labels:
        count, labels, reader = counter(log, [[labels_record(0, 0, "t1")]], fail=True)
        await reader.start()
        try:
            with pytest.raises(TallyError):  # the worker exits; the batch is counted again after its restart
                await count.step()
        finally:
            await reader.close()
        return labels

    assert asyncio.run(scenario()).marked == []


def test_labels_without_a_merchant_are_marked_counted_and_write_nothing() -> None:
    log = Log(partitions=2)

    async def scenario() -> Labels:
        count, labels, reader = counter(log, [[labels_record(1, 7, "t1", merchant=None),
                                               Message(topic=LABELS, partition=1, offset=8, value=b"not json")]])  # fmt: skip
        await count.step()  # the reader never started: nothing waited on it
        return labels

    assert asyncio.run(scenario()).marked == [[(1, 7), (1, 8)]] and log.end() == {0: 0, 1: 0}


def test_a_copy_restores_once_the_broker_answers_after_a_leader_was_lost() -> None:
    log = Log(partitions=2)
    log.parts[1].append((tally_key("m-1", 0), orjson.dumps(MerchantTally(2, 1).to_json())))

    async def scenario() -> TallyView:
        reader = TallyReader(TALLY, {}, TallyView(), consumer_factory=lambda c: LogConsumer(log, refusals=2))
        await reader.start()  # asked again after "Not leader for partition"
        await reader.reached(reader.start_ends)
        await reader.close()
        return reader.view

    tally = asyncio.run(scenario()).get("m-1")
    assert tally is not None and (tally.fraud, tally.legit) == (2, 1)


class SlowConsumer(LogConsumer):
    """Hands out one record a call, slowly, or none at all once ``stuck``."""

    def __init__(self, log: Log, stuck: bool = False) -> None:
        super().__init__(log)
        self.stuck = stuck

    def consume(self, n: int, timeout: float) -> list[Message]:
        time.sleep(0.02)
        if self.stuck:
            return []
        for p, offset in self.at.items():
            if offset < len(self.log.parts[p]):
                key, value = self.log.parts[p][offset]
                self.at[p] = offset + 1
                return [Message(topic=TALLY, partition=p, offset=offset, key=key, value=value)]
        return []


def test_a_restore_longer_than_the_stall_limit_goes_on_while_it_reads_and_stops_when_it_does_not(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr("agents.tally.STALLED_AFTER_S", 0.2)
    log = Log(partitions=1)
    for i in range(30):  # ~0.6 s to read, one record every 20 ms
        log.parts[0].append((tally_key(f"m-{i}", 0), orjson.dumps(MerchantTally(1, 0).to_json())))

    async def restore(stuck: bool) -> int:
        reader = TallyReader(TALLY, {}, TallyView(), consumer_factory=lambda c: SlowConsumer(log, stuck))
        await reader.start()
        try:
            await reader.reached(reader.start_ends)
        finally:
            await reader.close()
        return len(reader.view)

    assert asyncio.run(restore(stuck=False)) == 30
    with pytest.raises(TallyError, match="no record read"):
        asyncio.run(restore(stuck=True))
