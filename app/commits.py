"""The scoring agent's own offset commits for `transactions` (why: app/offsets.py).

Talks to faust's aiokafka consumer, which lives on a thread of its own: every
call to it goes through that thread (``call_thread``), as faust's own calls do.
The bookkeeping itself is :class:`app.offsets.PartitionProgress`.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from aiokafka.structs import OffsetAndMetadata, TopicPartition

from app.offsets import Admitted, PartitionProgress, event_position

__all__ = ["TransactionCommits", "untrack_read_offsets"]

log = logging.getLogger(__name__)


class TransactionCommits:
    """Offsets of one topic, decided and committed by the agent, not by faust's acks."""

    def __init__(self, app: Any, topic: str, stall_after_s: float = 5.0) -> None:
        self.app = app
        self.topic = topic
        self.stall_after_s = stall_after_s
        #: Called with "hole" or "quiet" at each seek back (the worker's metrics count them).
        self.on_reseek: Callable[[str], None] | None = None
        self.progress: PartitionProgress[Any] = PartitionProgress()
        # Partitions assigned but whose committed offsets are not read yet: read
        # by the agent before its next batch, outside faust's rebalance callback.
        self._pending_assignment: set[Any] | None = None

    # --- rebalance signals (faust's app.on_partitions_revoked / _assigned) ----------------------

    async def on_revoked(self, revoked: Iterable[Any]) -> None:
        generation = self.progress.generation
        pending = self.progress.revoke()
        self._pending_assignment = None
        if pending:
            # The batches decided since the last commit: their next owner starts here.
            await self._commit(pending, generation, why="revoked")

    async def on_assigned(self, assigned: Iterable[Any]) -> None:
        self.progress.revoke()  # nothing of an earlier assignment survives
        self._pending_assignment = {tp for tp in assigned if tp.topic == self.topic}

    # --- the agent's side ---------------------------------------------------------------------

    async def admit(self, events: Sequence[Any]) -> Admitted[Any, Any]:
        """The events to score now; seeks partitions back over records that never arrived."""
        if self._pending_assignment is not None:
            tps, self._pending_assignment = self._pending_assignment, None
            positions = await self._read_positions(tps)
            self.progress.assign(positions)
            log.info("deciding %s from offsets %s", self.topic, _fmt(positions))
        admitted = self.progress.admit(events, event_position, time.monotonic())
        for tp, offset in admitted.rewind.items():
            first = min(o for t, o in map(event_position, events) if t == tp and o > offset)
            log.warning(
                "partition %s: offset %d arrived while %d was next (records in between did not reach the "
                "agent); seeking back to %d", tp.partition, first, offset, offset,
            )  # fmt: skip
            await self._reseek(tp, offset, "hole")
        return admitted

    def done(self, admitted: Admitted[Any, Any]) -> None:
        """The batch's outcomes are delivered: its partitions move on."""
        self.progress.done(admitted, event_position)

    async def tick(self) -> None:
        """Every ``FRAUD_COMMIT_INTERVAL_S``: re-seek stalled rewinds and stalled
        partitions, commit what moved."""
        now = time.monotonic()
        for tp, offset in self.progress.stalled_rewinds(now).items():
            log.warning("partition %s: still waiting for offset %d; seeking back to it again", tp.partition, offset)
            await self._reseek(tp, offset, "hole")
        if self._pending_assignment is None and self._flowing():
            for tp, offset in self.progress.stalled(now, self._highwater, self.stall_after_s).items():
                # NOTE: a seek is enough: in every stall seen, faust still had the
                # partition active and aiokafka's position was at the log end
                # (the records were dropped inside faust), so nothing to resume.
                log.warning(
                    "partition %s: nothing decided from offset %d for %.0f s while its log reaches %s "
                    "(fetch state: %s); seeking back to %d",
                    tp.partition, offset, self.stall_after_s, self._highwater(tp), self._fetch_state(tp), offset,
                )  # fmt: skip
                await self._reseek(tp, offset, "quiet")
        await self.commit()

    async def _reseek(self, tp: Any, offset: int, reason: str) -> None:
        await self.app.consumer.seek(tp, offset)
        if self.on_reseek is not None:
            self.on_reseek(reason)

    async def commit(self) -> None:
        """Commit what moved (a timer calls this every ``FRAUD_COMMIT_INTERVAL_S``, and the agent at stop)."""
        offsets = self.progress.uncommitted()
        if offsets:
            await self._commit(offsets, self.progress.generation, why="interval")

    # --- the stall watchdog's view of faust's consumer (faust-streaming 0.15.3 internals) --------

    def _flowing(self) -> bool:
        """Not in a rebalance or recovery: faust pauses and resumes partitions then."""
        consumer = self.app.consumer
        return bool(getattr(consumer, "flow_active", True)) and not getattr(self.app, "rebalancing", False)

    def _highwater(self, tp: Any) -> int | None:
        try:
            return self.app.consumer.highwater(tp)
        except Exception:  # consumer not started or partition unknown
            return None

    def _fetch_state(self, tp: Any) -> str:
        """Where a partition may be held back: faust's active/paused/buffered
        sets (its fetcher asks aiokafka only for active ones) and aiokafka's state."""
        consumer = self.app.consumer
        parts = [
            f"faust active={tp in (consumer._active_partitions or ())}",
            f"paused={tp in consumer._paused_partitions}",
            f"buffered={tp in consumer._buffered_partitions}",
        ]
        try:
            _, kafka = self._thread_and_consumer()
            state = kafka._subscription.subscription.assignment.state_value(TopicPartition(tp.topic, tp.partition))
            parts.append(
                f"aiokafka paused={state.paused} position={state.position if state.has_valid_position else None}"
            )
            parts.append(f"buffered_fetch={TopicPartition(tp.topic, tp.partition) in kafka._fetcher._records}")
        except Exception as exc:  # diagnostics only
            parts.append(f"aiokafka state unknown ({exc!r})")
        return ", ".join(parts)

    # --- consumer I/O ---------------------------------------------------------------------------

    def _thread_and_consumer(self) -> tuple[Any, Any]:
        thread = self.app.consumer._thread
        return thread, thread._ensure_consumer()

    async def _read_positions(self, tps: set[Any]) -> dict[Any, int]:
        """The group's committed offset of each partition, else the log start
        (``auto_offset_reset=earliest``)."""
        thread, consumer = self._thread_and_consumer()

        async def read() -> dict[Any, int]:
            out: dict[Any, int] = {}
            missing = []
            for tp in tps:
                offset = await consumer.committed(TopicPartition(tp.topic, tp.partition))
                if offset is None or offset < 0:
                    missing.append(tp)
                else:
                    out[tp] = offset
            if missing:
                starts = await consumer.beginning_offsets([TopicPartition(t.topic, t.partition) for t in missing])
                for tp in missing:
                    out[tp] = starts[TopicPartition(tp.topic, tp.partition)]
            return out

        return await thread.call_thread(read)

    async def _commit(self, offsets: Mapping[Any, int], generation: int, why: str) -> bool:
        thread, consumer = self._thread_and_consumer()
        request = {TopicPartition(tp.topic, tp.partition): OffsetAndMetadata(n, "") for tp, n in offsets.items()}
        try:
            await thread.call_thread(consumer.commit, request)
        except Exception as exc:
            # Not fatal: the offsets stay uncommitted and are retried; after a
            # rebalance their next owner decides them again (duplicates, not loss).
            log.warning("committing %s (%s) failed: %r", _fmt(offsets), why, exc)
            return False
        self.progress.committed(offsets, generation)
        log.debug("committed %s (%s)", _fmt(offsets), why)
        return True


def _fmt(offsets: Mapping[Any, int]) -> str:
    return ", ".join(f"{tp.partition}:{n}" for tp, n in sorted(offsets.items(), key=lambda kv: kv[0].partition))


class _ReadOffsets(defaultdict):  # type: ignore[type-arg]
    """faust's per-partition "read up to here" map, blind to one topic.

    faust drops a fetched record whose offset is below the last one it
    delivered for the partition. After a seek back, records fetched before the
    seek (later offsets) arrive first, so faust dropped every re-read record up
    to them: the rewind never took (measured: 6 s of failed seeks, then loss).
    The agent orders and de-duplicates `transactions` itself, so for that
    topic faust is told it has read nothing and delivers everything.
    """

    def __init__(self, topic: str) -> None:
        super().__init__(lambda: None)
        self.topic = topic

    def __getitem__(self, tp: Any) -> Any:
        if tp.topic == self.topic:
            return None
        return super().__getitem__(tp)

    def __setitem__(self, tp: Any, offset: Any) -> None:
        if tp.topic != self.topic:
            super().__setitem__(tp, offset)


def untrack_read_offsets(app: Any, topic: str) -> None:
    """Make the consumer faust builds for ``app`` deliver every record of ``topic``
    (see :class:`_ReadOffsets`). NOTE: faust-streaming 0.15.3 internals
    (``Consumer._read_offset``, read once when its fetch loop starts)."""
    build = app._new_consumer

    def _new_consumer() -> Any:
        consumer = build()
        consumer._read_offset = _ReadOffsets(topic)
        return consumer

    app._new_consumer = _new_consumer
