"""An in-memory Kafka behind librdkafka's API, for :mod:`app.eos` and the scoring loop.

:class:`FakeKafka` is the cluster: partitioned logs, consumer groups with a
generation (KIP-447), transactional ids with an epoch, and the committed view
a ``read_committed`` reader gets. :class:`FakeConsumer` and
:class:`FakeProducer` are real implementations of the parts of
``confluent_kafka.Consumer`` / ``Producer`` that ``ExactlyOnce`` calls, with
librdkafka's semantics where they matter:

- records produced in a transaction, and the offsets sent with it, become
  visible together when it commits, never when it aborts or its producer is
  replaced (a new ``init_transactions`` of the id aborts what the old epoch
  left open, and fences the old producer: its calls fail fatally);
- offsets carry the group metadata; the group refuses those of a generation it
  has left (``ILLEGAL_GENERATION``, abortable), except from a member inside its
  revocation callback (eager protocol: it commits before it rejoins);
- rebalances are served inside ``consume()`` (revoke everything, then assign),
  and that call returns nothing (fetching the new assignment takes a round
  trip); or, with ``after_fetch``, after records fetched under the old
  assignment, which come out of the same call (as librdkafka's queue can
  deliver them); ``close()`` revokes first, then leaves the group;
- a new assignment starts at the group's committed offsets, else at the start.

Errors are injected per call (``commit_errors`` and friends: each entry is a
``KafkaError`` raised by the next such call). Everything the cluster did is on
:attr:`FakeKafka.timeline`, in order.
"""

from __future__ import annotations

import threading
import zlib
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import orjson
from confluent_kafka import OFFSET_BEGINNING, OFFSET_INVALID, KafkaError, KafkaException, Message, TopicPartition

__all__ = ["FakeConsumer", "FakeKafka", "FakeProducer", "GroupMetadata", "error"]


def error(code: int, *, fatal: bool = False, retriable: bool = False, abortable: bool = False) -> KafkaError:
    """A librdkafka error as its transactional API raises them."""
    return KafkaError(code, f"injected {code}", fatal=fatal, retriable=retriable, txn_requires_abort=abortable)


@dataclass(frozen=True)
class _Answer:
    """One partition of a ``committed()`` answer that carries an error
    (confluent_kafka's TopicPartition cannot be given one)."""

    topic: str
    partition: int
    offset: int
    error: KafkaError | None


@dataclass(frozen=True)
class GroupMetadata:
    """What ``consumer_group_metadata()`` returns: opaque to the caller, read by the coordinator."""

    group: str
    member_id: str
    generation: int


@dataclass
class _Group:
    partitions: dict[str, int]
    generation: int = 0
    members: dict[str, FakeConsumer] = field(default_factory=dict)
    #: member id -> the generation it may still commit under while it revokes
    revoking: dict[str, int] = field(default_factory=dict)


@dataclass
class _Rebalance:
    generation: int
    partitions: set[int]
    after_fetch: bool = False
    lost: bool = False


@dataclass
class _Txn:
    records: list[tuple[str, int, bytes | None, bytes, list[tuple[str, bytes]] | None]] = field(default_factory=list)
    offsets: dict[tuple[str, str, int], int] = field(default_factory=dict)
    must_abort: bool = False


class FakeKafka:
    """The cluster: logs, groups, transactional ids."""

    def __init__(self, partitions: dict[str, int]) -> None:
        self.partitions = dict(partitions)
        self.logs: dict[tuple[str, int], list[Message]] = defaultdict(list)
        self.offsets: dict[tuple[str, str, int], int] = {}  # (group, topic, partition) -> next offset
        self.epochs: dict[str, int] = {}
        self.open: dict[str, _Txn] = {}  # transactional id -> its open transaction on the broker
        self.groups: dict[str, _Group] = {}
        self.timeline: list[tuple[Any, ...]] = []
        self.init_errors: list[KafkaError] = []
        self.produce_errors: list[KafkaError] = []
        #: The producer's local queue is full once, when the open transaction
        #: holds this many records (produce raises BufferError, as librdkafka's).
        self.queue_full_at: int | None = None
        self.offsets_errors: list[KafkaError] = []
        #: When set, send_offsets_to_transaction blocks until it is released, past
        #: any timeout: librdkafka's behaviour with its group coordinator lost.
        self.offsets_hang: threading.Event | None = None
        self.commit_errors: list[KafkaError] = []
        #: Commits that are made, after which the call raises this error all the
        #: same: the coordinator's answer lost (a broker killed meanwhile).
        self.commit_answers_lost: list[KafkaError] = []
        self.committed_errors: list[KafkaError] = []
        #: Reads of the committed offsets answered, per partition, with this error
        #: and ``OFFSET_INVALID`` (not raised: librdkafka's ``committed()`` once its
        #: own retries of an UNSTABLE_OFFSET_COMMIT answer ran out).
        self.committed_partition_errors: list[KafkaError] = []
        #: Transactional ids whose earlier transaction's offsets were left
        #: pending in the group, its marker on ``__consumer_offsets`` skipped
        #: (Kafka 4.4.0 after the only broker restarted): every stable read of
        #: the group is answered UNSTABLE_OFFSET_COMMIT, per partition, until a
        #: marker of that producer there (a transaction of its with offsets of
        #: the group, committed or aborted) ends them.
        self.offsets_left_pending: set[str] = set()
        #: Partitions whose next transaction marker is skipped (Kafka 4.4.0, the
        #: same known gap): the next commit there leaves its records hanging.
        self.skip_marker: set[tuple[str, int]] = set()
        #: Per hanging partition, the transactional id and the first offset
        #: of its records there: ``read_committed`` readers see nothing of the
        #: partition from that offset on, until a commit marker of the same id
        #: reaches it (a transaction of that id that wrote there commits; an
        #: abort's marker would abort them, which is not modelled).
        self.hanging: dict[tuple[str, int], tuple[str, int]] = {}
        #: Reads of the group's committed offsets (a round trip to its coordinator).
        self.committed_reads = 0
        #: Partitions whose committed offset the client itself does not learn at
        #: their next assignment, as librdkafka 2.16 when the answer was
        #: UNSTABLE_OFFSET_COMMIT while the assignment changed: it starts them by
        #: ``auto.offset.reset`` (earliest) unless the application assigns them
        #: with an offset inside its callback.
        self.positions_lost: set[int] = set()
        self.producers: list[FakeProducer] = []
        self.consumers: list[FakeConsumer] = []
        #: Incremental rebalancing (cooperative-sticky, the worker's assignor):
        #: a member is told only the partitions it loses and those it gains.
        #: False: eager (every partition revoked, then the new assignment).
        self.cooperative = False

    # -- factories: what ExactlyOnce's consumer_factory / producer_factory get ----

    def consumer(self, config: dict[str, object]) -> FakeConsumer:
        consumer = FakeConsumer(self, config)
        self.consumers.append(consumer)
        return consumer

    def producer(self, config: dict[str, object]) -> FakeProducer:
        producer = FakeProducer(self, config)
        self.producers.append(producer)
        return producer

    # -- what a test does to the cluster ---------------------------------------------

    def append(
        self, topic: str, partition: int, value: bytes, key: bytes | None = None,
        headers: list[tuple[str, bytes]] | None = None, timestamp_ms: int | None = None,
    ) -> int:  # fmt: skip
        """A record written outside any transaction (visible at once); returns its offset."""
        log = self.logs[(topic, partition)]
        ts = (1, timestamp_ms) if timestamp_ms is not None else (0, 0)  # TIMESTAMP_CREATE_TIME / NOT_AVAILABLE
        log.append(Message(topic=topic, partition=partition, offset=len(log), key=key, value=value,
                           headers=headers, timestamp=ts))  # fmt: skip
        return len(log) - 1

    def rebalance(self, group: str, assignment: dict[FakeConsumer, set[int]], *, after_fetch: bool = False) -> None:
        """A new generation of ``group`` with ``assignment``. A member left out
        was kicked (its session expired): it learns so at its next ``consume``,
        and the group refuses its offsets from now on."""
        g = self.groups[group]
        g.generation += 1
        for member_id, consumer in list(g.members.items()):
            if consumer not in assignment:
                del g.members[member_id]
                g.revoking.pop(member_id, None)
                consumer.pending.append(_Rebalance(g.generation, set(), after_fetch, lost=True))
        for consumer, partitions in assignment.items():
            if consumer.member_id in g.members:
                g.revoking[consumer.member_id] = consumer.generation
            g.members[consumer.member_id] = consumer
            consumer.pending.append(_Rebalance(g.generation, set(partitions), after_fetch))
        self.timeline.append(("rebalance", group, g.generation))

    def _even(self, group: str) -> None:
        g = self.groups[group]
        members = list(g.members.values())
        topic = next(iter(g.partitions))
        assignment: dict[FakeConsumer, set[int]] = {m: set() for m in members}
        for p in range(g.partitions[topic]):
            if members:
                assignment[members[p % len(members)]].add(p)
        self.rebalance(group, assignment)

    # -- what a test reads -------------------------------------------------------------

    def visible(self, topic: str) -> list[Message]:
        """Every committed record of ``topic`` before any hanging transaction
        (what read_committed readers see), by partition."""
        return [
            m
            for p in range(self.partitions.get(topic, 1))
            for m in self.logs[(topic, p)][: self.hanging.get((topic, p), ("", None))[1]]
        ]

    def values(self, topic: str) -> list[dict[str, Any]]:
        return [orjson.loads(m.value()) for m in self.visible(topic)]

    def committed(self, group: str, topic: str) -> dict[int, int]:
        return {p: o for (g, t, p), o in self.offsets.items() if g == group and t == topic}

    def events(self, kind: str) -> list[tuple[Any, ...]]:
        return [e for e in self.timeline if e[0] == kind]


class FakeConsumer:
    """The parts of ``confluent_kafka.Consumer`` that ExactlyOnce uses."""

    _next_member = 0

    def __init__(self, kafka: FakeKafka, config: dict[str, object]) -> None:
        assert config["isolation.level"] == "read_committed" and config["enable.auto.commit"] is False
        self.kafka = kafka
        self.config = config
        self.group = str(config["group.id"])
        FakeConsumer._next_member += 1
        self.member_id = f"{self.group}-member-{FakeConsumer._next_member}"
        self.generation = 0
        self.topic = ""
        self.assigned: set[int] = set()
        self.positions: dict[int, int] = {}
        self.pending: list[_Rebalance] = []
        self.seeks: list[tuple[int, int]] = []
        self.closed = False
        self._callbacks: dict[str, Any] = {}

    def subscribe(self, topics: list[str], on_assign: Any = None, on_revoke: Any = None, on_lost: Any = None) -> None:
        (self.topic,) = topics
        self._callbacks = {"assign": on_assign, "revoke": on_revoke, "lost": on_lost}
        group = self.kafka.groups.setdefault(self.group, _Group({self.topic: self.kafka.partitions[self.topic]}))
        group.members[self.member_id] = self
        self.kafka._even(self.group)  # joining is a rebalance

    def consume(self, num_messages: int = 1, timeout: float = -1) -> list[Message]:
        if self.closed:
            raise RuntimeError("Consumer closed")
        before = [e for e in self.pending if not e.after_fetch]
        for event in before:
            self._rebalanced(event)
        if before:
            return []  # a new assignment's first fetch is a round trip away: not in this call
        out = self._fetch(num_messages)
        for event in list(self.pending):
            self._rebalanced(event)
        return out

    def _fetch(self, n: int) -> list[Message]:
        out: list[Message] = []
        for p in sorted(self.assigned):
            log = self.kafka.logs[(self.topic, p)]
            while len(out) < n and self.positions[p] < len(log):
                out.append(log[self.positions[p]])
                self.positions[p] += 1
        return out

    def _rebalanced(self, event: _Rebalance) -> None:
        """Eager: every partition revoked, then the whole new assignment.
        Incremental (``kafka.cooperative``): only the partitions lost, then
        those gained (an empty assignment after a revocation, as librdkafka)."""
        self.pending.remove(event)
        new = set() if event.lost else set(event.partitions)
        keep = self.assigned & new if self.kafka.cooperative else set()
        gone = sorted(self.assigned - keep)
        kind = "lost" if event.lost else "revoke"
        if gone or event.lost:
            self._callbacks[kind](self, [TopicPartition(self.topic, p) for p in gone])
            self.kafka.timeline.append((kind, self.member_id, gone))
        self.assigned = keep
        self.positions = {p: o for p, o in self.positions.items() if p in keep}
        self.kafka.groups[self.group].revoking.pop(self.member_id, None)
        if event.lost:
            return
        self.generation = event.generation
        added = sorted(new - keep)
        self.assigned = new
        for p in added:  # where the group committed, else the start (auto.offset.reset earliest)
            lost = p in self.kafka.positions_lost
            self.kafka.positions_lost.discard(p)
            self.positions[p] = 0 if lost else self.kafka.offsets.get((self.group, self.topic, p), 0)
        self.kafka.timeline.append(("assign", self.member_id, added))
        self._callbacks["assign"](self, [TopicPartition(self.topic, p) for p in added])

    def incremental_assign(self, partitions: list[TopicPartition]) -> None:
        """Inside the assignment callback: these partitions start at the given
        offsets (``OFFSET_BEGINNING``: the log's start), not where the client
        would have started them."""
        for tp in partitions:
            assert tp.partition in self.assigned, "only what the group assigned"
            self.positions[tp.partition] = 0 if tp.offset == OFFSET_BEGINNING else tp.offset

    def seek(self, partition: TopicPartition) -> None:
        if partition.partition not in self.assigned:
            raise KafkaException(error(KafkaError._UNKNOWN_PARTITION))
        self.positions[partition.partition] = partition.offset
        self.seeks.append((partition.partition, partition.offset))

    def committed(self, partitions: list[TopicPartition], timeout: float | None = None) -> list[Any]:
        self.kafka.committed_reads += 1
        if self.kafka.committed_errors:
            raise KafkaException(self.kafka.committed_errors.pop(0))
        if self.kafka.committed_partition_errors:
            err = self.kafka.committed_partition_errors.pop(0)
            return [_Answer(tp.topic, tp.partition, OFFSET_INVALID, err) for tp in partitions]
        if self.kafka.offsets_left_pending:
            unstable = error(KafkaError.UNSTABLE_OFFSET_COMMIT)
            return [_Answer(tp.topic, tp.partition, OFFSET_INVALID, unstable) for tp in partitions]
        return [
            TopicPartition(tp.topic, tp.partition, self.kafka.offsets.get((self.group, tp.topic, tp.partition),
                                                                          OFFSET_INVALID))
            for tp in partitions
        ]  # fmt: skip

    def consumer_group_metadata(self) -> GroupMetadata:
        if not self.topic:  # never subscribed: no member, no generation (librdkafka's -1)
            return GroupMetadata(self.group, "", -1)
        return GroupMetadata(self.group, self.member_id, self.generation)

    def get_watermark_offsets(
        self, partition: TopicPartition, timeout: float | None = None, cached: bool = False
    ) -> tuple[int, int]:
        return 0, len(self.kafka.logs[(partition.topic, partition.partition)])

    def close(self) -> None:
        if self.closed:
            return
        if self.assigned:  # librdkafka serves the revocation inside close()
            old = sorted(self.assigned)
            self._callbacks["revoke"](self, [TopicPartition(self.topic, p) for p in old])
            self.kafka.timeline.append(("revoke", self.member_id, old))
        self.closed = True
        self.assigned = set()
        group = self.kafka.groups.get(self.group)
        if group is not None and self.member_id in group.members:
            del group.members[self.member_id]
            group.revoking.pop(self.member_id, None)
            if group.members:
                self.kafka._even(self.group)


class FakeProducer:
    """The parts of a transactional ``confluent_kafka.Producer`` that ExactlyOnce uses."""

    def __init__(self, kafka: FakeKafka, config: dict[str, object]) -> None:
        assert config["enable.idempotence"] is True and config["acks"] == "all"
        self.kafka = kafka
        self.config = config
        self.id = str(config["transactional.id"])
        self.epoch: int | None = None
        self.txn: _Txn | None = None
        self.fatal: KafkaError | None = None

    def _usable(self) -> None:
        if self.fatal is not None:
            raise KafkaException(self.fatal)
        if self.epoch is None:
            raise KafkaException(error(KafkaError._STATE))
        if self.kafka.epochs[self.id] != self.epoch:  # a newer init_transactions of this id
            self.fatal = error(KafkaError._FENCED, fatal=True)
            raise KafkaException(self.fatal)

    def _open(self) -> _Txn:
        self._usable()
        if self.txn is None:
            raise KafkaException(error(KafkaError._STATE))
        return self.txn

    def init_transactions(self, timeout: float | None = None) -> None:
        if self.kafka.init_errors:
            raise KafkaException(self.kafka.init_errors.pop(0))
        self.epoch = self.kafka.epochs[self.id] = self.kafka.epochs.get(self.id, 0) + 1
        left = self.kafka.open.pop(self.id, None)  # a new epoch aborts what the id left open
        self.kafka.timeline.append(("init", self.id, self.epoch, left is not None))

    def begin_transaction(self) -> None:
        self._usable()
        if self.txn is not None:
            raise KafkaException(error(KafkaError._STATE))
        self.txn = self.kafka.open[self.id] = _Txn()

    def produce(
        self, topic: str, value: bytes | None = None, key: bytes | None = None, partition: int = -1,
        on_delivery: Any = None, timestamp: int = 0, headers: list[tuple[str, bytes]] | None = None,
    ) -> None:  # fmt: skip
        txn = self._open()
        if self.kafka.produce_errors:
            raise KafkaException(self.kafka.produce_errors.pop(0))
        if self.kafka.queue_full_at is not None and len(txn.records) == self.kafka.queue_full_at:
            self.kafka.queue_full_at = None
            raise BufferError("Local: Queue full")
        if partition < 0:
            n = self.kafka.partitions.get(topic, 1)
            partition = zlib.crc32(key) % n if key is not None else 0
        txn.records.append((topic, partition, key, value or b"", headers))

    def send_offsets_to_transaction(
        self, positions: list[TopicPartition], group_metadata: GroupMetadata, timeout: float | None = None
    ) -> None:
        txn = self._open()
        if self.kafka.offsets_hang is not None:
            self.kafka.offsets_hang.wait()
            txn = self._open()  # fenced meanwhile, most likely
        if self.kafka.offsets_errors:
            err = self.kafka.offsets_errors.pop(0)
            txn.must_abort = err.txn_requires_abort()
            raise KafkaException(err)
        group = self.kafka.groups.get(group_metadata.group)
        member = group_metadata.member_id
        if group is None and member == "" and group_metadata.generation < 0:
            pass  # a group no consumer has joined: a "simple" commit, accepted unchecked
        elif group is None or member not in group.members:
            txn.must_abort = True
            raise KafkaException(error(KafkaError.UNKNOWN_MEMBER_ID, abortable=True))
        elif group_metadata.generation not in (group.generation, group.revoking.get(member)):
            txn.must_abort = True
            raise KafkaException(error(KafkaError.ILLEGAL_GENERATION, abortable=True))
        for tp in positions:
            txn.offsets[(group_metadata.group, tp.topic, tp.partition)] = tp.offset

    def commit_transaction(self, timeout: float | None = None) -> None:
        txn = self._open()
        if self.kafka.commit_errors:
            err = self.kafka.commit_errors.pop(0)
            if err.fatal():
                self.fatal = err
            txn.must_abort = txn.must_abort or err.txn_requires_abort()
            raise KafkaException(err)
        if txn.must_abort:
            raise KafkaException(error(KafkaError._STATE, abortable=True))
        self._mark(txn)
        for topic, partition, key, value, headers in txn.records:
            log = self.kafka.logs[(topic, partition)]
            if (topic, partition) in self.kafka.skip_marker:
                self.kafka.skip_marker.discard((topic, partition))
                self.kafka.hanging[(topic, partition)] = (self.id, len(log))
            log.append(Message(topic=topic, partition=partition, offset=len(log), key=key, value=value,
                               headers=headers, timestamp=(1, 0)))  # fmt: skip
        self.kafka.offsets.update(txn.offsets)
        if txn.offsets:
            # Its marker: the earlier pending offsets committed with it (what
            # the broker does; a skipped abort's offsets become committed).
            self.kafka.offsets_left_pending.discard(self.id)
        self.kafka.timeline.append(
            ("commit", self.id, {(t, p): o for (g, t, p), o in txn.offsets.items() if g in self.kafka.groups},
             [r[2] for r in txn.records])
        )
        self.txn = None
        self.kafka.open.pop(self.id, None)
        if self.kafka.commit_answers_lost:
            err = self.kafka.commit_answers_lost.pop(0)
            if err.fatal():
                self.fatal = err
            raise KafkaException(err)

    def abort_transaction(self, timeout: float | None = None) -> None:
        self._usable()
        if self.txn is not None:
            self.kafka.timeline.append(("abort", self.id, len(self.txn.records)))
            if self.txn.offsets:  # its marker on __consumer_offsets drops the earlier pending ones too
                self.kafka.offsets_left_pending.discard(self.id)
        self.txn = None
        self.kafka.open.pop(self.id, None)

    def _mark(self, txn: _Txn) -> None:
        """This transaction's commit markers: each partition it wrote that an
        earlier transaction of this id left hanging is hanging no more."""
        for topic, partition, *_ in txn.records:
            if self.kafka.hanging.get((topic, partition), ("",))[0] == self.id:
                del self.kafka.hanging[(topic, partition)]

    def poll(self, timeout: float | None = None) -> int:
        return 0

    def flush(self, timeout: float | None = None) -> int:
        return 0
