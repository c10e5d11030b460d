"""Exactly-once emit: a batch's outcomes and its consumed offsets in one Kafka transaction.

Every record a batch produces (decisions, dead letters, feedback, monitoring)
and the next offset of each `transactions` partition it consumed are committed
together: a ``read_committed`` consumer sees all of a batch or none of it, and
a batch whose transaction did not commit is consumed again from the offset the
group committed with the last one that did. So a redelivery can no longer
produce a second decision: the first one either committed with its offset, or
never became visible.

**Fencing**, two ways (``FRAUD_TRANSACTION_SCOPE``):

- ``batch`` (the default, Kafka's exactly-once v2, KIP-447): one transactional
  producer per worker and **one transaction per batch**, whatever input
  partitions the batch holds. The offsets carry the consumer group's
  generation and member id (TxnOffsetCommit v3, app/group_fencing.py): a
  worker that lost its partitions can no longer commit offsets for them, since
  the group coordinator refuses an older generation, so its transaction
  aborts. A partition's new owner reads its offsets with ``require_stable``:
  while the old owner's transaction is open the coordinator makes it wait, so
  it starts exactly where that transaction leaves the partition.
- ``partition``: one transactional producer per assigned input partition, with
  the id ``<app_id>-score-<topic>-<partition>`` (what faust's own exactly-once
  mode does), for brokers without KIP-447 (before 2.5). When a partition's new
  owner starts its producer, ``InitProducerId`` bumps the epoch of that id:
  the old owner's open transaction is aborted and its next transactional call
  fails with ``ProducerFenced``. A batch is one transaction per input
  partition it touched, which costs the worker and the broker a transaction's
  requests and markers for each (docs/performance.md measures both).

Either way the old owner drops the partition's batch (its new owner decides it
from the committed offset), and the new owner reads the committed offsets only
once the old owner's transaction is over (aborted by the new epoch, or waited
for with ``require_stable``), so what it reads reflects whatever the old owner
managed to commit.

Under ``partition``, a batch that holds records of several partitions is
committed as one transaction per partition, concurrently; each carries the
records produced for its own input records (the batch's monitoring record goes
with the first).
Transactions begin only after scoring, so each stays open for the sends and
the commit alone (milliseconds): an open transaction holds back the
``read_committed`` view (the last stable offset) of every partition it wrote.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from aiokafka import AIOKafkaProducer
from aiokafka.errors import InvalidProducerEpoch, ProducerFenced, TransactionalIdAuthorizationFailed
from aiokafka.structs import TopicPartition

from app import seams
from app.group_fencing import GenerationFenced, GroupMember

__all__ = ["Fenced", "PartitionBatch", "TransactionalEmitter", "transactional_id"]

log = logging.getLogger(__name__)

#: Errors after which a producer can never commit again: another process holds its id.
FENCING_ERRORS = (ProducerFenced, InvalidProducerEpoch, TransactionalIdAuthorizationFailed)

#: How long the broker keeps an open transaction of a worker that stopped
#: answering (SIGSTOP, a long GC) before aborting it. A transaction is open
#: for a batch's sends and commit only, so this bounds how long such a worker
#: can hold back ``read_committed`` consumers when nobody fences it sooner.
TRANSACTION_TIMEOUT_MS = 10_000
#: How long an abort or a producer's stop may take. NOTE: aiokafka shields both and
#: waits for the transaction coordinator without a deadline; with the coordinator
#: unreachable a worker told to stop hung in them (seen in the soak's combined run).
#: Past it the broker aborts the transaction itself (TRANSACTION_TIMEOUT_MS, or the
#: partition's next owner fencing it).
GIVE_UP_S = 5.0


class Fenced(Exception):
    """This worker may no longer commit for the partition: another owner took it over."""


def transactional_id(app_id: str, topic: str, partition: int | str) -> str:
    """``<app_id>-score-<topic>-<partition>``, or ``-<worker token>`` under scope ``batch``."""
    return f"{app_id}-score-{topic}-{partition}"


@dataclass
class PartitionBatch:
    """What one input partition's share of a batch produces, and where it ends."""

    next_offset: int
    """The offset after the last record consumed: committed with the transaction."""
    records: list[tuple[str, bytes | None, bytes, list[tuple[str, bytes]]]] = field(default_factory=list)
    """(topic, key, value, headers), in the order they are produced (headers: the
    decision signature, pipeline/decision_signing.py; empty for other records)."""


class TransactionalEmitter:
    """Commits each batch's outcomes and offsets in Kafka transactions.

    ``scope="batch"``: one producer, one transaction per batch, fenced by the
    group generation given to :meth:`assign`. ``scope="partition"``: one
    producer per assigned partition, one transaction per partition of a batch.
    """

    def __init__(
        self,
        *,
        app_id: str,
        group_id: str,
        topic: str,
        producer_options: Mapping[str, Any],
        factory: Callable[..., Any] = AIOKafkaProducer,
        scope: Literal["batch", "partition"] = "batch",
        worker_id: str | None = None,
    ) -> None:
        self.app_id = app_id
        self.group_id = group_id
        self.topic = topic
        self.scope = scope
        if scope == "batch":
            seams.install_group_fenced_offset_commits()
        self._options = dict(producer_options)
        self._factory = factory
        self._producers: dict[int, Any] = {}  # scope "partition"
        self._producer: Any = None  # scope "batch": this worker's own
        self._owned: set[int] = set()  # scope "batch"
        self._member: GroupMember | None = None  # scope "batch": the group generation of the assignment
        #: This worker's transactional id under ``batch``. Stable across restarts
        #: of the same worker (``worker_id``), so that a restarted worker's
        #: producer aborts what a killed predecessor left open; random if none.
        self.worker_transactional_id = transactional_id(app_id, topic, worker_id or f"w{uuid.uuid4().hex[:12]}")
        #: Called with "committed", "fenced" or "failed" per transaction (the worker's metrics count them).
        self.on_result: Callable[[str], None] | None = None

    @property
    def partitions(self) -> frozenset[int]:
        if self.scope == "batch":
            return frozenset(self._owned)
        return frozenset(self._producers)

    async def assign(self, partitions: Iterable[int], membership: tuple[int, str] | None = None) -> None:
        """Own exactly ``partitions`` from now on.

        ``partition``: a fresh producer (a new epoch, which fences any earlier
        holder of its id) for each of them; call before reading the
        partitions' committed offsets (see the module docstring). Also
        re-initialises partitions kept across the rebalance: another worker may
        have owned them in a generation this one missed.

        ``batch``: ``membership`` is the (generation id, member id) of the
        group assignment that gave them; every transaction's offsets carry it.
        """
        wanted = sorted(set(partitions))
        if self.scope == "batch":
            if membership is None:
                raise ValueError("transaction scope 'batch' needs the group membership of the assignment")
            if self._producer is None:
                self._producer = await self._start(self.worker_transactional_id)
            self._member = GroupMember(self.group_id, *membership)
            self._owned = set(wanted)
            return
        await self.close()
        started = await asyncio.gather(
            *(self._start(transactional_id(self.app_id, self.topic, p)) for p in wanted), return_exceptions=True
        )
        failed = [r for r in started if isinstance(r, BaseException)]
        if failed:  # none of them is kept: the caller tries the whole assignment again
            await _stop_all([r for r in started if not isinstance(r, BaseException)])
            raise failed[0]
        self._producers = dict(zip(wanted, started))

    async def _start(self, txn_id: str) -> Any:
        producer = self._factory(
            **self._options,
            transactional_id=txn_id,
            enable_idempotence=True,
            acks="all",
            transaction_timeout_ms=TRANSACTION_TIMEOUT_MS,
        )
        await producer.start()  # InitProducerId: bumps the epoch, aborts the old holder's open transaction
        return producer

    def release(self, partition: int) -> None:
        """Forget a partition this worker was fenced from (under ``partition``
        its producer is closed in the background)."""
        self._owned.discard(partition)
        producer = self._producers.pop(partition, None)
        if producer is not None:
            task = asyncio.ensure_future(producer.stop())
            task.add_done_callback(lambda t: t.cancelled() or t.exception())

    async def commit(self, batches: Mapping[int, PartitionBatch]) -> dict[int, BaseException | None]:
        """Commit the batch: each partition's share in its own transaction,
        concurrently (``partition``), or all of it in one (``batch``).

        Returns, per partition, None when committed, :class:`Fenced` when this
        worker no longer owns it, or the error that made the transaction abort
        (nothing of it became visible: the caller may retry the same batch).
        """
        if self.scope == "batch":
            return await self._commit_batch(batches)
        parts = list(batches)
        results = await asyncio.gather(*(self._commit_one(p, batches[p]) for p in parts), return_exceptions=True)
        out: dict[int, BaseException | None] = {}
        for partition, result in zip(parts, results):
            if isinstance(result, asyncio.CancelledError):
                raise result
            out[partition] = result
            self._count(result)
        return out

    def _count(self, result: BaseException | None) -> None:
        if self.on_result is not None:
            self.on_result("committed" if result is None else "fenced" if isinstance(result, Fenced) else "failed")

    async def _commit_batch(self, batches: Mapping[int, PartitionBatch]) -> dict[int, BaseException | None]:
        out: dict[int, BaseException | None] = {
            p: Fenced(f"partition {p} is not assigned to this worker") for p in batches if p not in self._owned
        }
        mine = {p: b for p, b in batches.items() if p in self._owned}
        if not mine:
            return out
        try:
            if self._producer is None:  # its last one was lost (below)
                self._producer = await self._start(self.worker_transactional_id)
            await self._transaction(
                self._producer,
                [record for batch in mine.values() for record in batch.records],
                {TopicPartition(self.topic, p): b.next_offset for p, b in mine.items()},
                self._owner(),
            )
            result: BaseException | None = None
        except asyncio.CancelledError:
            raise
        except GenerationFenced as exc:
            for p in mine:
                self._owned.discard(p)
            result = Fenced(f"partitions {sorted(mine)}: the group moved on ({exc})")
        except FENCING_ERRORS as exc:
            # Ownership of partitions is the group's, not the id's: fenced by
            # its id means a restart of this worker's slot took it (or two
            # workers were given one FRAUD_WORKER_ID); a fresh producer is
            # started for the retry, and a worker that keeps losing it exits
            # after the commit attempts (app/commits.py).
            producer, self._producer = self._producer, None
            await _stop_all([producer])
            result = exc
        except Exception as exc:
            result = exc
        self._count(result)
        return {**out, **{p: result for p in mine}}

    def _owner(self) -> GroupMember:
        """The group membership this worker's offsets are fenced by (set by :meth:`assign`)."""
        if self._member is None:  # cannot happen: nothing is owned before assign()
            raise RuntimeError("scope 'batch' committed before an assignment")
        return self._member

    async def _commit_one(self, partition: int, batch: PartitionBatch) -> None:
        producer = self._producers.get(partition)
        if producer is None:
            raise Fenced(f"partition {partition} is not assigned to this worker")
        try:
            await self._transaction(
                producer, batch.records, {TopicPartition(self.topic, partition): batch.next_offset}, self.group_id
            )
        except FENCING_ERRORS as exc:
            self.release(partition)
            raise Fenced(f"partition {partition}: fenced by a newer owner ({exc!r})") from exc

    @staticmethod
    async def _transaction(
        producer: Any,
        records: list[tuple[str, bytes | None, bytes, list[tuple[str, bytes]]]],
        offsets: dict[TopicPartition, int],
        group: str,
    ) -> None:
        """One transaction: the records, then the offsets; aborted on any error but a fence."""
        if producer is None:
            raise RuntimeError("no transactional producer (not assigned yet)")
        await producer.begin_transaction()
        try:
            for topic, key, value, headers in records:
                await producer.send(topic, value, key=key, headers=headers or None)
            await producer.send_offsets_to_transaction(offsets, group)
            await producer.commit_transaction()
        except asyncio.CancelledError:
            raise  # stopping: no abort to wait for (see GIVE_UP_S)
        except BaseException as exc:
            if not isinstance(exc, FENCING_ERRORS):
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(producer.abort_transaction(), GIVE_UP_S)
            raise

    async def close(self) -> None:
        """Stop every producer (an open transaction is aborted by the broker)."""
        producers, self._producers = list(self._producers.values()), {}
        if self._producer is not None:
            producers.append(self._producer)
            self._producer = None
        self._owned = set()
        await _stop_all(producers)


async def _stop_all(producers: list[Any]) -> None:
    """Stop producers, each for at most ``GIVE_UP_S``; never raises."""

    async def stop(producer: Any) -> None:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(producer.stop(), GIVE_UP_S)

    await asyncio.gather(*(stop(p) for p in producers))
