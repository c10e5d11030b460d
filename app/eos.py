"""Exactly-once consume -> produce on librdkafka: a batch's outcomes and its
consumed offsets in one Kafka transaction, fenced by the group's generation.

Kafka's exactly-once v2 (KIP-447), as the Java client and Kafka Streams do it:
one transactional producer per worker (a stable id: a restarted worker fences
its killed predecessor and aborts what it left open), and every transaction's
offsets carry the consumer group's metadata (generation and member id), so a
worker that lost its partitions can no longer commit them: the coordinator
refuses, the transaction aborts, and nothing it produced becomes visible. A
partition's new owner reads the committed offsets with ``require_stable``
(itself, in the assignment callback: :meth:`ExactlyOnce._assigned`), so it
starts exactly where the last committed transaction left the partition.

A transaction may span batches, as Kafka Streams' commit interval does:
:meth:`ExactlyOnce.take` returns what the consumer has (up to ``max_records``,
waiting at most ``within_s``), :meth:`ExactlyOnce.send` produces a batch's
records in the open transaction (begun by the first), and
:meth:`ExactlyOnce.commit` commits every offset sent with it, all or nothing.
When it commits is the caller's choice (agents/pace.py): what a transaction
costs the broker (its requests, a marker in every partition it wrote) is
paid once per commit; what it costs a decision is the wait until the commit
makes it visible. A transaction that fails is aborted and the consumer goes
back to where it began, so the same records come back (to this worker, or
to the partitions' next owner): never a decision without its offset, never
an offset without its decision. A batch taken while that transaction was
committing is void: :meth:`send` refuses it and puts its partitions back.

Every call into librdkafka that can block (consume, the transaction's round
trips) runs on one thread of its own, in order, so the event loop keeps
serving Redis, metrics and the web while the broker answers. Rebalance
callbacks run inside ``consume`` on that thread, always between two
transactions: a revocation never meets an open transaction of this worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any

__all__ = ["ExactlyOnce", "HANDOVER_HEADER", "Placed", "Record", "TakenBatch", "TRANSACTION_TIMEOUT_MS"]

log = logging.getLogger(__name__)

#: How long the broker lets a transaction stay open before aborting it itself:
#: a worker that stopped answering (SIGSTOP, a long pause) holds back
#: ``read_committed`` readers of its partitions at most this long when nobody
#: fences it sooner. A transaction is open for its batches (one until the worker
#: has caught up, at most a commit interval's under a backlog: agents/pace.py)
#: and its commit.
TRANSACTION_TIMEOUT_MS = 10_000

#: Bound on one blocking transactional call (commit, abort, offsets); past it
#: the call is treated as failed (aborted if it can be, else a new producer).
TXN_CALL_TIMEOUT_S = 10.0

#: Tries of a commit whose error librdkafka says may be retried as is.
COMMIT_RETRIES = 3

#: How long ``send_offsets_to_transaction`` may take before it is given up
#: as hung. NOTE: the call is two requests in turn (librdkafka
#: rdkafka_txnmgr.c): AddOffsetsToTxn to the TRANSACTION coordinator, then,
#: once that answers, TxnOffsetCommit to the GROUP coordinator; librdkafka
#: (2.16 and earlier) waits for their outcome without a deadline of its own.
#: A transaction coordinator lost: AddOffsetsToTxn is retried until the
#: coordinator of the transactional id has moved to another broker (the fault
#: test's hang, with the group coordinator alive). A group coordinator lost:
#: its coordinator requests never check their deadline (librdkafka issues
#: 5456 and 5511, open). Either way a worker stuck there stops deciding yet
#: stays in the group, and the group cannot finish a rebalance without it.
#: So the call runs on a thread of its own, waited for this long
#: (RELIABILITY.md, the cluster fault test); a new producer (whose new epoch
#: aborts the transaction: its records come again) costs less than waiting.
#: 2 s: a lost node is fenced after 1.5 s on the local cluster, and on the
#: 3-node stack the three workers whose group coordinator was killed sat out
#: the whole bound before anything else could go on (RELIABILITY.md).
OFFSETS_HUNG_S = 2.0

#: How long :meth:`ExactlyOnce._committed_now` keeps asking the group for
#: committed offsets that are not yet stable (a newly assigned partition's, or
#: those of a transaction whose commit failed without saying whether it
#: committed), and how often. Until they are read, nothing of those partitions
#: is taken: a guess decides records twice or skips them. 60 s, as long as a
#: new producer is waited for (``_replace_producer``); past it the call raises
#: and the worker exits (agents/wiring.py), to be restarted: its partitions'
#: next owner reads their committed offsets the same way.
COMMITTED_READ_FOR_S = 60.0
COMMITTED_READ_EVERY_S = 0.5
#: After this long unstable, :meth:`ExactlyOnce._committed_now` drops what this
#: worker's own producer may have left pending in the group (``_release``).
RELEASE_PENDING_AFTER_S = 5.0

#: How long each poll of :meth:`ExactlyOnce.join` waits for the assignment.
JOIN_POLL_S = 0.1

#: The header of a handover record (:meth:`ExactlyOnce._hand_over`): a record
#: with an empty value, carrying no outcome, that readers skip.
HANDOVER_HEADER = "txn-handover"
#: How soon a handover that failed (the broker unreachable) is tried again.
HANDOVER_RETRY_S = 1.0

#: (topic, key, value, headers): one record to produce, on its key's partition.
Record = tuple[str, bytes | None, bytes, list[tuple[str, bytes]]]
#: (topic, partition, key, value, headers): one record to produce on a given partition.
Placed = tuple[str, int, bytes | None, bytes, list[tuple[str, bytes]]]


@dataclass
class TakenBatch:
    """Records taken together, and where each of their partitions starts and ends."""

    messages: list[Any]
    first: dict[int, int] = field(default_factory=dict)
    """Per partition, the offset of its first record here: where a rewind goes."""
    next_offsets: dict[int, int] = field(default_factory=dict)
    """Per partition, the offset after its last record here: what a commit stores."""
    generation: int = 0
    """:attr:`ExactlyOnce.generation` when this batch was taken (bumped by every rebalance and rewind)."""

    @classmethod
    def of(cls, messages: Sequence[Any], generation: int) -> TakenBatch:
        batch = cls(list(messages), generation=generation)
        for msg in batch.messages:
            p, o = msg.partition(), msg.offset()
            if p not in batch.first:
                batch.first[p] = o
            batch.next_offsets[p] = o + 1
        return batch


@dataclass
class _OpenTransaction:
    """The batches sent in one transaction (client thread only)."""

    seq: int
    generation: int
    began: float
    first: dict[int, int] = field(default_factory=dict)
    next_offsets: dict[int, int] = field(default_factory=dict)

    def add(self, batch: TakenBatch) -> None:
        for p, o in batch.first.items():
            self.first.setdefault(p, o)
        self.next_offsets.update(batch.next_offsets)


def _kafka_group_partition(group_id: str, partitions: int) -> int:
    """The ``__consumer_offsets`` partition of a group, as the broker places
    it: ``Utils.abs(groupId.hashCode()) % partitions`` (Java's String hash)."""
    data = group_id.encode("utf-16-be")  # Java's chars: UTF-16 code units
    h = 0
    for i in range(0, len(data), 2):
        h = (31 * h + int.from_bytes(data[i : i + 2], "big")) & 0xFFFFFFFF
    h = h - (1 << 32) if h >= 1 << 31 else h
    return (0 if h == -(1 << 31) else abs(h)) % partitions


def gate_group(group_id: str) -> str:
    """The group a transaction's first offsets are sent to (ExactlyOnce._send):
    ``<group_id>-gate``, or ``-gate-<n>`` with the least ``n`` that places it on
    the same ``__consumer_offsets`` partition as ``group_id`` for any partition
    count dividing 200 (50, the broker's default, and 8, the local stack's,
    among them), so that a transaction writes no marker to a second one."""
    for n in range(10_000):
        name = f"{group_id}-gate" + (f"-{n}" if n else "")
        if _kafka_group_partition(name, 200) == _kafka_group_partition(group_id, 200):
            return name
    return f"{group_id}-gate"  # not found: one more marker per transaction, nothing else


def _fencing_codes() -> tuple[int, ...]:
    err = _kafka().KafkaError
    return (err.ILLEGAL_GENERATION, err.UNKNOWN_MEMBER_ID, err.FENCED_INSTANCE_ID, err.REBALANCE_IN_PROGRESS)


def _kafka() -> Any:
    import confluent_kafka

    return confluent_kafka


class ExactlyOnce:
    """One topic's consumer and one transactional producer, committed together."""

    def __init__(
        self,
        *,
        topic: str,
        group_id: str,
        transactional_id: str,
        client_config: dict[str, object],
        session_timeout_ms: int = 6000,
        heartbeat_interval_ms: int = 1500,
        linger_ms: float = 2.0,
        compression: str = "none",
        fetch_min_bytes: int = 1,
        fetch_max_wait_ms: int = 100,
        settle_s: float = 0.0,
        handover_topic: str | None = None,
        consumer_factory: Callable[[dict[str, object]], Any] | None = None,
        producer_factory: Callable[[dict[str, object]], Any] | None = None,
    ) -> None:
        self.topic = topic
        self.group_id = group_id
        self.gate_group = gate_group(group_id)
        self._gate_metadata: Any = None
        #: The scoring group's metadata as of the last rebalance callback
        #: (:meth:`_group_metadata`); None: read it again at the next commit.
        self._metadata: Any = None
        #: What each transaction commits to the gate group: any offset will do, no one reads it.
        self._gate_offsets: list[Any] = []
        self.transactional_id = transactional_id
        self._consumer_config: dict[str, object] = {
            **client_config,
            "group.id": group_id,
            "enable.auto.commit": False,  # offsets go only through the transactions
            "enable.auto.offset.store": False,
            "auto.offset.reset": "earliest",
            "isolation.level": "read_committed",
            "session.timeout.ms": session_timeout_ms,
            "heartbeat.interval.ms": heartbeat_interval_ms,
            # NOTE: librdkafka fetches ahead into its own queue; the default
            # (64 MiB per partition) is memory a worker does not need at a few
            # thousand small records a second.
            "queued.max.messages.kbytes": 8192,
            "fetch.min.bytes": fetch_min_bytes,
            "fetch.wait.max.ms": fetch_max_wait_ms,
            # NOTE: incremental rebalancing: a rebalance that moves no partition
            # (a member rejoining after the group coordinator moved) revokes
            # nothing, and the partitions that stay keep being decided while
            # others move. Eager rebalancing stopped every worker for the
            # 4-6 s of a rebalance after a broker was lost (RELIABILITY.md).
            "partition.assignment.strategy": "cooperative-sticky",
        }
        self._producer_config: dict[str, object] = {
            **client_config,
            "transactional.id": transactional_id,
            "enable.idempotence": True,
            "acks": "all",
            "linger.ms": linger_ms,
            "compression.type": compression,
            "transaction.timeout.ms": TRANSACTION_TIMEOUT_MS,
            # A refused or lost transactional request is retried after this
            # (doubling, up to retry.backoff.max.ms), not the 100 ms default: a
            # new transaction's AddOffsetsToTxn refused while the coordinator
            # completes the last one (below) is asked again within a few ms.
            "retry.backoff.ms": 2,
        }
        # NOTE: a transaction's requests to the coordinator sent while it is
        # still completing the previous transaction (EndTxn is answered once
        # the commit is decided; its markers are written after) are refused
        # CONCURRENT_TRANSACTIONS. librdkafka asks again after retry.backoff.ms
        # for AddOffsetsToTxn, but only after a fixed 20 ms for
        # AddPartitionsToTxn (rdkafka_txnmgr.c), and every decision in the
        # transaction waits with it. So a transaction begins with an offset
        # of the gate group, before its records (_send). ``settle_s`` (the worker's
        # FRAUD_COMMIT_SETTLE_S, 0 by default) is a pause before a transaction
        # begun within it of the last commit's end; it was the answer before
        # the gate group, and now only adds latency (docs/performance.md).
        self.settle_s = settle_s
        #: The topic written at the input's partition numbers (each record's
        #: outcome on the partition numbered as its own), if any: see _hand_over.
        self.handover_topic = handover_topic
        #: Its partitions that this worker's producer may have written and
        #: writes no more: each gets a handover record (_hand_over).
        self._handover_due: set[int] = set()
        self._handover_at = 0.0
        self._committed_at = float("-inf")  # no commit yet: no pause
        self._sleep: Callable[[float], None] = time.sleep
        self._consumer_factory = consumer_factory or (lambda c: _kafka().Consumer(c))
        self._producer_factory = producer_factory or (lambda c: _kafka().Producer(c))
        # One thread: librdkafka's blocking calls, in the order they were made.
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="eos")
        # send_offsets_to_transaction's own (OFFSETS_HUNG_S): a hung call keeps it.
        self._offsets_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="eos-offsets")
        self.offsets_hung_s = OFFSETS_HUNG_S
        self._consumer: Any = None
        self._producer: Any = None
        self.assigned: set[int] = set()
        #: Whether a first assignment came (:meth:`join`).
        self.joined = False
        self._txn: _OpenTransaction | None = None
        self._seq = 0
        self._settled: list[tuple[int, str]] = []
        #: What this worker committed last per partition (next offset to read).
        self.committed_offsets: dict[int, int] = {}
        #: Bumped by every rebalance and every rewind: a batch taken under an
        #: older one is void (:meth:`send`).
        self.generation = 0
        #: The partitions the last rewind since the last take put back.
        self._rewound: set[int] = set()
        #: Rewinds librdkafka refused (``_OUTDATED`` while a rebalance is under
        #: way): tried again before every take, and until one succeeds nothing
        #: the partition delivers is used (its records would skip the rewound ones).
        self._unsought: dict[int, int] = {}
        #: Called (on the client thread) with the partitions revoked.
        self.on_revoked: Callable[[set[int]], None] = lambda _: None
        #: Called (on the client thread) with partitions whose state must be
        #: complete before any of their records is taken: those assigned
        #: (inside the assignment, before their first fetch), and those of a
        #: transaction that may have committed although its commit failed.
        #: It blocks until done (app/changelog.py); if it raises, so does the take.
        self.restore: Callable[[set[int]], None] = lambda _: None
        #: Called with how long each commit took (client thread).
        self.on_commit_seconds: Callable[[float], None] = lambda _: None
        #: Called with "committed", "aborted" or "fenced" for each transaction.
        self.on_result: Callable[[str], None] = lambda _: None

    # -- lifecycle ----------------------------------------------------------------

    async def start(self) -> None:
        await self._call(self._start)

    def _start(self) -> None:
        self._replace_producer()  # tried again for a minute: the coordinator may still be loading
        self._consumer = self._consumer_factory(self._consumer_config)
        self._consumer.subscribe([self.topic], on_assign=self._assigned, on_revoke=self._revoked, on_lost=self._revoked)
        # The gate group's metadata, from a consumer that never joins it: no
        # member and generation -1, which the group coordinator takes as a
        # "simple" group's commit, checked against no generation (_send).
        gate = self._consumer_factory({**self._consumer_config, "group.id": self.gate_group})
        try:
            self._gate_metadata = gate.consumer_group_metadata()
            self._gate_offsets = [_kafka().TopicPartition(self.topic, 0, 0)]
        finally:
            gate.close()

    async def join(self, max_records: int, timeout_s: float, outputs: Sequence[str] = ()) -> TakenBatch:
        """Join the group: return once a first assignment (even an empty one:
        more workers than partitions) has come, or after ``timeout_s``, with
        the records taken meanwhile (up to ``max_records``). ``outputs``: topics
        whose metadata the producer fetches first, so that the first batch does
        not wait for it."""
        messages = await self._call(self._join, max_records, timeout_s, tuple(outputs))
        return TakenBatch.of(messages, self.generation)

    def _join(self, max_records: int, timeout_s: float, outputs: tuple[str, ...]) -> list[Any]:
        for topic in outputs:
            with contextlib.suppress(Exception):  # only a head start: the first produce asks again
                self._producer.list_topics(topic, TXN_CALL_TIMEOUT_S)
        deadline = time.monotonic() + timeout_s
        messages: list[Any] = []
        while not self.joined and not messages and time.monotonic() < deadline:
            messages = self._take(max_records, JOIN_POLL_S)  # the rebalance is served inside
        return messages

    def _new_producer(self) -> Any:
        producer = self._producer_factory(self._producer_config)
        # InitProducerId: a new epoch for this id; whatever an earlier holder
        # of it (this worker before a kill -9) left open is aborted.
        producer.init_transactions(TXN_CALL_TIMEOUT_S * 3)
        return producer

    async def close(self) -> None:
        """Leave the group (its partitions move at once) and stop the producer."""
        try:
            await self._call(self._close)
        finally:
            self._thread.shutdown(wait=False)
            self._offsets_thread.shutdown(wait=False)

    def _close(self) -> None:
        if self._consumer is not None:
            self._consumer.close()
            self._consumer = None
        if self._producer is not None:
            self._producer.flush(1.0)
            self._producer = None

    async def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._thread, fn, *args)

    # -- rebalance callbacks (client thread, inside consume) -----------------------

    def _assigned(self, consumer: Any, partitions: list[Any]) -> None:
        self._metadata = None  # a new generation: the open transaction commits with its metadata
        # Incremental (cooperative-sticky): these partitions are added to those
        # kept. Nothing taken before is void (that is what a revocation says,
        # and it bumps the generation), so an open transaction stays open and
        # commits its offsets with the group's new metadata.
        # NOTE: committing it here, inside the rebalance, was refused
        # (ILLEGAL_GENERATION) and its batches decided again.
        numbers = {tp.partition for tp in partitions}
        # Before returning: the client starts fetching these partitions after it.
        self.restore(numbers)
        # NOTE: each partition starts where the group committed, read here with
        # require_stable until no transaction holds it (_committed_now), and
        # assigned with that offset: the client's own fetch of it is not used.
        # librdkafka (2.16) puts a partition whose answer was
        # UNSTABLE_OFFSET_COMMIT back as "nothing committed" when the assignment
        # changed meanwhile, and auto.offset.reset then started it from its
        # beginning: every record decided again (RELIABILITY.md, known gap 5).
        kafka = _kafka()
        committed = self._committed_now(sorted(numbers)) if numbers else {}
        consumer.incremental_assign([
            kafka.TopicPartition(self.topic, p, o if (o := committed.get(p, -1)) >= 0 else kafka.OFFSET_BEGINNING)
            for p in sorted(numbers)
        ])
        for p in numbers:
            self._unsought.pop(p, None)  # fetched from the committed offset
        self.assigned |= numbers
        self.joined = True
        log.info("assigned partitions %s of %s (now %s)", sorted(numbers), self.topic, sorted(self.assigned))

    def _revoked(self, consumer: Any, partitions: list[Any]) -> None:
        self._metadata = None  # before the commit below: it goes with the generation being revoked in
        # The open transaction holds records of these partitions: it ends
        # before they are given up (committed while this worker still owns
        # them, as Kafka Streams does; aborted if the group refuses).
        txn, self._txn = self._txn, None
        if txn is not None:
            self._settle(txn, self._commit(txn))
        self.generation += 1
        numbers = {tp.partition for tp in partitions}
        self.assigned -= numbers
        if self.handover_topic is not None:
            self._handover_due |= numbers
        for p in numbers:
            self.committed_offsets.pop(p, None)
            self._unsought.pop(p, None)  # its new owner reads the committed offset
        log.info("partitions %s of %s revoked", sorted(numbers), self.topic)
        self.on_revoked(numbers)

    # -- the loop: take, then commit ----------------------------------------------

    async def take(self, max_records: int, within_s: float, idle_s: float = 0.0) -> TakenBatch:
        """Up to ``max_records`` records: those that arrive within ``within_s``;
        if none did, the first to arrive within ``idle_s`` more and those
        queued behind it."""
        messages = await self._call(self._take, max_records, within_s, idle_s)
        return TakenBatch.of(messages, self.generation)

    def _take(self, max_records: int, within_s: float, idle_s: float = 0.0) -> list[Any]:
        self._hand_over_if_due()  # an idle worker: no transaction open at its takes
        if self._unsought:
            unsought, self._unsought = self._unsought, {}
            self._seek(unsought)  # what fails again stays in _unsought
        generation = self.generation
        self._rewound = set()
        polled = self._consumer.consume(max_records, within_s)
        if not polled and idle_s > 0:
            # NOTE: consume(n, t) returns when it has n records or t has passed,
            # so an idle worker would wake (and hop threads) every window for
            # nothing; one record ends this wait as soon as it arrives instead.
            polled = self._consumer.consume(1, idle_s)
            if polled and max_records > 1:
                polled += self._consumer.consume(max_records - 1, 0)
        out = []
        for msg in polled:
            err = msg.error()
            if err is None:
                if msg.partition() in self._unsought:
                    continue  # past a rewind not yet made: it comes again after it
                out.append(msg)
            elif err.code() != _kafka().KafkaError._PARTITION_EOF:
                log.warning("consumer: %s", err)
        if out and self.generation != generation:
            # A rebalance inside this call: records from before it may be
            # delivered again from the committed offsets after it. None of
            # them is used; each partition kept goes back to its lowest.
            lowest: dict[int, int] = {}
            for msg in out:
                lowest[msg.partition()] = min(lowest.get(msg.partition(), msg.offset()), msg.offset())
            self._seek(lowest)
            return []
        return out

    async def send(self, batch: TakenBatch, records: Sequence[Record], placed: Sequence[Placed] = ()) -> int | None:
        """Produce ``records`` (and ``placed``, each on its partition) in the
        open transaction (one is begun if none is), with ``batch``'s offsets to
        be committed by it; returns the transaction's number, or None when the
        batch was taken before a rebalance (its records come again, here or
        elsewhere, and nothing was produced)."""
        seq: int | None = await self._call(self._send, batch, records, placed)
        return seq

    def _send(self, batch: TakenBatch, records: Sequence[Record], placed: Sequence[Placed] = ()) -> int | None:
        kafka = _kafka()
        if batch.generation != self.generation:
            self._void(batch)
            return None
        # A busy worker: each take comes with a transaction open (the last
        # batch's), so what is due is handed over before the next one begins.
        self._hand_over_if_due()
        producer = self._producer
        try:
            if self._txn is None:
                pause = self._committed_at + self.settle_s - time.monotonic()
                if pause > 0:
                    self._sleep(pause)
                producer.begin_transaction()
                self._seq += 1
                self._txn = _OpenTransaction(self._seq, self.generation, time.monotonic())
                # NOTE: a transaction's first request to the coordinator is
                # AddOffsetsToTxn, for the gate group: while the coordinator
                # still writes the last transaction's markers it refuses the
                # next one's requests, and librdkafka asks again after
                # retry.backoff.ms (2 ms here) for offsets, but only after a
                # fixed 20 ms for the partitions of records produced first
                # (rdkafka_txnmgr.c): 4 % of a worker's transactions at 1,000
                # TPS waited those 20 ms (docs/performance.md). Once it is in,
                # the coordinator has moved on and the partitions are added at
                # once. The offsets are the gate group's, which nobody reads,
                # not the scoring group's: those go only at the commit. Kafka
                # 4.4.0 can skip a transaction's marker on __consumer_offsets
                # (RELIABILITY.md, known gap 3), leaving what it sent there
                # pending until this producer's next commit: the scoring
                # group's offsets pending for a transaction's whole life lost
                # a decision that way, and stopped every worker waiting for a
                # stable read of its own. A gate offset pending is read by no one.
                self._send_offsets(producer, self._gate_offsets, self._gate_metadata)
            produce = producer.produce
            for topic, key, value, headers in records:
                while True:
                    try:
                        produce(topic, value, key, headers=headers or None)
                        break
                    except BufferError:  # the local queue is full: let deliveries drain it
                        producer.poll(0.005)
            for topic, partition, key, value, headers in placed:
                while True:
                    try:
                        produce(topic, value, key, partition, headers=headers or None)
                        break
                    except BufferError:
                        producer.poll(0.005)
        except (kafka.KafkaException, FutureTimeout) as exc:
            # The transaction cannot go on: end it (aborted, or abandoned to a
            # new producer when the gate group's offsets hung); this batch's
            # records come back with the rest of it.
            txn = self._txn or _OpenTransaction(self._seq + 1, self.generation, time.monotonic())
            self._seq = txn.seq
            txn.add(batch)
            self._txn = None
            if isinstance(exc, FutureTimeout):
                outcome = self._offsets_hung(txn)
            else:
                outcome = self._recover(txn, exc.args[0] if exc.args else None)
            self._settle(txn, outcome)
            return txn.seq
        self._txn.add(batch)
        return self._txn.seq

    def _void(self, batch: TakenBatch) -> None:
        """A batch taken before a transaction that did not commit: the loop
        takes the next batch while the last transaction commits, so when that
        one aborts, what was taken after it must come again too. Each of the
        batch's partitions goes back to the batch's first offset, unless the
        abort already put it further back (its records were in the aborted
        transaction) or it was given up (its new owner reads the committed offset)."""
        self._seek({p: o for p, o in batch.first.items() if p not in self._rewound})

    def has_settled(self) -> bool:
        """Whether a transaction was settled outside :meth:`commit` (by a rebalance)."""
        return bool(self._settled)

    @property
    def open_since(self) -> float | None:
        """``time.monotonic()`` when the open transaction began; None when none is open."""
        txn = self._txn
        return None if txn is None else txn.began

    async def commit(self) -> list[tuple[int, str]]:
        """Commit the open transaction, with the offsets of every batch sent in it.

        Returns every transaction settled since the last call, as (number,
        outcome): ``committed``; ``fenced`` (the group gave the partitions to
        another worker: nothing became visible, their new owner decides the
        records); ``aborted`` (nothing became visible; the consumer went back
        to the committed offsets, so the records come again). A rebalance may
        settle a transaction inside :meth:`take` (committed before its
        partitions are given up); its outcome is returned here too.
        """
        settled: list[tuple[int, str]] = await self._call(self._commit_open)
        return settled

    def _commit_open(self) -> list[tuple[int, str]]:
        txn, self._txn = self._txn, None
        if txn is not None:
            started = time.perf_counter()
            self._settle(txn, self._commit(txn))
            self.on_commit_seconds(time.perf_counter() - started)
        settled, self._settled = self._settled, []
        return settled

    def _settle(self, txn: _OpenTransaction, outcome: str) -> None:
        self._committed_at = time.monotonic()  # committed or aborted: its markers are being written
        if outcome == "fenced":
            log.warning("fenced from partitions %s: their new owner decides these records", sorted(txn.first))
        self._settled.append((txn.seq, outcome))
        self.on_result(outcome)

    def _commit(self, txn: _OpenTransaction) -> str:
        kafka = _kafka()
        producer = self._producer
        if txn.generation != self.generation:
            # NOTE: unreachable by design (a rebalance settles the open
            # transaction before it completes), kept as the rule it relies on.
            self._recover(txn, None)
            return "fenced"
        try:
            # Every batch's, and the group's check of this worker's generation now (a zombie is fenced here).
            offsets = [kafka.TopicPartition(self.topic, p, o) for p, o in txn.next_offsets.items()]
            self._send_offsets(producer, offsets, self._group_metadata())
        except kafka.KafkaException as exc:
            return self._recover(txn, exc.args[0] if exc.args else None)
        except FutureTimeout:
            return self._offsets_hung(txn)
        for attempt in range(COMMIT_RETRIES):
            try:
                producer.commit_transaction(TXN_CALL_TIMEOUT_S)
                self.committed_offsets.update(txn.next_offsets)
                producer.poll(0)  # delivery reports: none are awaited, free their memory
                return "committed"
            except kafka.KafkaException as exc:
                err = exc.args[0] if exc.args else None
                if err is not None and err.retriable() and attempt + 1 < COMMIT_RETRIES:
                    log.warning("commit of a transaction: %s; trying again", err)
                    continue  # librdkafka: a retriable commit error may be retried as is
                return self._recover(txn, err, may_have_committed=True)
        raise AssertionError("unreachable")

    def _offsets_hung(self, txn: _OpenTransaction) -> str:
        # Left hung on its thread: only a new producer (a new epoch, which
        # aborts this transaction) can go on; the records come again.
        log.warning(
            "sending the offsets of partitions %s hung for %.0f s (AddOffsetsToTxn to the transaction "
            "coordinator, or TxnOffsetCommit to the group coordinator, unanswered: a coordinator lost): "
            "the transaction is abandoned",
            sorted(txn.first),
            self.offsets_hung_s,
        )
        return self._recover(txn, None)

    def _group_metadata(self) -> Any:
        """The scoring group's metadata (generation, member id) for a
        transaction's offsets: read from the consumer once per rebalance.

        NOTE: ``consumer_group_metadata()`` is a round trip to librdkafka's
        main thread that confluent-kafka makes holding the GIL: every thread
        of the worker, the event loop scoring the next batch included, stops
        for it (50 µs on an idle machine, 2.5 ms at p99 and up to 5 ms with
        the cores busy, docs/performance.md). It was made at every commit.
        The metadata changes only with the group's generation, and librdkafka
        (classic protocol, cooperative-sticky) calls the assignment callback
        for every generation, an empty assignment included, which drops this
        copy. A copy older than the group's generation can only be refused by
        the coordinator (ILLEGAL_GENERATION: the transaction aborts and its
        records are decided again), never accepted: fencing is unchanged.
        """
        if self._metadata is None:
            self._metadata = self._consumer.consumer_group_metadata()
        return self._metadata

    def _send_offsets(self, producer: Any, offsets: list[Any], group_metadata: Any) -> None:
        """``send_offsets_to_transaction``, given up after ``offsets_hung_s``
        (raises concurrent.futures.TimeoutError): see OFFSETS_HUNG_S."""
        call = self._offsets_thread.submit(
            producer.send_offsets_to_transaction, offsets, group_metadata, TXN_CALL_TIMEOUT_S
        )
        try:
            call.result(self.offsets_hung_s)
        except FutureTimeout:
            # Its thread stays blocked in librdkafka; the next call gets a new one.
            self._offsets_thread.shutdown(wait=False)
            self._offsets_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="eos-offsets")
            raise

    def _recover(self, txn: _OpenTransaction, err: Any, *, may_have_committed: bool = False) -> str:
        """After a transaction that did not commit: abort it, or start a new
        producer (a new epoch aborts whatever the old one left open), then put
        its partitions back where it began.

        ``may_have_committed``: ``commit_transaction`` was called, and a commit
        whose answer was lost may have committed, so the partitions go back to
        the group's committed offsets, read with ``require_stable`` (after the
        abort they say exactly what became visible). Otherwise nothing of the
        transaction committed, and every batch taken since the last commit is
        in it: each partition goes back to its first offset in it, without
        asking the group coordinator, which may be the very broker just lost
        (a hung ``send_offsets_to_transaction``).
        """
        self._metadata = None  # refused for a generation gone by, maybe: read again for the next one
        kafka = _kafka()
        if err is not None:
            log.warning("transaction of partitions %s failed: %s", sorted(txn.first), err)
        try:
            if err is None or err.fatal() or not err.txn_requires_abort():
                raise kafka.KafkaException(err)
            self._producer.abort_transaction(TXN_CALL_TIMEOUT_S)
        except kafka.KafkaException as exc:
            # Fatal (fenced by its own id: a restart of this worker's slot, or
            # two workers given one FRAUD_WORKER_ID), or an outcome unknown.
            log.warning("transactional producer replaced after: %s", exc)
            self._replace_producer()
        kept = [p for p in txn.first if p in self.assigned]
        if kept and txn.generation == self.generation:
            committed = {p: -1 for p in kept}  # nothing committed: each goes back to its first offset
            if may_have_committed:
                # NOTE: never the first offsets instead: if it did commit, its
                # records would be taken again and answered twice.
                committed = self._committed_now(kept)
            # No committed offset (negative): the transaction's first offset is where it starts.
            rewound = {p: o if o >= 0 else txn.first[p] for p, o in committed.items()}
            if may_have_committed:
                # If it did commit, its state (the resend index's entries) is
                # in the changelog but not yet in this worker's store.
                self.restore(set(kept))
            self._seek(rewound)
            self._rewound |= rewound.keys()
        # Whatever was taken after this transaction is void: its records come again after these.
        self.generation += 1
        fenced = err is not None and err.code() in _fencing_codes()
        return "fenced" if fenced else "aborted"

    def _committed_now(self, partitions: list[int]) -> dict[int, int]:
        """The group's committed offset of each of ``partitions``, read with
        ``require_stable`` (librdkafka asks so under ``read_committed``) once
        every transaction of theirs has ended: asked again until each partition
        answers without an error, for up to ``COMMITTED_READ_FOR_S``.

        NOTE: librdkafka's ``committed()`` can return without raising while a
        partition's answer is an error: ``UNSTABLE_OFFSET_COMMIT`` (its
        transaction's markers not yet written, as just after a broker
        restarted) once the request's own retries ran out, with the offset
        ``OFFSET_INVALID``, which reads like "nothing committed". Each
        partition's error is checked.
        """
        kafka = _kafka()
        began = time.monotonic()
        deadline = began + COMMITTED_READ_FOR_S
        released = False
        while True:
            try:
                tps = [kafka.TopicPartition(self.topic, p) for p in partitions]
                answer = self._consumer.committed(tps, TXN_CALL_TIMEOUT_S)
                failed = [tp for tp in answer if tp.error is not None]
                if not failed:
                    return {tp.partition: tp.offset for tp in answer}
                why: object = f"partition {failed[0].partition}: {failed[0].error}"
            except kafka.KafkaException as exc:
                why = exc
            if time.monotonic() > deadline:
                raise kafka.KafkaException(
                    f"the committed offsets of partitions {sorted(partitions)} could not be read stable "
                    f"in {COMMITTED_READ_FOR_S:.0f} s ({why}); if no transaction of the group is open, one left "
                    "hanging on __consumer_offsets holds them (RELIABILITY.md, known gap 3): kafka-transactions.sh "
                    "find-hanging, then abort"
                )
            log.warning("reading the committed offsets of partitions %s: %s; trying again", sorted(partitions), why)
            if not released and time.monotonic() - began >= RELEASE_PENDING_AFTER_S:
                released = self._release(partitions)
            self._sleep(COMMITTED_READ_EVERY_S)

    def _release(self, partitions: list[int]) -> bool:
        """Drop whatever offsets of the group this worker's own producer left
        pending: a transaction of its own holding offsets of the group, aborted.
        Returns whether it ran.

        NOTE: Kafka 4.4.0 can complete a transaction without writing its marker
        on a partition that has no leader for a moment, as after the only
        broker restarted (RELIABILITY.md, known gap 3). If that partition is
        the group's ``__consumer_offsets`` one and the transaction had sent
        offsets, the group keeps them pending until this producer's next marker
        there, and answers every stable read of those partitions
        UNSTABLE_OFFSET_COMMIT meanwhile: this worker, waiting for that read
        (a new assignment, a commit of unknown outcome), would never commit
        again. An abort marker ends them. If the coordinator had aborted that
        transaction, that is its outcome; if it had committed it, its records
        are decided again and answered from the resend index (agreeing doubles),
        where a commit marker would have made an aborted transaction's offsets
        committed and skipped its records. Harmless when the pending offsets
        are another producer's (a live transaction: they end by themselves).
        Only with no transaction of this worker open (none is while it reads).
        """
        if self._txn is not None:
            return False
        kafka = _kafka()
        log.warning(
            "the committed offsets of partitions %s stay unstable: dropping any this worker's producer "
            "left pending (a transaction with offsets of the group, aborted)",
            sorted(partitions),
        )
        producer = self._producer
        try:
            producer.begin_transaction()
            try:
                offsets = [kafka.TopicPartition(self.topic, p, 0) for p in partitions]  # aborted: any offset
                self._send_offsets(producer, offsets, self._consumer.consumer_group_metadata())
            finally:
                producer.abort_transaction(TXN_CALL_TIMEOUT_S)
        except (kafka.KafkaException, FutureTimeout) as exc:
            log.warning("dropping this worker's pending offsets failed (%s): its producer is replaced", exc)
            self._replace_producer()
        return True

    async def hand_over(self, partitions: Iterable[int]) -> None:
        """Give ``partitions`` of the handover topic a handover record before
        the next transaction or take (a worker that starts: every partition
        its producer may have written in an earlier life)."""
        await self._call(self._handover_due.update, set(partitions))

    def _hand_over_if_due(self) -> None:
        """:meth:`_hand_over` what is due, if no transaction of this producer is open."""
        if self._handover_due and self._txn is None and time.monotonic() >= self._handover_at:
            self._hand_over()

    def _hand_over(self) -> None:
        """Write a handover record on each partition of ``handover_topic`` this
        producer may have written and no longer does, in a transaction of its
        own, committed; kept due and tried again if that fails.

        NOTE: Kafka 4.4.0 can complete a transaction without writing its
        marker on a partition that has no leader for a moment, as after the
        only broker restarted (RELIABILITY.md, known gap 3). Its records there
        then hang: the partition's last stable offset stays before them, and
        every ``read_committed`` reader (the gateway, clients, the resend
        index's restore) sees nothing written there after them, until a marker
        of the same producer reaches the partition. Written on the partition
        numbered as their input's, a worker's decisions reach a partition
        only while it owns that input partition, and a restarted broker moves
        partitions (the group rebalances): without this, the next marker might
        never come, and every later decision there would stay unseen. This
        record's commit marker commits the hanging records with it. For a
        transaction the coordinator committed, that is its outcome; for one it
        aborted, its records were decided again and answered from the resend
        index (agreeing doubles, as a skipped marker on a partition this
        worker still writes gives). With no marker missing, it is one empty
        record: readers skip a record with an empty value (docs/contract.md).
        A handover that aborts (the broker lost again before its commit) ends
        a hang the other way, its abort marker aborting the hanging records
        too: Kafka gives a producer no marker that commits without a commit.
        """
        due = sorted(self._handover_due - self.assigned)
        if not due:
            self._handover_due.clear()
            return
        kafka = _kafka()
        producer = self._producer
        topic = self.handover_topic
        try:
            producer.begin_transaction()
            for p in due:
                producer.produce(topic, b"", None, p, headers=[(HANDOVER_HEADER, b"")])
            for attempt in range(COMMIT_RETRIES):
                try:
                    producer.commit_transaction(TXN_CALL_TIMEOUT_S)
                    break
                except kafka.KafkaException as exc:
                    err = exc.args[0] if exc.args else None
                    if err is None or not err.retriable() or attempt + 1 == COMMIT_RETRIES:
                        raise
        except kafka.KafkaException as exc:
            log.warning("handing over partitions %s of %s failed (%s): tried again in %.0f s",
                        due, topic, exc, HANDOVER_RETRY_S)  # fmt: skip
            self._handover_at = time.monotonic() + HANDOVER_RETRY_S
            try:
                producer.abort_transaction(TXN_CALL_TIMEOUT_S)
            except kafka.KafkaException:
                self._replace_producer()  # fatal, or its state unknown: a new epoch ends what it left open
            return
        self._handover_due.clear()
        log.info("handed over partitions %s of %s (a commit marker of this producer on each)", due, topic)

    def _replace_producer(self) -> None:
        kafka = _kafka()
        old, self._producer = self._producer, None
        if old is not None:
            with contextlib.suppress(Exception):
                old.purge()  # its records belong to an aborted transaction
        deadline = time.monotonic() + 60.0
        while self._producer is None:
            try:
                self._producer = self._new_producer()
            except kafka.KafkaException as again:
                if time.monotonic() > deadline:
                    raise
                log.warning("new transactional producer failed: %s; trying again", again)
                time.sleep(0.5)

    def _seek(self, offsets: dict[int, int]) -> None:
        kafka = _kafka()
        for partition, offset in offsets.items():
            if partition not in self.assigned:
                continue  # its new owner reads the committed offset
            try:
                self._consumer.seek(kafka.TopicPartition(self.topic, partition, offset))
            except kafka.KafkaException as exc:
                # NOTE: going on from where the partition is would skip the
                # records being rewound (lost: their offsets commit with the
                # next transaction). Tried again before the next take.
                log.warning("seeking partition %d to %d failed: %s; trying again before the next take",
                            partition, offset, exc)  # fmt: skip
                self._unsought[partition] = offset

    # -- introspection -----------------------------------------------------------

    async def partition_count(self, topic: str) -> int:
        """How many partitions ``topic`` has (a metadata request); 0 if it does not exist."""

        def count() -> int:
            meta = self._consumer.list_topics(topic, TXN_CALL_TIMEOUT_S).topics.get(topic)
            return 0 if meta is None or meta.error is not None else len(meta.partitions)

        n: int = await self._call(count)
        return n

    def offsets(self) -> list[tuple[str, int, int | None, int | None]]:
        """(topic, partition, fetch highwater, committed offset) per assigned
        partition, from what the client already knows: no request per call."""
        consumer = self._consumer
        if consumer is None:
            return []
        kafka = _kafka()
        out: list[tuple[str, int, int | None, int | None]] = []
        for p in sorted(self.assigned):
            try:
                _, high = consumer.get_watermark_offsets(kafka.TopicPartition(self.topic, p), cached=True)
            except Exception:
                high = -1
            out.append((self.topic, p, high if high >= 0 else None, self.committed_offsets.get(p)))
        return out

    async def committed(self) -> dict[int, int]:
        """The group's committed offset of each assigned partition."""

        def read() -> dict[int, int]:
            kafka = _kafka()
            tps = [kafka.TopicPartition(self.topic, p) for p in sorted(self.assigned)]
            return {tp.partition: tp.offset for tp in self._consumer.committed(tps, 5.0) if tp.offset >= 0}

        result: dict[int, int] = await self._call(read)
        return result
