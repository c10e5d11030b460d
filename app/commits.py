"""The scoring agent's offsets of `transactions`: read at assignment, committed
inside each batch's Kafka transaction (app/transactional.py), never by faust.

Talks to faust's aiokafka consumer, which lives on a thread of its own: every
call to it goes through that thread, as faust's own calls do. Every reach into
faust's or aiokafka's internals is a seam of :mod:`app.seams`. The bookkeeping
itself is :class:`app.offsets.PartitionProgress`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from aiokafka import AIOKafkaConsumer
from aiokafka.structs import TopicPartition

from app import seams
from app.offsets import Admitted, PartitionProgress, event_position
from app.transactional import Fenced, PartitionBatch, TransactionalEmitter

__all__ = ["TransactionCommits"]

log = logging.getLogger(__name__)

#: How long a new owner waits for the previous owner's open transaction to end
#: before its offsets can be read (the broker aborts it after the transaction
#: timeout, app/transactional.py); past it the assignment is tried again.
STABLE_OFFSETS_GIVE_UP_S = 30.0

#: Attempts at a partition's transaction before the worker exits (code 75)
#: without committing, so that the batch is consumed again after a restart.
COMMIT_ATTEMPTS = 5


class TransactionCommits:
    """Offsets of one topic, decided by the agent and committed in its transactions."""

    def __init__(
        self,
        app: Any,
        topic: str,
        emitter: TransactionalEmitter,
        topics: dict[str, str],
        stall_after_s: float = 5.0,
        consumer_options: Mapping[str, Any] | None = None,
        sign_decisions: Any = None,
    ) -> None:
        self.app = app
        self.topic = topic
        self.emitter = emitter
        #: ``decisions``/``dead_letters``/``feedback``/``monitoring`` -> topic name.
        self.topics = topics
        self.stall_after_s = stall_after_s
        #: Signs each decision (pipeline/decision_signing.py): ``headers(value)`` -> Kafka headers.
        self.sign_decisions = sign_decisions
        self._consumer_options = dict(consumer_options or {})
        #: Called with "hole", "quiet" or "markers" at each seek (the worker's metrics count them).
        self.on_reseek: Callable[[str], None] | None = None
        self.progress: PartitionProgress[Any] = PartitionProgress()
        # Partitions assigned but whose committed offsets are not read yet: read
        # by the agent before its next batch, outside faust's rebalance callback.
        self._pending_assignment: set[Any] | None = None
        #: (generation id, member id) of that assignment, under transaction scope ``batch``.
        self._pending_membership: tuple[int, str] | None = None
        #: A group-less consumer of our own that reads the log where a hole appeared.
        self._reader: AIOKafkaConsumer | None = None

    # --- rebalance signals (faust's app.on_partitions_revoked / _assigned) ----------------------

    async def on_revoked(self, revoked: Iterable[Any]) -> None:
        # Nothing to commit: every decided batch committed its offsets with its
        # outcomes. A batch in flight either commits before the next owner
        # starts its producer, or is fenced and decided again by that owner.
        self.progress.revoke()
        self._pending_assignment = None

    async def on_assigned(self, assigned: Iterable[Any]) -> None:
        self.progress.revoke()  # nothing of an earlier assignment survives
        self._pending_assignment = {tp for tp in assigned if tp.topic == self.topic}
        if self.emitter.scope == "batch":  # the generation every offset of this assignment is committed in
            self._pending_membership = seams.group_membership(self.app)

    # --- the agent's side ---------------------------------------------------------------------

    async def admit(self, events: Sequence[Any]) -> Admitted[Any, Any]:
        """The events to score now; seeks partitions back over records that never arrived."""
        tps = self._pending_assignment
        if tps is not None:
            # First fence the previous owners (scope "partition": a new producer
            # epoch per partition), then read the offsets, waiting out any open
            # transaction that holds some (require_stable): whatever they
            # committed is in them by then. If either fails, the assignment
            # stays pending for the next batch, and this one admits nothing (its
            # records are read again: once assigned, the first record past the
            # committed offset is a hole, sought back to).
            try:
                await self.emitter.assign((tp.partition for tp in tps), self._pending_membership)
                positions = await self._read_positions(tps)
            except Exception as exc:
                log.warning(
                    "partitions %s: not taken over yet (%r); trying again with the next batch", _fmt_tps(tps), exc
                )
            else:
                if self._pending_assignment is tps:  # no newer rebalance meanwhile
                    self._pending_assignment = None
                    self.progress.assign(positions)
                    log.info("deciding %s from offsets %s", self.topic, _fmt(positions))
        admitted = self.progress.admit(events, event_position, time.monotonic())
        holes = {tp: (offset, min(o for t, o in map(event_position, events) if t == tp and o > offset))
                 for tp, offset in admitted.rewind.items()}  # fmt: skip
        for tp, (expected, seen) in {**holes, **admitted.verify}.items():
            await self._check_hole(tp, expected, seen, repeated=tp in admitted.verify)
        return admitted

    async def commit(self, admitted: Admitted[Any, Any], output: Any) -> set[int]:
        """Produce the batch's outcomes and commit its offsets, one transaction
        per input partition; the partitions that committed move on, and their
        numbers are returned.

        A partition this worker was fenced from is dropped until the next
        assignment (its new owner decides the batch). A transaction that fails
        otherwise is aborted and retried with the same records; after
        ``COMMIT_ATTEMPTS`` the process exits without committing, and the batch
        is consumed again after the restart (or by the partition's next owner).
        """
        ends: dict[Any, int] = {}
        for event in admitted.events:
            tp, offset = event_position(event)
            ends[tp] = max(ends.get(tp, -1), offset + 1)
        by_number = {tp.partition: tp for tp in ends}
        default = min(by_number)
        records = output.records_by_partition(self.topics, default, self.sign_decisions)
        pending = {p: PartitionBatch(ends[tp], records.get(p, [])) for p, tp in by_number.items()}
        delay = 0.1
        committed: set[int] = set()
        for attempt in range(1, COMMIT_ATTEMPTS + 1):
            results = await self.emitter.commit(pending)
            done = {by_number[p]: pending[p].next_offset for p, r in results.items() if r is None}
            committed.update(tp.partition for tp in done)
            fenced = [by_number[p] for p, r in results.items() if isinstance(r, Fenced)]
            if done:
                self.progress.done(admitted, event_position, only=set(done))
                self.progress.committed(done, admitted.generation)
            if fenced:
                log.warning("fenced from partitions %s: their new owner decides this batch", _fmt_tps(fenced))
                self.progress.forget(fenced)
            failed = {p: r for p, r in results.items() if r is not None and not isinstance(r, Fenced)}
            if not failed:
                return committed
            log.warning(
                "transaction for partitions %s failed (attempt %d/%d): %r",
                sorted(failed), attempt, COMMIT_ATTEMPTS, next(iter(failed.values())),
            )  # fmt: skip
            pending = {p: pending[p] for p in failed}
            await asyncio.sleep(delay)
            delay *= 2
        log.critical("cannot commit decisions; exiting without commit so the batch is consumed again")
        os._exit(75)

    async def tick(self) -> None:
        """Every ``FRAUD_WATCHDOG_INTERVAL_S``: re-seek stalled rewinds and stalled partitions."""
        now = time.monotonic()
        for tp, offset in self.progress.stalled_rewinds(now).items():
            log.warning("partition %s: still waiting for offset %d; seeking back to it again", tp.partition, offset)
            await self._reseek(tp, offset, "hole")
        if self._pending_assignment is None and self._flowing():
            for tp, offset in self.progress.stalled(now, self._highwater, self.stall_after_s).items():
                # NOTE: a seek is enough: in every stall seen, faust still had the
                # partition active and aiokafka's position was at the log end
                # (the records were dropped inside faust), so nothing to resume.
                self._log_stall(tp, offset)
                await self._reseek(tp, offset, "quiet")

    async def close(self) -> None:
        await self.emitter.close()
        if self._reader is not None:
            await self._reader.stop()

    async def _reseek(self, tp: Any, offset: int, reason: str) -> None:
        await self.app.consumer.seek(tp, offset)
        if self.on_reseek is not None:
            self.on_reseek(reason)

    async def _check_hole(self, tp: Any, expected: int, seen: int, *, repeated: bool) -> None:
        """Offset ``seen`` reached the agent while ``expected`` was next: read the
        log at ``expected`` with a reader of our own. Offsets that hold no record
        a ``read_committed`` consumer can see (a transactional producer's commit
        markers, aborted or compacted records) are skipped at once; if a record
        is there, faust did not deliver it, and the partition is sought back to
        it (and checked again if that keeps happening). Nothing is skipped on a
        guess."""
        first = await self._first_readable_offset(tp, expected)
        if first is not None and first > expected:
            log.info(
                "partition %s: offsets %d-%d hold no committed record (transaction markers, aborted or "
                "compacted records); continuing from %d", tp.partition, expected, first - 1, first,
            )  # fmt: skip
            self.progress.skip_to(tp, first)
            await self._reseek(tp, first, "markers")
            return
        if repeated:
            log.error(
                "partition %s: offset %d is in the log but faust has not delivered it after many seeks; "
                "still seeking (nothing is skipped)", tp.partition, expected,
            )  # fmt: skip
        else:
            log.warning(
                "partition %s: offset %d arrived while %d was next (records in between did not reach the "
                "agent); seeking back to %d", tp.partition, seen, expected, expected,
            )  # fmt: skip
        await self._reseek(tp, expected, "hole")

    async def _first_readable_offset(self, tp: Any, offset: int) -> int | None:
        """The offset of the first record at or after ``offset`` that a
        ``read_committed`` consumer gets; None if none came within 2 s or the
        log could not be read (the caller then seeks rather than skips)."""
        part = TopicPartition(tp.topic, tp.partition)
        try:
            if self._reader is None:
                self._reader = AIOKafkaConsumer(
                    **self._consumer_options, enable_auto_commit=False, isolation_level="read_committed"
                )
                await self._reader.start()
            self._reader.assign([part])
            self._reader.seek(part, offset)
            batch = await self._reader.getmany(part, timeout_ms=2000, max_records=1)
        except Exception as exc:
            log.error("partition %s: could not read offset %d to check it (%r)", tp.partition, offset, exc)
            return None
        records = batch.get(part, [])
        return records[0].offset if records else None

    # --- the stall watchdog's view of faust's consumer (through app.seams) ----------------------

    def _flowing(self) -> bool:
        """Not in a rebalance or recovery: faust pauses and resumes partitions then."""
        return seams.consumer_flowing(self.app)

    def _highwater(self, tp: Any) -> int | None:
        try:
            highwater: int | None = self.app.consumer.highwater(tp)
        except Exception:  # consumer not started or partition unknown
            return None
        return highwater

    def _log_stall(self, tp: Any, offset: int) -> None:
        """Log a stalled partition with what faust and aiokafka know of it.

        Best effort: the diagnostics read framework internals, which an upgrade
        can change; nothing here may keep the caller from seeking the partition."""
        try:
            highwater = self._highwater(tp)
        except Exception:
            highwater = None
        try:
            state = self._fetch_state(tp)
        except Exception as exc:
            state = f"unknown ({exc!r})"
        log.warning(
            "partition %s: nothing decided from offset %d for %.0f s while its log reaches %s "
            "(fetch state: %s); seeking back to %d",
            tp.partition, offset, self.stall_after_s, highwater, state, offset,
        )  # fmt: skip

    def _fetch_state(self, tp: Any) -> str:
        """Where a partition may be held back: faust's active/paused/buffered
        sets (its fetcher asks aiokafka only for active ones) and aiokafka's state."""
        try:
            faust_flags = seams.faust_partition_flags(self.app.consumer, tp)
            parts = [
                f"faust active={faust_flags['active']}",
                f"paused={faust_flags['paused']}",
                f"buffered={faust_flags['buffered']}",
            ]
            state = seams.aiokafka_partition_state(seams.worker_consumer(self.app), tp)
            parts.append(f"aiokafka paused={state['paused']} position={state['position']}")
            parts.append(f"buffered_fetch={state['buffered_fetch']}")
        except Exception as exc:  # diagnostics only: never stop the watchdog
            return f"unknown ({exc!r})"
        return ", ".join(parts)

    # --- consumer I/O ---------------------------------------------------------------------------

    async def _read_positions(self, tps: set[Any]) -> dict[Any, int]:
        """The group's committed offset of each partition, else the log start
        (``auto_offset_reset=earliest``).

        Scope ``batch``: stable offsets only (OffsetFetch ``require_stable``,
        brokers 2.5+), the wait that fences the previous owner's open
        transaction. Scope ``partition``: the new producer epochs already
        ended it, so aiokafka's plain read is enough (and works on older brokers)."""
        parts = [TopicPartition(tp.topic, tp.partition) for tp in tps]

        async def read(consumer: Any) -> dict[Any, int]:
            out: dict[Any, int] = {}
            missing = []
            if self.emitter.scope == "batch":
                committed = await seams.fetch_stable_offsets(
                    consumer, self.emitter.group_id, parts, give_up_s=STABLE_OFFSETS_GIVE_UP_S
                )
            else:
                committed = {tp: await consumer.committed(tp) for tp in parts}
            for tp in tps:
                offset = committed.get(TopicPartition(tp.topic, tp.partition))
                if offset is None or offset < 0:
                    missing.append(tp)
                else:
                    out[tp] = offset
            if missing:
                starts = await consumer.beginning_offsets([TopicPartition(t.topic, t.partition) for t in missing])
                for tp in missing:
                    out[tp] = starts[TopicPartition(tp.topic, tp.partition)]
            return out

        return await seams.on_consumer_thread(self.app, read)


def _fmt_tps(tps: Iterable[Any]) -> str:
    return ",".join(str(tp.partition) for tp in sorted(tps, key=lambda tp: tp.partition))


def _fmt(offsets: Mapping[Any, int]) -> str:
    return ", ".join(f"{tp.partition}:{n}" for tp, n in sorted(offsets.items(), key=lambda kv: kv[0].partition))
