"""At-least-once consume on librdkafka: an offset is committed only once the
caller has processed its record.

The feedback loop (agents/feedback.py) reads ``feedback`` and ``labels``
through it into the live-quality join, whose writes are idempotent
(pipeline/quality.py: a decision counts once by its transaction id, a label
overwrites the one before). Reading a record twice costs nothing there;
skipping one loses a label from live quality for good. The merchant tally
(agents/tally.py) counts ``labels`` through it too; a label read twice counts
once there as well (each share remembers its last labels).

NOTE: faust's stream, which read them before, commits offsets it never handed
to an agent. Records it drops while a rebalance is under way, or acks
unprocessed because their generation is stale, count as processed, and the
gap bookkeeping fills the holes before them (RELIABILITY.md, known gaps 1
and 6). After a broker of the 3-node stack was lost, live quality joined
1,795 of 1,800 labels, with every offset of both topics committed.

How: auto-commit on and the offset store off. librdkafka commits what is
*stored*: every ``auto.commit.interval.ms``, and on close. :meth:`AtLeastOnce.done`
stores a batch's offsets, and the caller calls it only once the batch is
processed. A partition may move while a batch is in hand (librdkafka runs the
rebalance): its next owner starts at the last commit, at or before that
batch, so the batch is read twice, never skipped, and this worker's late
store for a partition it no longer holds is refused and dropped.

Every call into librdkafka runs on one thread of its own, in order, so the
event loop is never blocked while the broker answers.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

__all__ = ["AtLeastOnce", "last_offsets"]

log = logging.getLogger(__name__)

#: How often librdkafka commits the stored offsets. Off the decision path: a
#: commit a second keeps the group's lag (what an operator watches) current
#: and costs the broker one request a second.
COMMIT_EVERY_MS = 1000


#: How long a stopping worker waits for the consumer's close (its last commit,
#: then LeaveGroup). NOTE: both go to the group coordinator, and librdkafka's
#: close waits for a coordinator just lost (a broker killed) as long as it
#: takes to find the next: a stopping worker could outlast the grace its
#: supervisor gives it (15 s in the fault tests) on this alone.
CLOSE_WITHIN_S = 5.0


def _kafka() -> Any:
    import confluent_kafka

    return confluent_kafka


def last_offsets(records: Sequence[Any]) -> dict[tuple[str, int], int]:
    """The offset to commit per (topic, partition) after ``records``: one past
    the highest offset read of each (records carrying an error have none)."""
    last: dict[tuple[str, int], int] = {}
    for record in records:
        if record.error() is not None:
            continue
        key = (record.topic(), record.partition())
        last[key] = max(last.get(key, -1), record.offset() + 1)
    return last


class AtLeastOnce:
    """A group consumer of ``topics`` whose offsets move only past processed records."""

    def __init__(
        self,
        *,
        topics: Sequence[str],
        group_id: str,
        client_config: dict[str, object],
        session_timeout_ms: int = 6000,
        heartbeat_interval_ms: int = 1500,
        consumer_factory: Callable[[dict[str, object]], Any] | None = None,
    ) -> None:
        self.topics = list(topics)
        self.group_id = group_id
        self._config: dict[str, object] = {
            **client_config,
            "group.id": group_id,
            "enable.auto.commit": True,
            "auto.commit.interval.ms": COMMIT_EVERY_MS,
            "enable.auto.offset.store": False,  # stored by done(), after processing
            "auto.offset.reset": "earliest",
            # A transactional topic's aborted records are not records at all.
            "isolation.level": "read_committed",
            "session.timeout.ms": session_timeout_ms,
            "heartbeat.interval.ms": heartbeat_interval_ms,
            "queued.max.messages.kbytes": 8192,
            # As the scoring group's (app/eos.py): a member rejoining after the
            # group coordinator moved gives up no partition.
            "partition.assignment.strategy": "cooperative-sticky",
        }
        self._factory = consumer_factory or (lambda c: _kafka().Consumer(c))
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"at-least-once-{group_id}")
        self._consumer: Any = None

    async def _call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._thread, lambda: fn(*args, **kwargs))

    async def start(self) -> None:
        """Create the consumer and subscribe; the group is joined at the first :meth:`take`."""
        self._consumer = await self._call(self._factory, self._config)
        await self._call(self._consumer.subscribe, self.topics)

    async def take(self, max_records: int, within_s: float) -> list[Any]:
        """Up to ``max_records`` records, waiting at most ``within_s`` for them;
        records carrying an error are logged and left out."""
        got = await self._call(self._consumer.consume, max_records, within_s)
        records = []
        for record in got:
            error = record.error()
            if error is None:
                records.append(record)
            else:
                log.warning("%s: %s", self.group_id, error)
        return records

    async def ends(self, topic: str) -> dict[int, int]:
        """The high watermark of each partition of ``topic``, asked of the broker now."""
        ends: dict[int, int] = await self._call(self._ends, topic)
        return ends

    def _ends(self, topic: str) -> dict[int, int]:
        kafka = _kafka()
        meta = self._consumer.list_topics(topic, 10.0).topics.get(topic)
        if meta is None or meta.error is not None:
            raise kafka.KafkaException(meta.error if meta is not None else f"{topic}: no such topic")
        marks = {p: self._consumer.get_watermark_offsets(kafka.TopicPartition(topic, p), 10.0, cached=False)
                 for p in meta.partitions}  # fmt: skip
        return {p: high for p, (_, high) in marks.items()}

    async def done(self, records: Sequence[Any]) -> None:
        """Mark ``records`` processed: their offsets are committed from now on."""
        last = last_offsets(records)
        if last:
            await self._call(self._store, last)

    def _store(self, last: dict[tuple[str, int], int]) -> None:
        kafka = _kafka()
        for (topic, partition), offset in last.items():
            try:
                self._consumer.store_offsets(offsets=[kafka.TopicPartition(topic, partition, offset)])
            except kafka.KafkaException as exc:
                # No longer assigned (the group session was lost while the batch
                # was processed): its next owner reads the batch again.
                log.info("%s: offset %d of %s[%d] not stored (%s)", self.group_id, offset, topic, partition, exc)

    async def close(self) -> None:
        """Commit what is stored, leave the group and stop the client's thread,
        waiting at most :data:`CLOSE_WITHIN_S` for it."""
        if self._consumer is not None:
            try:
                await asyncio.wait_for(self._call(self._consumer.close), CLOSE_WITHIN_S)
            except TimeoutError:
                # What was not committed is read again by the partitions' next
                # owners, once the group's session of this member has expired.
                log.warning("%s: leaving the group took over %.0f s; not waited for", self.group_id, CLOSE_WITHIN_S)
            finally:
                self._consumer = None
        self._thread.shutdown(wait=False)
