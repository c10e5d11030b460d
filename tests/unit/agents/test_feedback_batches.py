"""The feedback loop's batches: a batch's offsets move only once the quality
join has taken it, however long the store refuses; what cannot be a decision
or a label is left out, never retried for ever."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from typing import Any

import orjson
import pytest
from confluent_kafka import KafkaError, KafkaException, Message, TopicPartition

from agents.feedback import FeedbackLoop, parse_batch
from app import at_least_once
from app.at_least_once import AtLeastOnce, last_offsets
from pipeline.labels import Label
from pipeline.quality import JoinLedger, Served

FEEDBACK, LABELS = "feedback", "labels"
LABELED_AT, LABELED_AT_S = "2026-12-07T10:00:00+00:00", 1796637600.0


def feedback_record(txid: str, action: str = "approve", at: float = 1000.0) -> bytes:
    decision = {"transaction_id": txid, "action": action, "fraud_score": 0.2, "decided_at": at,
                "model_version": "v1", "rules_version": "rules-1"}  # fmt: skip
    return orjson.dumps({"decision": decision, "rule": "score"})


def label_record(txid: str, label: str = "fraud", at: str | None = LABELED_AT) -> bytes:
    doc: dict[str, Any] = {"transaction_id": txid, "label": label, "source": "chargeback"}
    if at is not None:
        doc["labeled_at"] = at
    return orjson.dumps(doc)


def message(topic: str, partition: int, offset: int, value: bytes | None) -> Message:
    return Message(topic=topic, partition=partition, offset=offset, key=None, value=value)


class LedgerStore:
    """The quality store's writes over the pure join (pipeline/quality.py
    JoinLedger), refusing the first ``failures`` writes as a Redis away would."""

    def __init__(self, failures: int = 0) -> None:
        self.ledger = JoinLedger()
        self.failures = failures
        self.attempts = 0

    def _maybe_fail(self) -> None:
        self.attempts += 1
        if self.failures:
            self.failures -= 1
            raise ConnectionError("Redis away")

    async def add_served(self, served: list[Served]) -> int:
        self._maybe_fail()
        return sum(self.ledger.add_served(s) is not None for s in served)

    async def add_labels(self, labels: list[Label]) -> int:
        return sum(self.ledger.add_label(label, now=label.labeled_at) is not None for label in labels)


class Batches:
    """The reader's side of AtLeastOnce: hands out batches, records what was marked done and when."""

    def __init__(self, batches: list[list[Message]], store: LedgerStore) -> None:
        self.batches = batches
        self.store = store
        self.done_after: list[tuple[list[tuple[str | None, int | None]], int]] = []  # (records, store attempts by then)

    async def take(self, max_records: int, within_s: float) -> list[Message]:
        return self.batches.pop(0) if self.batches else []

    async def done(self, records: Sequence[Message]) -> None:
        self.done_after.append(([(r.topic(), r.offset()) for r in records], self.store.attempts))


@pytest.fixture(autouse=True)
def quick_retries(monkeypatch: pytest.MonkeyPatch) -> None:
    async def no_sleep(_: float) -> None:
        return None

    monkeypatch.setattr(asyncio, "sleep", no_sleep)  # the retries' back-off (app/retry.py)


def test_a_batch_is_marked_done_only_once_the_store_took_it() -> None:
    store = LedgerStore(failures=3)
    batch = [message(FEEDBACK, 0, 5, feedback_record("t1")), message(LABELS, 1, 9, label_record("t1"))]
    reader = Batches([batch], store)
    loop = FeedbackLoop(reader, store, FEEDBACK)  # type: ignore[arg-type]

    asyncio.run(loop.step())

    # Three refusals, then the write that took: only then the offsets.
    assert reader.done_after == [([(FEEDBACK, 5), (LABELS, 9)], 4)]
    assert set(store.ledger.joined) == {"t1"}
    assert store.ledger.joined["t1"].label == "fraud"


def test_a_bug_in_the_write_is_not_retried_and_marks_nothing() -> None:
    class Broken(LedgerStore):
        async def add_served(self, served: list[Served]) -> int:
            self.attempts += 1
            raise KeyError("a bug, not Redis")

    store = Broken()
    reader = Batches([[message(FEEDBACK, 0, 5, feedback_record("t1"))]], store)
    with pytest.raises(KeyError):  # the worker exits and the batch is read again after its restart
        asyncio.run(FeedbackLoop(reader, store, FEEDBACK).step())  # type: ignore[arg-type]
    assert store.attempts == 1 and reader.done_after == []


def test_an_empty_take_marks_nothing() -> None:
    store = LedgerStore()
    reader = Batches([], store)
    asyncio.run(FeedbackLoop(reader, store, FEEDBACK).step())  # type: ignore[arg-type]
    assert reader.done_after == [] and store.attempts == 0


def test_a_batch_splits_into_decisions_and_labels_and_leaves_out_what_is_neither(
    caplog: pytest.LogCaptureFixture,
) -> None:
    served, labels = parse_batch(
        [
            (FEEDBACK, feedback_record("t1", "review")),
            (FEEDBACK, b"not json"),
            (FEEDBACK, None),  # a tombstone
            (LABELS, label_record("t1")),
            (LABELS, label_record("t2", at=None)),  # no time given: when it reached the loop
            (LABELS, b'{"transaction_id": "t3"}'),
        ],
        FEEDBACK,
        now=5000.0,
    )
    assert [(s.transaction_id, s.action) for s in served] == [("t1", "review")]
    assert [(x.transaction_id, x.labeled_at) for x in labels] == [("t1", LABELED_AT_S), ("t2", 5000.0)]
    assert "label ignored" in caplog.text


def test_the_offsets_to_commit_are_one_past_the_last_record_of_each_partition() -> None:
    errored = Message(topic=LABELS, partition=0, offset=99, error=KafkaError(KafkaError._TRANSPORT))
    records = [message(FEEDBACK, 0, 3, b""), message(FEEDBACK, 0, 7, b""), message(FEEDBACK, 1, 2, b""),
               message(LABELS, 0, 4, b""), errored]  # fmt: skip
    assert last_offsets(records) == {(FEEDBACK, 0): 8, (FEEDBACK, 1): 3, (LABELS, 0): 5}


class StoringConsumer:
    """The parts of ``confluent_kafka.Consumer`` AtLeastOnce calls; partition 1 of
    ``labels`` is no longer assigned (librdkafka refuses its offset)."""

    def __init__(self, config: dict[str, object]) -> None:
        self.config = config
        self.stored: list[tuple[str, int, int]] = []
        self.closed = False

    def subscribe(self, topics: list[str]) -> None:
        self.topics = topics

    def consume(self, num_messages: int, timeout: float) -> list[Message]:
        return [
            message(LABELS, 0, 1, b"x"),
            Message(topic=LABELS, partition=0, error=KafkaError(KafkaError._TRANSPORT)),
        ]

    def store_offsets(self, offsets: list[TopicPartition]) -> None:
        for tp in offsets:
            if (tp.topic, tp.partition) == (LABELS, 1):
                raise KafkaException(KafkaError(KafkaError._STATE))
            self.stored.append((tp.topic, tp.partition, tp.offset))

    def close(self) -> None:
        self.closed = True


def test_offsets_are_stored_for_commit_only_by_done_and_a_partition_gone_is_left_to_its_owner() -> None:
    made: list[StoringConsumer] = []

    def factory(config: dict[str, object]) -> StoringConsumer:
        made.append(StoringConsumer(config))
        return made[-1]

    async def scenario() -> list[Message]:
        reader = AtLeastOnce(
            topics=[FEEDBACK, LABELS], group_id="g-feedback", client_config={}, consumer_factory=factory
        )
        await reader.start()
        taken = await reader.take(10, 0.1)
        assert made[0].stored == []  # read, not yet processed: nothing to commit
        await reader.done([*taken, message(LABELS, 1, 4, b"y"), message(FEEDBACK, 2, 6, b"z")])
        await reader.close()
        return taken

    taken = asyncio.run(scenario())
    consumer = made[0]
    assert [r.offset() for r in taken] == [1]  # the record carrying an error left out
    assert consumer.config["enable.auto.commit"] is True and consumer.config["enable.auto.offset.store"] is False
    assert consumer.config["isolation.level"] == "read_committed"
    assert consumer.stored == [(LABELS, 0, 2), (FEEDBACK, 2, 7)]
    assert consumer.closed


def test_a_close_that_hangs_on_a_lost_coordinator_is_not_waited_for(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(at_least_once, "CLOSE_WITHIN_S", 0.05)
    release = threading.Event()

    class Hanging(StoringConsumer):
        def close(self) -> None:  # as librdkafka waiting for a group coordinator just lost
            release.wait(5.0)

    async def scenario() -> None:
        reader = AtLeastOnce(topics=[LABELS], group_id="g", client_config={}, consumer_factory=Hanging)
        await reader.start()
        await asyncio.wait_for(reader.close(), 2.0)  # returns: the worker goes on stopping

    try:
        asyncio.run(scenario())
    finally:
        release.set()
