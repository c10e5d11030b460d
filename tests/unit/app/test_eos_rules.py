"""app/eos.py against an in-memory Kafka (tests/kafka_fakes.py): what a
``read_committed`` reader and the group's committed offsets show after each
way a transaction can end."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable
from typing import Any

import pytest
from confluent_kafka import KafkaError, KafkaException

from app import eos
from app.eos import COMMIT_RETRIES, ExactlyOnce, TakenBatch
from tests.kafka_fakes import FakeConsumer, FakeKafka, error

TOPIC = "transactions"
OUT = "decisions"
GROUP = "fraud-unit-score"


def new_kafka() -> FakeKafka:
    return FakeKafka({TOPIC: 2, OUT: 1})


def stream(kafka: FakeKafka, worker: str = "w1", handover_topic: str | None = None) -> ExactlyOnce:
    s = ExactlyOnce(
        topic=TOPIC, group_id=GROUP, transactional_id=f"{GROUP}-{TOPIC}-{worker}", client_config={},
        handover_topic=handover_topic, consumer_factory=kafka.consumer, producer_factory=kafka.producer,
    )  # fmt: skip
    s.results = []  # type: ignore[attr-defined]
    s.on_result = s.results.append  # type: ignore[attr-defined]
    return s


def fill(kafka: FakeKafka, partition: int, n: int) -> None:
    start = len(kafka.logs[(TOPIC, partition)])
    for o in range(start, start + n):
        kafka.append(TOPIC, partition, f"p{partition}-{o}".encode(), key=f"k{partition}-{o}".encode())


def echo(batch: TakenBatch) -> list[tuple[str, bytes | None, bytes, list[tuple[str, bytes]]]]:
    """One output record per input record: its value, as a decision would carry its id."""
    return [(OUT, m.key(), m.value(), []) for m in batch.messages]


def seen(kafka: FakeKafka) -> list[bytes]:
    return [m.value() for m in kafka.visible(OUT)]


def taken(batch: TakenBatch) -> list[tuple[int, int]]:
    return [(m.partition(), m.offset()) for m in batch.messages]


def consumer_of(kafka: FakeKafka, s: ExactlyOnce) -> FakeConsumer:
    consumer: FakeConsumer = s._consumer
    return consumer


def run(
    kafka: FakeKafka, body: Callable[..., Awaitable[Any]], workers: int = 1, handover_topic: str | None = None
) -> Any:
    async def go() -> Any:
        streams = [stream(kafka, f"w{i + 1}", handover_topic) for i in range(workers)]
        try:
            for s in streams:
                await s.start()
            for s in streams:
                await joined(s)
            kafka.committed_reads = 0  # counted from here: joining read each partition's start
            return await body(*streams)
        finally:
            for s in streams:
                await s.close()

    return asyncio.run(go())


async def take(s: ExactlyOnce, n: int = 100) -> TakenBatch:
    return await s.take(n, 0.0)


async def joined(s: ExactlyOnce) -> None:
    """Serve what the group decided (inside ``consume``, which then returns nothing)."""
    assert (await take(s)).messages == []


def test_an_idle_take_waits_for_the_first_record_then_takes_what_queued_behind_it() -> None:
    """Nothing in the window: the next wait ends at the first record (not after
    a whole batch's wait), and what arrived with it comes along."""
    kafka = new_kafka()

    async def body(s: ExactlyOnce) -> None:
        calls: list[tuple[int, float]] = []
        inner = s._consumer

        class Arriving:
            """The group's consumer, with three records arriving during the window's wait."""

            def consume(self, n: int, timeout: float) -> list[Any]:
                calls.append((n, timeout))
                if len(calls) == 1:
                    fill(kafka, 0, 3)
                    return []
                return list(inner.consume(n, timeout))

            def __getattr__(self, name: str) -> Any:
                return getattr(inner, name)

        s._consumer = Arriving()
        batch = await s.take(64, 0.01, 0.25)
        s._consumer = inner
        assert calls == [(64, 0.01), (1, 0.25), (63, 0)]
        assert taken(batch) == [(0, 0), (0, 1), (0, 2)]

    run(kafka, body)


# --- a transaction that commits -----------------------------------------------------------------


def test_a_committed_transaction_makes_its_records_and_offsets_visible_together() -> None:
    kafka = new_kafka()
    fill(kafka, 0, 3)
    fill(kafka, 1, 2)

    async def body(s: ExactlyOnce) -> None:
        first = await take(s)
        assert taken(first) == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1)]
        seq = await s.send(first, echo(first))
        fill(kafka, 0, 1)
        second = await take(s)
        assert await s.send(second, echo(second)) == seq  # one transaction spans both batches
        assert s.open_since is not None
        # Open: nothing of it is visible, neither records nor offsets.
        assert seen(kafka) == [] and kafka.committed(GROUP, TOPIC) == {}
        assert await s.commit() == [(seq, "committed")]
        assert s.open_since is None
        assert s.offsets() == [(TOPIC, 0, 4, 4), (TOPIC, 1, 2, 2)]  # highwater and committed: no lag
        assert await s.committed() == {0: 4, 1: 2}

    run(kafka, body)
    assert sorted(seen(kafka)) == sorted([b"p0-0", b"p0-1", b"p0-2", b"p0-3", b"p1-0", b"p1-1"])
    assert kafka.committed(GROUP, TOPIC) == {0: 4, 1: 2}
    assert len(kafka.events("commit")) == 1


def test_a_commit_with_nothing_open_settles_nothing() -> None:
    kafka = new_kafka()

    async def body(s: ExactlyOnce) -> list[tuple[int, str]]:
        assert (await take(s)).messages == []
        return await s.commit()

    assert run(kafka, body) == []
    assert kafka.events("commit") == []


def test_a_transaction_begun_right_after_a_commit_waits_for_the_coordinator_to_settle_it() -> None:
    """The first records of the transaction after a commit wait out what is
    left of ``settle_s`` (the coordinator would refuse their partitions while
    it completes the last one, and librdkafka asks again only 20 ms later);
    the first transaction, and later batches of the same transaction, do not."""
    kafka = new_kafka()
    fill(kafka, 0, 3)

    async def body(s: ExactlyOnce) -> None:
        s.settle_s = 60.0
        pauses: list[float] = []
        s._sleep = pauses.append
        first = await take(s)
        await s.send(first, echo(first))
        assert pauses == []  # nothing committed before it
        await s.commit()
        fill(kafka, 0, 2)
        second = await take(s)
        await s.send(second, echo(second))
        assert len(pauses) == 1 and 59.0 < pauses[0] <= 60.0
        fill(kafka, 1, 2)
        third = await take(s)
        await s.send(third, echo(third))  # the same transaction: no pause
        assert len(pauses) == 1
        assert [o for _, o in await s.commit()] == ["committed"]

    run(kafka, body)
    assert sorted(seen(kafka)) == sorted([b"p0-0", b"p0-1", b"p0-2", b"p0-3", b"p0-4", b"p1-0", b"p1-1"])


# --- transactions that fail ---------------------------------------------------------------------


def test_an_abortable_commit_error_aborts_and_the_same_records_come_back() -> None:
    kafka = new_kafka()
    fill(kafka, 0, 2)

    async def body(s: ExactlyOnce) -> None:
        first = await take(s)
        await s.send(first, echo(first))
        assert await s.commit() == [(1, "committed")]
        fill(kafka, 0, 3)
        fill(kafka, 1, 2)
        second = await take(s)
        assert taken(second) == [(0, 2), (0, 3), (0, 4), (1, 0), (1, 1)]
        kafka.commit_errors.append(error(KafkaError.OUT_OF_ORDER_SEQUENCE_NUMBER, abortable=True))
        await s.send(second, echo(second))
        assert await s.commit() == [(2, "aborted")]
        assert s.results == ["committed", "aborted"]  # type: ignore[attr-defined]
        # Nothing of the aborted transaction is visible; its offsets did not move.
        assert seen(kafka) == [b"p0-0", b"p0-1"]
        assert kafka.committed(GROUP, TOPIC) == {0: 2}
        # Back to the committed offsets (partition 1 has none: to the first offset
        # sent), read from the group: a commit whose answer is lost may have committed.
        assert sorted(consumer_of(kafka, s).seeks) == [(0, 2), (1, 0)] and kafka.committed_reads == 1
        again = await take(s)
        assert taken(again) == taken(second)
        await s.send(again, echo(again))
        assert await s.commit() == [(3, "committed")]

    run(kafka, body)
    assert sorted(seen(kafka)) == sorted([b"p0-0", b"p0-1", b"p0-2", b"p0-3", b"p0-4", b"p1-0", b"p1-1"])
    assert kafka.committed(GROUP, TOPIC) == {0: 5, 1: 2}
    assert len(kafka.events("abort")) == 1
    assert len(kafka.producers) == 1  # an abort keeps the producer


def test_a_rewind_librdkafka_refuses_is_made_before_the_next_take_and_no_record_is_skipped() -> None:
    """librdkafka refuses a seek while the partition's fetch state changes
    (``_OUTDATED``, in a rebalance). Going on from where the partition is
    would commit past the aborted records (lost); the rewind is tried again
    before the next take, and what the partition delivers meanwhile is not used."""
    kafka = new_kafka()
    fill(kafka, 0, 3)

    async def body(s: ExactlyOnce) -> None:
        first = await take(s)
        assert taken(first) == [(0, 0), (0, 1), (0, 2)]
        consumer = consumer_of(kafka, s)
        real_seek, refused = consumer.seek, []

        def seek_refused_once(tp: Any) -> None:
            if not refused:
                refused.append(tp.partition)
                raise KafkaException(error(KafkaError._OUTDATED))
            real_seek(tp)

        consumer.seek = seek_refused_once  # type: ignore[method-assign]
        kafka.commit_errors.append(error(KafkaError.OUT_OF_ORDER_SEQUENCE_NUMBER, abortable=True))
        await s.send(first, echo(first))
        assert await s.commit() == [(1, "aborted")]
        assert refused == [0]
        fill(kafka, 0, 1)  # the partition goes on delivering after the refused rewind
        again = await take(s)
        while not again.messages:
            again = await take(s)
        assert taken(again)[0] == (0, 0)  # from the rewind, none skipped
        await s.send(again, echo(again))
        assert await s.commit() == [(2, "committed")]

    run(kafka, body)
    assert seen(kafka) == [b"p0-0", b"p0-1", b"p0-2", b"p0-3"]
    assert kafka.committed(GROUP, TOPIC) == {0: 4}


def test_offsets_refused_by_the_group_abort_the_transaction() -> None:
    kafka = new_kafka()
    fill(kafka, 0, 2)

    async def body(s: ExactlyOnce) -> None:
        batch = await take(s)
        await s.send(batch, echo(batch))
        kafka.offsets_errors.append(error(KafkaError.COORDINATOR_NOT_AVAILABLE, abortable=True))
        assert await s.commit() == [(1, "aborted")]
        assert seen(kafka) == [] and kafka.committed(GROUP, TOPIC) == {}
        assert kafka.committed_reads == 0  # commit_transaction never ran: nothing to ask
        again = await take(s)
        assert taken(again) == taken(batch)

    run(kafka, body)


def test_offsets_that_hang_past_their_timeout_abandon_the_transaction_for_a_new_producer() -> None:
    # librdkafka can block in send_offsets_to_transaction with the group's
    # coordinator lost, whatever its timeout: the worker must go on without it.
    kafka = new_kafka()
    fill(kafka, 0, 2)
    kafka.offsets_hang = threading.Event()

    async def body(s: ExactlyOnce) -> None:
        s.offsets_hung_s = 0.2
        kafka.offsets_hang = None
        first = await take(s)
        await s.send(first, echo(first))
        assert await s.commit() == [(1, "committed")]
        fill(kafka, 0, 2)
        batch = await take(s)
        await s.send(batch, echo(batch))  # its offsets went at the transaction's start
        kafka.offsets_hang = hung  # and hang when the commit sends them again
        assert await asyncio.wait_for(s.commit(), 5.0) == [(2, "aborted")]
        assert seen(kafka) == [b"p0-0", b"p0-1"] and kafka.committed(GROUP, TOPIC) == {0: 2}
        # Nothing of it committed: back to where it began, without asking the
        # group's coordinator (the broker just lost, in the case this is for).
        assert consumer_of(kafka, s).seeks == [(0, 2)] and kafka.committed_reads == 0
        again = await take(s)
        assert taken(again) == taken(batch)
        kafka.offsets_hang = None
        await s.send(again, echo(again))
        assert await s.commit() == [(3, "committed")]

    hung = kafka.offsets_hang
    try:
        run(kafka, body)
    finally:
        hung.set()  # the abandoned call returns (fenced) on its own thread
    assert len(kafka.producers) == 2  # replaced: a new epoch aborted the hung transaction
    assert seen(kafka) == [b"p0-0", b"p0-1", b"p0-2", b"p0-3"]  # once each
    assert kafka.committed(GROUP, TOPIC) == {0: 4}


@pytest.mark.parametrize("how", ["fatal error", "id taken by a new producer"])
def test_a_fatal_error_replaces_the_producer_and_seeks_back(how: str) -> None:
    kafka = new_kafka()
    fill(kafka, 0, 3)

    async def body(s: ExactlyOnce) -> None:
        batch = await take(s)
        await s.send(batch, echo(batch))
        if how == "fatal error":
            kafka.commit_errors.append(error(KafkaError._FENCED, fatal=True))
        else:  # a restart of this worker's slot elsewhere: a new epoch of the same id
            other = kafka.producer(dict(s._producer_config))
            other.init_transactions()
        assert await s.commit() == [(1, "aborted")]
        assert seen(kafka) == []
        assert consumer_of(kafka, s).seeks == [(0, 0)]
        again = await take(s)
        assert taken(again) == taken(batch)
        await s.send(again, echo(again))
        assert await s.commit() == [(2, "committed")]

    run(kafka, body)
    inits = kafka.events("init")
    assert inits[0][2] == 1 and inits[-1][2] == len(inits)  # the replacement took a newer epoch
    assert kafka.producers[-1].epoch == kafka.epochs[kafka.producers[-1].id]
    assert len(kafka.producers) == (2 if how == "fatal error" else 3)
    assert seen(kafka) == [b"p0-0", b"p0-1", b"p0-2"]  # once
    assert kafka.committed(GROUP, TOPIC) == {0: 3}


def test_a_retriable_commit_error_is_retried() -> None:
    kafka = new_kafka()
    fill(kafka, 0, 2)

    async def body(s: ExactlyOnce) -> None:
        batch = await take(s)
        await s.send(batch, echo(batch))
        kafka.commit_errors.append(error(KafkaError._TIMED_OUT, retriable=True))
        assert await s.commit() == [(1, "committed")]

    run(kafka, body)
    assert seen(kafka) == [b"p0-0", b"p0-1"]
    assert kafka.committed(GROUP, TOPIC) == {0: 2}
    assert kafka.events("abort") == [] and len(kafka.producers) == 1
    assert consumer_of_all_seeks(kafka) == []


def test_a_commit_that_keeps_failing_retriably_gives_up_and_nothing_is_visible() -> None:
    kafka = new_kafka()
    fill(kafka, 0, 2)

    async def body(s: ExactlyOnce) -> None:
        batch = await take(s)
        await s.send(batch, echo(batch))
        kafka.commit_errors.extend([error(KafkaError._TIMED_OUT, retriable=True)] * COMMIT_RETRIES)
        assert await s.commit() == [(1, "aborted")]
        assert seen(kafka) == []
        assert taken(await take(s)) == taken(batch)

    run(kafka, body)
    # The outcome was unknown: a new producer (its new epoch aborts what the old one left open).
    assert len(kafka.producers) == 2 and kafka.events("init")[-1][3] is True


@pytest.mark.parametrize("answer", ["raised", "per partition"])
def test_a_commit_whose_answer_was_lost_goes_on_after_what_it_committed_once_the_group_can_say(answer: str) -> None:
    """The commit went through, but the call failed (the broker was lost before
    it answered). Until the group's offsets are stable (its markers written),
    reading them fails, or librdkafka answers a partition with an error and no
    offset, which must not read as "nothing committed": the records would be
    taken again and decided twice."""
    kafka = new_kafka()
    fill(kafka, 0, 3)

    async def body(s: ExactlyOnce) -> None:
        s._sleep = lambda _s: None
        batch = await take(s)
        await s.send(batch, echo(batch))
        kafka.commit_answers_lost.append(error(KafkaError._TRANSPORT))
        unstable = error(KafkaError.UNSTABLE_OFFSET_COMMIT, retriable=True)
        if answer == "raised":
            kafka.committed_errors.extend([error(KafkaError._TIMED_OUT, retriable=True)] * 2)
        else:
            kafka.committed_partition_errors.extend([unstable] * 2)
        assert await s.commit() == [(1, "aborted")]  # as far as the worker could tell
        assert kafka.committed_reads == 3
        assert consumer_of(kafka, s).seeks == [(0, 3)]  # after what committed, not back to its first offset
        assert taken(await take(s)) == []
        fill(kafka, 0, 1)
        again = await take(s)
        assert taken(again) == [(0, 3)]
        await s.send(again, echo(again))
        assert await s.commit() == [(2, "committed")]

    run(kafka, body)
    assert seen(kafka) == [b"p0-0", b"p0-1", b"p0-2", b"p0-3"]  # each once
    assert kafka.committed(GROUP, TOPIC) == {0: 4}


def test_a_commit_whose_outcome_cannot_be_learned_stops_the_worker_rather_than_guess(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Neither going back to the transaction's first offsets (doubles what
    committed) nor going on (skips what did not): the commit raises, and the
    worker exits to be restarted (agents/wiring.py)."""
    monkeypatch.setattr(eos, "COMMITTED_READ_FOR_S", 0.0)
    kafka = new_kafka()
    fill(kafka, 0, 2)

    async def body(s: ExactlyOnce) -> None:
        batch = await take(s)
        await s.send(batch, echo(batch))
        kafka.commit_answers_lost.append(error(KafkaError._TRANSPORT))
        kafka.committed_partition_errors.append(error(KafkaError.UNSTABLE_OFFSET_COMMIT, retriable=True))
        with pytest.raises(KafkaException, match="could not be read stable"):
            await s.commit()
        assert consumer_of(kafka, s).seeks == []

    run(kafka, body)


async def reassigned_after_a_commit(kafka: FakeKafka, s: ExactlyOnce, fault: Callable[[], None]) -> None:
    """Partition 0's first three records decided and committed, two more
    written, ``fault`` set, then the worker's partitions assigned again (a new
    generation), served inside a take."""
    s._sleep = lambda _s: None
    first = await take(s)
    await s.send(first, echo(first))
    assert await s.commit() == [(1, "committed")]
    fill(kafka, 0, 2)
    fault()
    kafka.rebalance(GROUP, {consumer_of(kafka, s): {0, 1}})
    assert taken(await take(s)) == []  # the rebalance, served inside consume


async def the_rest_decided_once(kafka: FakeKafka, s: ExactlyOnce) -> None:
    """The two records after the commit are taken next, and every record is decided once."""
    again = await take(s)
    assert taken(again) == [(0, 3), (0, 4)]
    await s.send(again, echo(again))
    assert await s.commit() == [(2, "committed")]
    assert seen(kafka) == [b"p0-0", b"p0-1", b"p0-2", b"p0-3", b"p0-4"]
    assert kafka.committed(GROUP, TOPIC) == {0: 5}


def test_a_partition_assigned_again_starts_at_the_committed_offset_even_if_the_client_lost_it() -> None:
    """librdkafka answered a new assignment's committed offset UNSTABLE (a killed
    worker's transaction still held the offsets) while the assignment changed,
    put the partition back as if the group had committed nothing, and
    ``auto.offset.reset`` started it from offset 0: every record decided twice.
    The worker assigns each partition with the offset it read itself, stable."""
    kafka = new_kafka()
    fill(kafka, 0, 3)

    def fault() -> None:
        kafka.positions_lost.add(0)
        kafka.committed_partition_errors.append(error(KafkaError.UNSTABLE_OFFSET_COMMIT, retriable=True))

    async def body(s: ExactlyOnce) -> None:
        await reassigned_after_a_commit(kafka, s, fault)
        await the_rest_decided_once(kafka, s)

    run(kafka, body)


def test_a_produce_error_ends_the_transaction_aborted() -> None:
    kafka = new_kafka()
    fill(kafka, 0, 2)

    async def body(s: ExactlyOnce) -> None:
        batch = await take(s)
        kafka.produce_errors.append(error(KafkaError._STATE, abortable=True))
        seq = await s.send(batch, echo(batch))
        assert s.open_since is None and s.has_settled()
        assert await s.commit() == [(seq, "aborted")]
        again = await take(s)
        assert taken(again) == taken(batch)
        await s.send(again, echo(again))
        await s.commit()

    run(kafka, body)
    assert seen(kafka) == [b"p0-0", b"p0-1"]


def test_a_full_producer_queue_delays_the_send_and_loses_or_doubles_no_record() -> None:
    """produce() raising BufferError halfway through a batch: the rest is
    produced once the queue drains, in the same transaction."""
    kafka = new_kafka()
    fill(kafka, 0, 4)

    async def body(s: ExactlyOnce) -> None:
        batch = await take(s)
        kafka.queue_full_at = 2
        seq = await s.send(batch, echo(batch))
        assert kafka.queue_full_at is None  # it was full once
        assert await s.commit() == [(seq, "committed")]

    run(kafka, body)
    assert seen(kafka) == [b"p0-0", b"p0-1", b"p0-2", b"p0-3"]


def consumer_of_all_seeks(kafka: FakeKafka) -> list[tuple[int, int]]:
    return [seek for c in kafka.consumers for seek in c.seeks]


# --- rebalances ---------------------------------------------------------------------------------


def test_a_revocation_commits_the_open_transaction_before_the_partitions_go() -> None:
    kafka = new_kafka()
    fill(kafka, 0, 2)
    fill(kafka, 1, 2)
    revoked: list[set[int]] = []

    async def body(a: ExactlyOnce) -> None:
        a.on_revoked = revoked.append
        batch = await take(a)
        seq = await a.send(batch, echo(batch))
        b = stream(kafka, "w2")
        await b.start()  # joins: the group rebalances, partition 1 moves to it
        try:
            assert (await take(a)).messages == []  # the revocation is served inside consume()
            assert a.has_settled() and a.open_since is None
            assert await a.commit() == [(seq, "committed")]
            assert a.assigned == {0} and revoked == [{0, 1}]
            await joined(b)
            fill(kafka, 1, 1)
            # The new owner starts where the committed transaction left partition 1.
            assert taken(await take(b)) == [(1, 2)]
        finally:
            await b.close()

    run(kafka, body)
    commit = kafka.timeline.index(kafka.events("commit")[0])
    revoke = kafka.timeline.index(kafka.events("revoke")[0])
    assert commit < revoke  # committed while the worker still owned the partitions
    assert kafka.committed(GROUP, TOPIC) == {0: 2, 1: 2}
    assert sorted(seen(kafka)) == [b"p0-0", b"p0-1", b"p1-0", b"p1-1"]


def test_the_groups_metadata_is_read_once_per_generation_and_a_new_one_is_committed_under() -> None:
    """The metadata read costs a round trip to librdkafka's main thread with
    the GIL held (app/eos.py, ``_group_metadata``): once per generation, not
    per commit. A rebalance that moves nothing still makes a new generation;
    the open transaction then commits under it, not under the one it began in."""
    kafka = new_kafka()
    kafka.cooperative = True  # the worker's assignor: nothing revoked, an empty assignment

    async def body(s: ExactlyOnce) -> None:
        consumer = consumer_of(kafka, s)
        reads: list[int] = []
        read = consumer.consumer_group_metadata

        def counted() -> Any:
            reads.append(consumer.generation)
            return read()

        consumer.consumer_group_metadata = counted  # type: ignore[method-assign]
        for i in range(3):
            fill(kafka, 0, 1)
            batch = await take(s)
            await s.send(batch, echo(batch))
            assert await s.commit() == [(i + 1, "committed")]
        assert len(reads) == 1
        fill(kafka, 0, 1)
        batch = await take(s)
        seq = await s.send(batch, echo(batch))
        kafka.rebalance(GROUP, {consumer: {0, 1}})  # the same partitions, a new generation
        assert (await take(s)).messages == []  # served inside consume(): an empty assignment
        assert await s.commit() == [(seq, "committed")]
        assert reads == [reads[0], reads[0] + 1]

    run(kafka, body)
    assert kafka.committed(GROUP, TOPIC) == {0: 4}
    assert seen(kafka) == [b"p0-0", b"p0-1", b"p0-2", b"p0-3"]


def test_a_batch_taken_before_a_rebalance_is_never_sent() -> None:
    kafka = new_kafka()
    fill(kafka, 0, 2)
    fill(kafka, 1, 2)

    async def body(a: ExactlyOnce) -> None:
        batch = await take(a)
        assert taken(batch) == [(0, 0), (0, 1), (1, 0), (1, 1)]
        b = stream(kafka, "w2")
        await b.start()  # joins: partition 1 moves to it
        try:
            assert (await take(a)).messages == []  # the rebalance, inside consume
            assert await a.send(batch, echo(batch)) is None  # nothing produced, nothing open
            assert a.open_since is None and await a.commit() == []
            assert kafka.open == {}
            # Its records come again from the committed offsets: 0's to a, 1's to b.
            assert taken(await take(a)) == [(0, 0), (0, 1)]
            await joined(b)
            assert taken(await take(b)) == [(1, 0), (1, 1)]
        finally:
            await b.close()

    run(kafka, body)
    assert seen(kafka) == [] and kafka.events("commit") == []


def test_records_polled_in_a_consume_during_which_a_rebalance_happened_are_dropped() -> None:
    kafka = new_kafka()
    fill(kafka, 0, 2)

    async def body(s: ExactlyOnce) -> None:
        first = await take(s)
        await s.send(first, echo(first))
        await s.commit()
        fill(kafka, 0, 3)
        fill(kafka, 1, 2)
        # Records fetched under the old assignment come out of the call that serves the rebalance.
        kafka.rebalance(GROUP, {consumer_of(kafka, s): {0}}, after_fetch=True)
        assert (await take(s)).messages == []
        # The partition kept goes back to the lowest offset polled; the one given up is not sought.
        assert consumer_of(kafka, s).seeks == [(0, 2)]
        assert taken(await take(s)) == [(0, 2), (0, 3), (0, 4)]

    run(kafka, body)


def test_a_worker_that_missed_the_rebalance_is_fenced_and_nothing_it_sent_becomes_visible() -> None:
    """KIP-447: a long pause; the group moved on without this worker. Its
    transaction's offsets carry the old generation: refused, aborted."""
    kafka = new_kafka()
    fill(kafka, 0, 3)

    async def body(zombie: ExactlyOnce, heir: ExactlyOnce) -> None:
        batch = await take(zombie)
        assert taken(batch) == [(0, 0), (0, 1), (0, 2)]
        await zombie.send(batch, echo(batch))
        kafka.rebalance(GROUP, {consumer_of(kafka, heir): {0, 1}})  # the zombie's session expired
        assert await zombie.commit() == [(1, "fenced")]
        assert zombie.results == ["fenced"]  # type: ignore[attr-defined]
        assert seen(kafka) == [] and kafka.committed(GROUP, TOPIC) == {}
        await joined(heir)
        again = await take(heir)
        assert taken(again) == [(0, 0), (0, 1), (0, 2)]
        await heir.send(again, echo(again))
        assert await heir.commit() == [(1, "committed")]
        # The zombie learns it lost its partitions at its next poll.
        assert (await take(zombie)).messages == []
        assert zombie.assigned == set()

    run(kafka, body, workers=2)
    assert seen(kafka) == [b"p0-0", b"p0-1", b"p0-2"]
    assert kafka.committed(GROUP, TOPIC) == {0: 3}


def test_close_commits_what_is_open_before_leaving_the_group() -> None:
    kafka = new_kafka()
    fill(kafka, 1, 2)

    async def body(s: ExactlyOnce) -> None:
        batch = await take(s)
        await s.send(batch, echo(batch))

    run(kafka, body)
    assert seen(kafka) == [b"p1-0", b"p1-1"]
    assert kafka.committed(GROUP, TOPIC) == {1: 2}
    assert consumer_of_all_seeks(kafka) == []


def test_the_clients_are_configured_for_exactly_once() -> None:
    kafka = new_kafka()

    async def body(s: ExactlyOnce) -> None:
        return None

    run(kafka, body)
    consumer, producer = kafka.consumers[0].config, kafka.producers[0].config
    assert consumer["group.id"] == GROUP and consumer["isolation.level"] == "read_committed"
    assert consumer["enable.auto.commit"] is False and consumer["enable.auto.offset.store"] is False
    assert producer["transactional.id"] == f"{GROUP}-{TOPIC}-w1"
    assert producer["enable.idempotence"] is True and producer["acks"] == "all"


def test_offsets_its_own_producer_left_pending_are_dropped_and_its_partitions_start_where_the_group_committed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Kafka 4.4.0 after the only broker restarted: a transaction of this
    worker's completed without its marker on __consumer_offsets, so its offsets
    stay pending and every stable read of the group is answered UNSTABLE until
    this producer's next marker there; the worker, reading them for a new
    assignment, would wait for ever. It aborts a transaction of its own with
    offsets of the group, which drops them, and goes on from the committed offsets."""
    monkeypatch.setattr(eos, "RELEASE_PENDING_AFTER_S", 0.0)
    kafka = new_kafka()
    fill(kafka, 0, 3)

    async def body(s: ExactlyOnce) -> None:
        await reassigned_after_a_commit(kafka, s, lambda: kafka.offsets_left_pending.add(s.transactional_id))
        assert kafka.offsets_left_pending == set()
        assert kafka.events("abort") == [("abort", s.transactional_id, 0)]  # no record of it, only the marker
        await the_rest_decided_once(kafka, s)

    run(kafka, body)


def test_offsets_another_producer_left_pending_still_stop_the_worker_after_the_bound(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """This worker's abort drops only its own producer's pending offsets: those
    of another (a worker gone for good) still hold the read, which gives up
    after its bound with the remedy in the error, and nothing is taken."""
    monkeypatch.setattr(eos, "RELEASE_PENDING_AFTER_S", 0.0)
    monkeypatch.setattr(eos, "COMMITTED_READ_FOR_S", 0.05)
    kafka = new_kafka()
    fill(kafka, 0, 3)

    async def body(s: ExactlyOnce) -> None:
        s._sleep = lambda _s: None
        kafka.offsets_left_pending.add("fraud-unit-score-transactions-gone")
        kafka.rebalance(GROUP, {consumer_of(kafka, s): {0, 1}})
        with pytest.raises(KafkaException, match="could not be read stable.*kafka-transactions.sh"):
            await take(s)
        assert kafka.events("abort") == [("abort", s.transactional_id, 0)]  # tried once, its own
        assert seen(kafka) == []


def test_offsets_that_hang_as_a_transaction_begins_abandon_it_and_its_records_come_again() -> None:
    kafka = new_kafka()
    fill(kafka, 0, 2)
    kafka.offsets_hang = threading.Event()

    async def body(s: ExactlyOnce) -> None:
        s.offsets_hung_s = 0.2
        batch = await take(s)
        await asyncio.wait_for(s.send(batch, echo(batch)), 5.0)  # given up, not stuck
        assert await s.commit() == [(1, "aborted")]
        assert seen(kafka) == [] and kafka.committed(GROUP, TOPIC) == {}
        kafka.offsets_hang = None
        again = await take(s)
        assert taken(again) == taken(batch)
        await s.send(again, echo(again))
        assert await s.commit() == [(2, "committed")]
        assert seen(kafka) == [b"p0-0", b"p0-1"]

    hung = kafka.offsets_hang
    try:
        run(kafka, body)
    finally:
        hung.set()
    assert len(kafka.producers) == 2


def test_a_transaction_adds_the_gate_groups_offsets_before_its_records_and_the_groups_only_at_its_commit() -> None:
    # The transaction's first request to the coordinator is AddOffsetsToTxn,
    # which librdkafka retries within a few ms if the coordinator is still
    # completing the last transaction (AddPartitionsToTxn: only 20 ms later).
    # Those first offsets are the gate group's: the scoring group's go only
    # at the commit, so they are never pending for a transaction's whole life.
    kafka = new_kafka()
    fill(kafka, 0, 2)
    fill(kafka, 1, 2)
    calls: list[tuple[int, str, dict[int, int]]] = []

    async def body(s: ExactlyOnce) -> None:
        producer = s._producer
        real = producer.send_offsets_to_transaction

        def spy(positions: Any, group_metadata: Any, timeout: Any = None) -> None:
            calls.append((len(producer.txn.records), group_metadata.group, {tp.partition: tp.offset for tp in positions}))
            real(positions, group_metadata, timeout)

        producer.send_offsets_to_transaction = spy
        first = await take(s, 2)
        second = await take(s, 2)
        await s.send(first, echo(first))
        await s.send(second, echo(second))
        assert await s.commit() == [(1, "committed")]
        assert calls[0] == (0, s.gate_group, {0: 0})  # before any record
        assert calls[1] == (4, GROUP, {**first.next_offsets, **second.next_offsets}) and len(calls) == 2
        assert s.gate_group != GROUP and kafka.committed(GROUP, TOPIC) == {0: 2, 1: 2}

    run(kafka, body)


def test_the_gate_group_shares_the_scoring_groups_offsets_partition() -> None:
    # Java's String.hashCode, as the broker places a group; one more partition
    # of __consumer_offsets in every transaction would be one more marker.
    from app.eos import _kafka_group_partition, gate_group

    # Java: "hello".hashCode() == 99162322, "Hello World".hashCode() == -862545276.
    assert _kafka_group_partition("hello", 2**31 - 1) == 99162322
    assert _kafka_group_partition("Hello World", 2**31 - 1) == 862545276
    for group in (GROUP, "fraud-pipeline-score", "ft-worker-6d545bc0fb-score"):
        gate = gate_group(group)
        assert gate.startswith(f"{group}-gate")
        for partitions in (1, 8, 50, 200):
            assert _kafka_group_partition(gate, partitions) == _kafka_group_partition(group, partitions)


# -- handover: no transaction of this producer left hanging on a partition it no longer writes --


def placed(batch: TakenBatch) -> list[tuple[str, int, bytes | None, bytes, list[tuple[str, bytes]]]]:
    """One output record per input record, on the partition numbered as its input's (as decisions are)."""
    return [(OUT, m.partition(), m.key(), m.value(), []) for m in batch.messages]


def handovers(kafka: FakeKafka) -> list[int]:
    """The partitions of OUT that show a handover record, one entry per record."""
    return [m.partition() for m in kafka.visible(OUT) if dict(m.headers() or ()).get(eos.HANDOVER_HEADER) == b""]


def test_decisions_behind_a_transaction_left_hanging_by_the_partitions_last_owner_become_visible() -> None:
    """Kafka 4.4.0 skipped the commit marker of w1's transaction on partition 1
    of the output (the only broker restarted); partition 1 then moved to w2,
    whose decisions there stayed unseen behind w1's records, until w1 handed
    the partition over: its handover record's commit marker ends the hang."""
    kafka = FakeKafka({TOPIC: 2, OUT: 2})
    fill(kafka, 1, 2)

    async def body(a: ExactlyOnce) -> None:
        b = stream(kafka, "w2", OUT)
        try:
            batch = await take(a)
            kafka.skip_marker.add((OUT, 1))
            await a.send(batch, [], placed(batch))
            assert await a.commit() == [(1, "committed")]
            assert seen(kafka) == []  # hanging: the commit's marker never reached the partition
            await b.start()  # joins: partition 1 moves to it
            assert (await take(a)).messages == []  # the revocation, inside consume
            await joined(b)
            fill(kafka, 1, 1)
            mine = await take(b)
            assert taken(mine) == [(1, 2)]
            await b.send(mine, [], placed(mine))
            assert await b.commit() == [(1, "committed")]
            assert seen(kafka) == []  # w2's decision, behind w1's hanging records
            await take(a)  # w1's next take hands partition 1 over
            assert seen(kafka) == [b"p1-0", b"p1-1", b"p1-2", b""]
            assert handovers(kafka) == [1]
            await take(a)
            assert handovers(kafka) == [1]  # once
        finally:
            await b.close()

    run(kafka, body, handover_topic=OUT)


def test_a_busy_worker_hands_over_a_partition_it_gave_up_before_its_next_transaction() -> None:
    """Under steady load every take comes with the last batch's transaction
    open (the loop commits after it takes, then sends): the partition given up
    is handed over when the next transaction begins, not at a take."""
    kafka = FakeKafka({TOPIC: 2, OUT: 2})
    fill(kafka, 0, 2)
    fill(kafka, 1, 2)

    async def body(a: ExactlyOnce) -> None:
        b = stream(kafka, "w2", OUT)
        try:
            batch = await take(a)
            await a.send(batch, [], placed(batch))
            await b.start()
            fill(kafka, 0, 1)
            batch = await take(a)  # partition 1 revoked inside: the open transaction commits
            await joined(b)
            for _ in range(3):  # take, commit, send: as ScoringLoop.step under load
                fill(kafka, 0, 1)
                await a.send(batch, [], placed(batch))
                batch = await take(a)
                assert a.open_since is not None
                await a.commit()
            assert handovers(kafka) == [1]
        finally:
            await b.close()

    run(kafka, body, handover_topic=OUT)


def test_a_starting_worker_hands_over_every_partition_before_its_first_take_and_only_then() -> None:
    """A worker restarted (kill -9) after a broker restart left its earlier
    life's records hanging where it may no longer write: each partition of the
    output gets one handover record before the worker takes anything."""
    kafka = FakeKafka({TOPIC: 2, OUT: 2})
    fill(kafka, 0, 1)

    async def go() -> None:
        s = stream(kafka, "w1", OUT)
        await s.start()
        try:
            await s.hand_over(range(2))
            await s.join(100, 1.0)
            assert handovers(kafka) == [0, 1]
            batch = await take(s)
            await s.send(batch, [], placed(batch))
            await s.commit()
            await take(s)
            assert handovers(kafka) == [0, 1]
            assert [m.value() for m in kafka.visible(OUT)] == [b"", b"p0-0", b""]
        finally:
            await s.close()

    asyncio.run(go())


def test_a_handover_that_fails_is_tried_again_and_shows_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(eos, "HANDOVER_RETRY_S", 0.0)
    kafka = FakeKafka({TOPIC: 2, OUT: 3})  # 2: a partition this worker does not own
    kafka.commit_errors.append(error(KafkaError._TIMED_OUT, abortable=True))

    async def body(s: ExactlyOnce) -> None:
        await s.hand_over([2])
        await take(s)  # tries, and fails: aborted
        assert handovers(kafka) == [] and kafka.events("abort") == [("abort", s.transactional_id, 1)]
        await take(s)
        assert handovers(kafka) == [2]
        await take(s)
        assert handovers(kafka) == [2]

    run(kafka, body, handover_topic=OUT)


def test_without_a_handover_topic_a_revocation_writes_nothing() -> None:
    kafka = new_kafka()
    fill(kafka, 1, 1)

    async def body(a: ExactlyOnce) -> None:
        b = stream(kafka, "w2")
        await b.start()
        try:
            assert (await take(a)).messages == []  # partition 1 revoked
            await take(a)
        finally:
            await b.close()

    run(kafka, body)
    assert kafka.events("commit") == [] and kafka.visible(OUT) == []


def test_a_handover_commit_that_fails_retriably_is_retried_and_not_aborted() -> None:
    """An abort would end a hanging transaction of this producer aborted (its
    records dropped): a retriable commit error is asked again instead."""
    kafka = FakeKafka({TOPIC: 2, OUT: 3})
    kafka.commit_errors.append(error(KafkaError._TIMED_OUT, retriable=True))

    async def body(s: ExactlyOnce) -> None:
        await s.hand_over([2])
        await take(s)
        assert handovers(kafka) == [2] and kafka.events("abort") == []

    run(kafka, body, handover_topic=OUT)
