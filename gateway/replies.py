"""Request-reply over Kafka: wait for the decision (or dead letter) of one produced transaction.

The worker copies a transaction's ``correlation-id`` header into its decision
(``correlation_id``) and keeps every header of a dead-lettered message, so the
gateway gives each request a fresh correlation id, registers a future under it
*before* producing, and :class:`Replies` resolves that future from whatever
record carries the id.

One consumer serves the whole gateway: no group (nothing to rebalance, nothing
to commit), assigned every partition of ``decisions`` and of the dead-letter
topic, starting at their ends.

NOTE: where "the end" is. The consumer reads ``read_committed`` (decisions are
written in transactions), so ``seek_to_end`` lands on the last stable offset:
a decision still in an open transaction is read once it commits. What matters
is that the position is *resolved* before the first request is produced
(``start`` awaits ``position()`` on every partition): an unresolved "latest"
taken after a decision was written would skip it.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import orjson
from aiokafka import AIOKafkaConsumer, TopicPartition

from app.errors import ConfigError
from app.settings import Settings
from app.topics import kafka_auth, partitions_of
from pipeline.decision_signing import DecisionVerifier, Unverified, headers_of

__all__ = ["Outcome", "Replies", "assignable", "correlation_of_dead_letter"]

log = logging.getLogger(__name__)

#: Back-off after a failed fetch: the consumer reconnects on its own.
FETCH_RETRY_S = 0.5


@dataclass(frozen=True, slots=True)
class Outcome:
    """What became of a produced transaction: its decision, or its dead-letter record."""

    kind: Literal["decision", "dead_letter"]
    record: dict[str, Any]


def correlation_of_dead_letter(doc: dict[str, Any]) -> str | None:
    """The correlation id a dead-letter record kept (headers are base64 there)."""
    header = (doc.get("headers") or {}).get("correlation-id")
    if not isinstance(header, str):
        return None
    try:
        return base64.b64decode(header).decode("utf-8", "replace")
    except ValueError:
        return None


async def assignable(consumer: AIOKafkaConsumer, topics: Sequence[str], wait_s: float = 10.0) -> list[TopicPartition]:
    """Every partition of ``topics``, once the broker's metadata has them all."""
    deadline = time.monotonic() + wait_s
    while True:
        known = await partitions_of(consumer, topics)
        if all(known.values()):
            return [TopicPartition(topic, p) for topic in topics for p in sorted(known[topic] or ())]
        if time.monotonic() > deadline:
            missing = sorted(topic for topic, parts in known.items() if not parts)
            raise ConfigError(f"topics {missing} do not exist; run `fraud-pipeline topics`")
        await asyncio.sleep(0.2)


class TopicReader:
    """A background task following whole topics with a consumer without a group
    (the gateway's readers: they follow every partition, they share no work)."""

    task_name = "gateway-reader"
    reads = "records"
    """What the reader follows, for its log lines."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self._consumer: AIOKafkaConsumer | None = None
        self._task: asyncio.Task[None] | None = None

    async def _open(self, topics: Sequence[str], *, fetch_max_wait_ms: int) -> list[TopicPartition]:
        """Start the consumer, assigned every partition of ``topics``; returns them."""
        s = self.settings
        consumer = AIOKafkaConsumer(
            bootstrap_servers=s.kafka_bootstrap,
            group_id=None,
            enable_auto_commit=False,
            fetch_max_wait_ms=fetch_max_wait_ms,
            # Decisions are written in transactions: only committed ones are answers.
            isolation_level="read_committed",
            **kafka_auth(s),
        )
        await consumer.start()
        try:
            parts = await assignable(consumer, topics)
        except BaseException:
            await consumer.stop()
            raise
        consumer.assign(parts)
        self._consumer = consumer
        return parts

    def _follow(self) -> None:
        self._task = asyncio.create_task(self._run(), name=self.task_name)

    async def _run(self) -> None:
        assert self._consumer is not None
        while True:
            try:
                batches = await self._consumer.getmany(timeout_ms=1000)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the broker went away: keep following, the consumer reconnects
                log.warning("reading %s failed (%r); retrying in %.1f s", self.reads, exc, FETCH_RETRY_S)
                await asyncio.sleep(FETCH_RETRY_S)
                continue
            self._take(batches)

    def _take(self, batches: dict[TopicPartition, list[Any]]) -> None:
        """Hand each record with a value to :meth:`read`, in order per partition."""
        for tp, records in batches.items():
            for record in records:
                if record.value is not None:
                    self.read(tp.topic, record.value, record.headers)

    def read(self, topic: str, value: bytes, headers: Any = ()) -> None:
        """Take one record's value (a subclass says what that means)."""
        raise NotImplementedError

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self._consumer is not None:
            await self._consumer.stop()

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()


class Replies(TopicReader):
    """Pending futures keyed by correlation id, resolved by one background consumer."""

    task_name = "gateway-replies"
    reads = "decisions"

    def __init__(self, settings: Settings, decision_keys: DecisionVerifier | None = None) -> None:
        super().__init__(settings)
        #: Only decisions signed by one of these keys are answers; None: any (development).
        self.decision_keys = decision_keys
        self._pending: dict[str, asyncio.Future[Outcome]] = {}
        self.unverified = 0
        """Decision records refused because their signature did not verify (forged, or an unknown key)."""
        self.matched = 0
        self.unmatched = 0
        """Records read that no pending request wanted (other producers' traffic, old records)."""

    async def start(self) -> None:
        s = self.settings
        parts = await self._open((s.topic_decisions, s.topic_dlq), fetch_max_wait_ms=s.consumer_fetch_max_wait_ms)
        assert self._consumer is not None
        await self._consumer.seek_to_end(*parts)
        for tp in parts:  # resolve every "end" now, before any request is produced
            await self._consumer.position(tp)
        self._follow()

    async def stop(self) -> None:
        await super().stop()
        for future in self._pending.values():
            future.cancel()
        self._pending.clear()

    @property
    def pending(self) -> int:
        return len(self._pending)

    def expect(self, correlation_id: str) -> asyncio.Future[Outcome]:
        """Register before producing: the reply may arrive before ``send`` returns."""
        if correlation_id in self._pending:
            raise ValueError(f"correlation id {correlation_id!r} is already pending")
        future: asyncio.Future[Outcome] = asyncio.get_running_loop().create_future()
        self._pending[correlation_id] = future
        return future

    def forget(self, correlation_id: str) -> None:
        """Drop a request that was answered or gave up (a late reply is then ignored)."""
        self._pending.pop(correlation_id, None)

    def deliver(self, topic: str, value: bytes, headers: Any = ()) -> bool:
        """Resolve the request waiting for this record; False if none is.

        A decision must carry a valid signature by a published key: one that
        does not is no answer (the request keeps waiting for the genuine one,
        or times out), and is counted in ``unverified``."""
        try:
            doc = orjson.loads(value)
        except orjson.JSONDecodeError:
            doc = None
        if not isinstance(doc, dict):
            self.unmatched += 1
            return False
        if topic == self.settings.topic_decisions:
            correlation, kind = doc.get("correlation_id"), "decision"
        else:
            correlation, kind = correlation_of_dead_letter(doc), "dead_letter"
        if not isinstance(correlation, str):
            self.unmatched += 1
            return False
        future = self._pending.get(correlation)
        if future is None or future.done():
            if future is not None:
                del self._pending[correlation]
            self.unmatched += 1
            return False
        # Verified only when it would answer a request (other traffic costs no signature check).
        if kind == "decision" and self.decision_keys is not None:
            verdict = self.decision_keys.verify(value, headers_of(headers))
            if isinstance(verdict, Unverified):
                self.unverified += 1
                log.warning("refusing a decision for %.64s (%s): %s", doc.get("transaction_id"), verdict.code,
                            verdict.detail)  # fmt: skip
                return False
        del self._pending[correlation]
        future.set_result(Outcome(kind, doc))  # type: ignore[arg-type]
        self.matched += 1
        return True

    def read(self, topic: str, value: bytes, headers: Any = ()) -> None:
        self.deliver(topic, value, headers)

    def _take(self, batches: dict[TopicPartition, list[Any]]) -> None:
        if not self._pending:
            self.unmatched += sum(len(records) for records in batches.values())
            return  # nobody is waiting: skip parsing
        super()._take(batches)
