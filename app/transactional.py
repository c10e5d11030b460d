"""Exactly-once emit: a batch's outcomes and its consumed offsets in one Kafka transaction.

Every record a batch produces (decisions, dead letters, feedback, monitoring)
and the next offset of each `transactions` partition it consumed are committed
together: a ``read_committed`` consumer sees all of a batch or none of it, and
a batch whose transaction did not commit is consumed again from the offset the
group committed with the last one that did. So a redelivery can no longer
produce a second decision: the first one either committed with its offset, or
never became visible.

**Fencing.** aiokafka sends the group id alone with the offsets (no consumer
group metadata, KIP-447), so the broker cannot tell a worker that lost its
partitions from their owner. Fencing rests on the transactional id instead:
one transactional producer per assigned input partition, with the id
``<app_id>-score-<topic>-<partition>`` (what faust's own exactly-once mode
does). When a partition's new owner starts its producer, ``InitProducerId``
bumps the epoch of that id: the old owner's open transaction is aborted and
its next transactional call fails with ``ProducerFenced``. The old owner drops
the partition's batch (its new owner decides it from the committed offset).
The new owner initialises its producers *before* it reads the committed
offsets, so what it reads already reflects whatever the old owner managed to
commit.

A batch that holds records of several partitions is committed as one
transaction per partition, concurrently; each carries the records produced for
its own input records (the batch's monitoring record goes with the first).
Transactions begin only after scoring, so each stays open for the sends and
the commit alone (milliseconds): an open transaction holds back the
``read_committed`` view (the last stable offset) of every partition it wrote.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from aiokafka import AIOKafkaProducer
from aiokafka.errors import InvalidProducerEpoch, ProducerFenced, TransactionalIdAuthorizationFailed
from aiokafka.structs import TopicPartition

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


def transactional_id(app_id: str, topic: str, partition: int) -> str:
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
    """One transactional producer per assigned partition of ``topic``."""

    def __init__(
        self,
        *,
        app_id: str,
        group_id: str,
        topic: str,
        producer_options: Mapping[str, Any],
        factory: Callable[..., Any] = AIOKafkaProducer,
    ) -> None:
        self.app_id = app_id
        self.group_id = group_id
        self.topic = topic
        self._options = dict(producer_options)
        self._factory = factory
        self._producers: dict[int, Any] = {}
        #: Called with "committed", "fenced" or "failed" per transaction (the worker's metrics count them).
        self.on_result: Callable[[str], None] | None = None

    @property
    def partitions(self) -> frozenset[int]:
        return frozenset(self._producers)

    async def assign(self, partitions: Iterable[int]) -> None:
        """Own exactly ``partitions`` from now on: a fresh producer (a new epoch,
        which fences any earlier holder of its id) for each of them.

        Call before reading the partitions' committed offsets (see the module
        docstring). Also re-initialises partitions kept across the rebalance:
        another worker may have owned them in a generation this one missed.
        """
        await self.close()
        wanted = sorted(set(partitions))
        started = await asyncio.gather(*(self._start(p) for p in wanted), return_exceptions=True)
        failed = [r for r in started if isinstance(r, BaseException)]
        if failed:  # none of them is kept: the caller tries the whole assignment again
            await _stop_all([r for r in started if not isinstance(r, BaseException)])
            raise failed[0]
        self._producers = dict(zip(wanted, started))

    async def _start(self, partition: int) -> Any:
        producer = self._factory(
            **self._options,
            transactional_id=transactional_id(self.app_id, self.topic, partition),
            enable_idempotence=True,
            acks="all",
            transaction_timeout_ms=TRANSACTION_TIMEOUT_MS,
        )
        await producer.start()  # InitProducerId: bumps the epoch, aborts the old owner's open transaction
        return producer

    def release(self, partition: int) -> None:
        """Forget a partition this worker was fenced from (its producer is closed in the background)."""
        producer = self._producers.pop(partition, None)
        if producer is not None:
            task = asyncio.ensure_future(producer.stop())
            task.add_done_callback(lambda t: t.cancelled() or t.exception())

    async def commit(self, batches: Mapping[int, PartitionBatch]) -> dict[int, BaseException | None]:
        """Commit each partition's batch in its own transaction, concurrently.

        Returns, per partition, None when committed, :class:`Fenced` when this
        worker no longer owns it, or the error that made the transaction abort
        (nothing of it became visible: the caller may retry the same batch).
        """
        parts = list(batches)
        results = await asyncio.gather(*(self._commit_one(p, batches[p]) for p in parts), return_exceptions=True)
        out: dict[int, BaseException | None] = {}
        for partition, result in zip(parts, results):
            if isinstance(result, asyncio.CancelledError):
                raise result
            out[partition] = result
            if self.on_result is not None:
                self.on_result("committed" if result is None else "fenced" if isinstance(result, Fenced) else "failed")
        return out

    async def _commit_one(self, partition: int, batch: PartitionBatch) -> None:
        producer = self._producers.get(partition)
        if producer is None:
            raise Fenced(f"partition {partition} is not assigned to this worker")
        try:
            await producer.begin_transaction()
            try:
                for topic, key, value, headers in batch.records:
                    await producer.send(topic, value, key=key, headers=headers or None)
                await producer.send_offsets_to_transaction(
                    {TopicPartition(self.topic, partition): batch.next_offset}, self.group_id
                )
                await producer.commit_transaction()
            except asyncio.CancelledError:
                raise  # stopping: no abort to wait for (see GIVE_UP_S)
            except BaseException as exc:
                if not isinstance(exc, FENCING_ERRORS):
                    with contextlib.suppress(Exception):
                        await asyncio.wait_for(producer.abort_transaction(), GIVE_UP_S)
                raise
        except FENCING_ERRORS as exc:
            self.release(partition)
            raise Fenced(f"partition {partition}: fenced by a newer owner ({exc!r})") from exc
        return None

    async def close(self) -> None:
        """Stop every producer (an open transaction is aborted by the broker)."""
        producers, self._producers = list(self._producers.values()), {}
        await _stop_all(producers)


async def _stop_all(producers: list[Any]) -> None:
    """Stop producers, each for at most ``GIVE_UP_S``; never raises."""

    async def stop(producer: Any) -> None:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(producer.stop(), GIVE_UP_S)

    await asyncio.gather(*(stop(p) for p in producers))
