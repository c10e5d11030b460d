"""Restoring the resend index of newly owned partitions from its changelog.

Called on the scoring consumer's thread, inside its assignment callback
(app/eos.py), so no record of a partition is fetched, let alone decided,
before the partition's index is complete: its changelog partition (of
``decisions``, pipeline/resend_index.py) is read ``read_committed`` from
where this worker's store last restored it (else from the first record of
the last ``history_s``: what is older has expired) to its end.

"Its end" is the high watermark when the restore began, not the first end
the reader meets: a transaction still open on the changelog (the previous
owner's, if it lost the partition while committing, or a zombie's) holds
the readable end (the last stable offset) below it until that transaction
commits or aborts. Stopping there would miss the decisions of a commit that
completes a moment later, whose offsets the new owner then starts after:
their resends would be decided again. So the restore waits for every
transaction that was open when it began (the broker aborts one after the
transaction timeout at the latest; the new owner's committed offsets wait
for it too).

But not forever: a transaction whose markers the broker never wrote stays
"open" for good (a *hanging* transaction: seen on Kafka 4.4.0 when the only
broker was killed and restarted, the markers of transactions caught by the
kill left out of some partitions). Past ``HANGING_AFTER_S`` at the same last
stable offset, the restore logs an error naming the partition and offset and
ends there: the partition's records are decided from then on, its resend
index short only of the entries behind the hanging transaction, instead of
never. An operator aborts it with ``kafka-transactions.sh find-hanging`` and
``abort`` (RELIABILITY.md).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from typing import Any, Protocol

__all__ = ["ChangelogRestore", "RestoredState"]

log = logging.getLogger(__name__)

#: How many records one read takes, and how long it waits for them. NOTE: a
#: read returns early only with READ_RECORDS in hand: a longer wait would hold
#: up every small restore (the end is reached, the read still waits).
READ_RECORDS = 10_000
READ_WAIT_S = 0.05
#: How long a restore that fails (the changelog unreadable) is tried again, and how often.
RETRY_FOR_S = 60.0
RETRY_EVERY_S = 0.5
#: A restore still waiting after this logs that it waits (and what for), every time again.
WAITING_LOG_S = 5.0
#: How long a partition may sit at the same last stable offset, short of its
#: end, before the transaction holding it there is taken for a hanging one:
#: the broker aborts a live one after its timeout (10 s, app/eos.py), found
#: by a check every ``transaction.abort.timed.out.transaction.cleanup.interval.ms``
#: (10 s by default), and writes its markers: 20 s, and half as much again.
HANGING_AFTER_S = 30.0


#: (value, headers, timestamp in seconds): one changelog record as a restore hands it on.
Record = tuple[bytes | None, list[tuple[str, bytes]] | None, float]


class RestoredState(Protocol):
    """What a changelog restores (pipeline.resend_index.ResendIndex)."""

    def restore(self, records: Iterable[Record], topic: str, restored_to: dict[int, int] | None = None) -> int:
        """Apply (value, headers, timestamp) records and note how far each partition of ``topic`` was read; returns entries kept."""
        ...

    def restored_to(self, topic: str, partition: int) -> int | None:
        """The offset ``topic``'s ``partition`` was last restored up to, if ever."""
        ...


def _kafka() -> Any:
    import confluent_kafka

    return confluent_kafka


class ChangelogRestore:
    """Restore ``index`` for newly assigned partitions from ``topic``."""

    def __init__(
        self,
        topic: str,
        index: RestoredState,
        client_config: dict[str, object],
        *,
        group_id: str,
        consumer_factory: Callable[[dict[str, object]], Any] | None = None,
        hanging_after_s: float = HANGING_AFTER_S,
        history_s: float | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        """``history_s``: how far back a partition is read at most (None: from its start)."""
        self.topic = topic
        self.index = index
        self.hanging_after_s = hanging_after_s
        self.history_s = history_s
        self._clock = clock
        self._config: dict[str, object] = {
            **client_config,
            # Required by the client; nothing is committed and no group is joined (assign, not subscribe).
            "group.id": group_id,
            "enable.auto.commit": False,
            "isolation.level": "read_committed",
            "enable.partition.eof": True,
            "auto.offset.reset": "earliest",
            # NOTE: the end is known from a fetch that comes back empty; at the
            # default 500 ms that wait was most of a small restore.
            "fetch.wait.max.ms": 10,
        }
        self._consumer_factory = consumer_factory or (lambda c: _kafka().Consumer(c))
        #: Called while a restore goes on (the loop's watchdog: a long restore is not a stuck loop).
        self.on_progress: Callable[[], None] = lambda: None
        #: Told (partitions, entries, seconds) after each restore.
        self.on_restored: Callable[[set[int], int, float], None] = lambda *_: None

    def __call__(self, partitions: set[int]) -> None:
        """Restore ``partitions``; returns when each is read to its end.
        Tried again while the changelog cannot be read (a broker lost: its
        partitions' leaders move), for up to ``RETRY_FOR_S``; then raises."""
        if not partitions:
            return
        kafka = _kafka()
        deadline = time.monotonic() + RETRY_FOR_S
        while True:
            try:
                self._restore(partitions)
                return
            except kafka.KafkaException as exc:
                if time.monotonic() > deadline:
                    raise
                log.warning("restoring the resend index of partitions %s failed (%s); trying again",
                            sorted(partitions), exc)  # fmt: skip
                self.on_progress()
                time.sleep(RETRY_EVERY_S)

    def _restore(self, partitions: set[int]) -> None:
        started = time.monotonic()
        kafka = _kafka()
        # NOTE: the end asked by a read_committed client is the last stable
        # offset, which an open transaction holds back: the high watermark
        # is asked by a read_uncommitted one (it reads nothing).
        ends = self._consumer_factory({**self._config, "isolation.level": "read_uncommitted"})
        try:
            marks = {p: ends.get_watermark_offsets(kafka.TopicPartition(self.topic, p), 10.0) for p in partitions}
        finally:
            ends.close()
        consumer = self._consumer_factory(self._config)
        try:
            since = self._since(consumer, partitions, marks)
            targets: dict[int, int] = {}
            starts = []
            for p in sorted(partitions):
                low, high = marks[p]
                start = max(low, since.get(p, 0), self._restored_to(p, high) or 0)
                if start < high:
                    targets[p] = high
                    starts.append(kafka.TopicPartition(self.topic, p, start))
            entries = self._read(consumer, starts, targets) if targets else 0
        finally:
            consumer.close()
        took = time.monotonic() - started
        log.info("resend index of partitions %s restored: %d entries in %.2f s", sorted(partitions), entries, took)
        self.on_restored(partitions, entries, took)

    def _since(self, consumer: Any, partitions: set[int], marks: dict[int, tuple[int, int]]) -> dict[int, int]:
        """Per partition, its first offset of the last ``history_s`` (its end
        when it has none that recent): where a restore starts at the earliest."""
        if self.history_s is None:
            return {}
        kafka = _kafka()
        at_ms = int((self._clock() - self.history_s) * 1000)
        found = consumer.offsets_for_times([kafka.TopicPartition(self.topic, p, at_ms) for p in sorted(partitions)], 10.0)
        out = {}
        for tp in found:
            if tp.error is not None:
                raise kafka.KafkaException(tp.error)
            # -1: no record at or after that time.
            out[tp.partition] = tp.offset if tp.offset >= 0 else marks[tp.partition][1]
        return out

    def _restored_to(self, partition: int, high: int) -> int | None:
        """How far this store restored ``partition`` before, if that is still
        a place in the partition: past its end, the topic was deleted and
        created again under its name (or lost records), so what the store
        remembers counts offsets of another log, and the partition is read
        from its start."""
        done = self.index.restored_to(self.topic, partition)
        if done is not None and done > high:
            log.warning(
                "the resend index was restored up to offset %d of %s partition %d, past its end %d: the topic "
                "was created again (or lost records); restoring the partition from its start",
                done, self.topic, partition, high,
            )  # fmt: skip
            return None
        return done

    def _read(self, consumer: Any, starts: list[Any], targets: dict[int, int]) -> int:
        kafka = _kafka()
        consumer.assign(starts)
        pending = dict(targets)
        entries = 0
        waiting_since = time.monotonic()
        #: Per partition short of its end: the last stable offset it stopped at, and since when.
        held: dict[int, tuple[int, float]] = {}
        while pending:
            records = []
            done: dict[int, int] = {}
            for msg in consumer.consume(READ_RECORDS, READ_WAIT_S):
                err = msg.error()
                if err is None:
                    ts_type, ts_ms = msg.timestamp()
                    records.append((msg.value(), msg.headers(), ts_ms / 1000.0 if ts_type else time.time()))
                    held.pop(msg.partition(), None)
                elif err.code() == kafka.KafkaError._PARTITION_EOF:
                    p = msg.partition()
                    if p in pending and msg.offset() >= pending[p]:
                        done[p] = msg.offset()
                    elif p in pending and held.get(p, (None, 0.0))[0] != msg.offset():
                        held[p] = (msg.offset(), time.monotonic())
                else:
                    raise kafka.KafkaException(err)
            for p, (offset, since) in held.items():
                if p in pending and p not in done and time.monotonic() - since > self.hanging_after_s:
                    log.error(
                        "restoring the resend index of partition %d: a transaction has held %s at offset %d for "
                        "%.0f s, longer than any live transaction lasts: a hanging transaction (its markers never "
                        "written). Restored up to it; find and abort it with kafka-transactions.sh find-hanging "
                        "and abort, or the partition's next owner waits for it again",
                        p, self.topic, offset, time.monotonic() - since,
                    )  # fmt: skip
                    done[p] = offset
            for p in done:
                del pending[p]
                held.pop(p, None)
            # Entries and how far they go in one write: a crash between the two cannot skip entries.
            entries += self.index.restore(records, self.topic, done)
            self.on_progress()
            if pending and time.monotonic() - waiting_since > WAITING_LOG_S:
                log.warning(
                    "restoring the resend index of partitions %s: still short of their end %s "
                    "(a transaction open on %s holds it back until it commits or aborts)",
                    sorted(pending), pending, self.topic,
                )  # fmt: skip
                waiting_since = time.monotonic()
        return entries
