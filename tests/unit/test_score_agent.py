"""The scoring agent's batch, in process: admit, reload, score, shadow, commit, cache.

:func:`agents.score.handle_batch` runs with the real collaborators the worker
builds (``TransactionCommits`` over a ``TransactionalEmitter``, a ``Scorer``,
a ``Reloader``, ``WorkerMetrics``). What stands in for the outside world:

- :class:`Broker`, an in-memory Kafka for transactional producers (records
  and a group's offsets become visible only when a transaction commits; a
  newer producer of a transactional id fences the older one; offsets of a
  group generation that is not the current one are refused, KIP-447), whose
  :meth:`Broker.producer` is the emitter's producer factory;
- :class:`Consumer`, faust's consumer as ``TransactionCommits`` uses it
  (seeks, the committed offsets read on its thread at assignment, through
  the group coordinator's OffsetFetch v7 of :class:`Coordinator`);
- the Scorer's in-memory feature store and decision cache, and constant models.

Events are faust ``Message`` objects, as ``stream.take_events`` hands them over.
"""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Literal

import orjson
import pytest
from aiokafka.errors import KafkaError, ProducerFenced
from faust.types import TP
from faust.types.tuples import Message

import app.commits
from agents.metrics import WorkerMetrics
from agents.reload import Reloader
from agents.score import handle_batch
from app.commits import TransactionCommits
from app.contract import Transaction
from app.group_fencing import GenerationFenced, GroupMember, OffsetFetchRequest_v7, StableOffsetFetchRequest
from app.settings import Settings
from app.transactional import TransactionalEmitter
from models.lifecycle import SHADOW
from models.registry import CURRENT
from pipeline.cache import InMemoryDecisionCache
from pipeline.feature_store import InMemoryFeatureStore
from pipeline.scorer import BatchOutput, Scorer
from tests.factories import RULES, ConstantModel, tx_doc

TOPIC = "transactions"
GROUP = "fraud-unit-agent"
OUTPUTS = {"decisions": "decisions", "dead_letters": "dead-letters", "feedback": "feedback", "monitoring": "monitoring"}


# --- the outside world -------------------------------------------------------------------------


class Broker:
    """Kafka as a transactional producer and a group coordinator see it, in memory."""

    def __init__(self) -> None:
        self.log: dict[str, list[tuple[bytes | None, bytes]]] = defaultdict(list)
        self.offsets: dict[tuple[str, int], int] = {}  # the group's committed offsets
        self.epochs: dict[str, int] = {}  # transactional id -> newest producer epoch
        self.generation = 0  # the group's generation: each Worker.assign is a rebalance
        self.members: set[str] = set()
        self.fail_commits = 0  # the next N commits abort (a broker error)
        self.fail_offset_reads = 0  # the next N OffsetFetch requests fail
        self.commits = 0
        #: ("commit", partition, transaction ids) and ("cache", transaction ids), in order
        self.timeline: list[tuple[Any, ...]] = []

    def producer(self, **options: Any) -> Producer:
        """The emitter's producer factory (``AIOKafkaProducer``'s keywords)."""
        return Producer(self, options["transactional_id"])

    def decisions(self) -> list[dict[str, Any]]:
        return [orjson.loads(value) for _, value in self.log[OUTPUTS["decisions"]]]

    def records(self, kind: str) -> list[tuple[bytes | None, bytes]]:
        return self.log[OUTPUTS[kind]]


class Producer:
    """The transactional side of ``AIOKafkaProducer`` that the emitter uses."""

    def __init__(self, broker: Broker, transactional_id: str) -> None:
        self.broker = broker
        self.id = transactional_id
        self.epoch = 0
        self._sent: list[tuple[str, bytes | None, bytes]] = []
        self._offsets: dict[tuple[str, int], int] = {}

    async def start(self) -> None:  # InitProducerId: a new epoch fences the previous holder of the id
        self.epoch = self.broker.epochs[self.id] = self.broker.epochs.get(self.id, 0) + 1

    async def stop(self) -> None:
        pass

    async def begin_transaction(self) -> None:
        self._sent, self._offsets = [], {}

    async def send(
        self, topic: str, value: bytes, key: bytes | None = None, headers: list[tuple[str, bytes]] | None = None
    ) -> None:
        self._sent.append((topic, key, value))

    async def send_offsets_to_transaction(self, offsets: dict[Any, int], group_id: str) -> None:
        assert group_id == GROUP
        if isinstance(group_id, GroupMember) and (
            group_id.generation_id != self.broker.generation or group_id.member_id not in self.broker.members
        ):  # TxnOffsetCommit v3: the coordinator refuses an older generation
            raise GenerationFenced(f"generation {group_id.generation_id} is not {self.broker.generation}")
        self._offsets.update({(tp.topic, tp.partition): n for tp, n in offsets.items()})

    async def commit_transaction(self) -> None:
        if self.epoch != self.broker.epochs[self.id]:
            raise ProducerFenced()
        if self.broker.fail_commits:
            self.broker.fail_commits -= 1
            raise KafkaError("the broker aborted the transaction")
        for topic, key, value in self._sent:
            self.broker.log[topic].append((key, value))
        self.broker.offsets.update(self._offsets)
        self.broker.commits += 1
        ids = [key.decode() for topic, key, _ in self._sent if topic == OUTPUTS["decisions"] and key]
        self.broker.timeline.append(("commit", [p for _, p in self._offsets], ids))
        self._sent, self._offsets = [], {}

    async def abort_transaction(self) -> None:
        self._sent, self._offsets = [], {}


class Consumer:
    """faust's consumer as ``TransactionCommits`` uses it, and the aiokafka
    consumer on its thread that reads the group's committed offsets."""

    def __init__(self, broker: Broker, member_id: str) -> None:
        self.broker = broker
        self.seeks: list[tuple[int, int]] = []
        self._thread = self
        self._coordinator = Coordinator(broker, member_id)

    async def seek(self, tp: Any, offset: int) -> None:
        self.seeks.append((tp.partition, offset))

    async def call_thread(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        # As mode's QueueServiceThread.call_thread(method, *args, **kwargs).
        return await fn(*args, **kwargs)

    def _ensure_consumer(self) -> Consumer:
        return self

    async def committed(self, tp: Any) -> int | None:  # scope "partition" reads this way
        return self.broker.offsets.get((tp.topic, tp.partition))

    async def beginning_offsets(self, tps: Sequence[Any]) -> dict[Any, int]:
        return {tp: 0 for tp in tps}


class Coordinator:
    """The group as aiokafka's ``GroupCoordinator`` holds it, answering OffsetFetch v7."""

    def __init__(self, broker: Broker, member_id: str) -> None:
        self.broker = broker
        self.member_id = member_id
        self.generation = -1

    def join(self) -> None:
        """A rebalance this member took part in: the group's generation moves on."""
        self.broker.generation += 1
        self.broker.members.add(self.member_id)
        self.generation = self.broker.generation

    async def ensure_coordinator_known(self) -> None:
        pass

    async def _send_req(self, request: StableOffsetFetchRequest) -> Any:
        if self.broker.fail_offset_reads:
            self.broker.fail_offset_reads -= 1
            raise KafkaError("the group coordinator is not available")  # not retriable: the read gives up
        wire = request.build(OffsetFetchRequest_v7)
        assert wire.group_id == GROUP and wire.require_stable
        topics = [
            (name, [(p, self.broker.offsets.get((name, p), -1), -1, "", 0, {}) for p in parts], {})
            for name, parts, _tags in wire.topics
        ]
        return SimpleNamespace(topics=topics, error_code=0)


@dataclass
class App:
    consumer: Consumer


class RecordingCache(InMemoryDecisionCache):
    """The decision cache, noting on the broker's timeline when decisions are stored."""

    def __init__(self, timeline: list[tuple[Any, ...]]) -> None:
        super().__init__()
        self.timeline = timeline
        self.stored: list[str] = []

    async def put_many(self, items: Sequence[tuple[Transaction, dict[str, Any]]]) -> None:
        ids = [tx.transaction_id for tx, _ in items]
        self.timeline.append(("cache", ids))
        self.stored += ids
        await super().put_many(items)


@dataclass
class Event:
    """What ``stream.take_events`` yields: the agent reads its ``message`` only."""

    message: Message


def event(partition: int, offset: int, value: dict[str, Any] | bytes) -> Event:
    raw = value if isinstance(value, bytes) else orjson.dumps(value)
    headers = [("correlation-id", f"c-{partition}-{offset}".encode())]  # faust hands headers as pairs
    return Event(Message(TOPIC, partition, offset, time.time() - 0.01, 0, headers, None, raw, None,
                         tp=TP(TOPIC, partition)))  # fmt: skip


def events(partition: int, offsets: range, prefix: str = "t-agent") -> list[Event]:
    """Valid transactions of distinct content (none is a resend of another)."""
    now = time.time()
    docs = {o: tx_doc(o, now, transaction_id=f"{prefix}-{partition}-{o}", amount=10.0 + 1000 * partition + o)
            for o in offsets}  # fmt: skip
    return [event(partition, o, doc) for o, doc in docs.items()]


# --- a worker: the agent's collaborators, built as create_app builds them ---------------------


class Worker:
    def __init__(
        self,
        broker: Broker,
        registry: Path,
        models: dict[str, ConstantModel],
        serving: str,
        scope: Literal["batch", "partition"] = "batch",
    ) -> None:
        self.broker = broker
        self.app = App(Consumer(broker, member_id=f"member-{id(self)}"))
        emitter = TransactionalEmitter(
            app_id=GROUP, group_id=GROUP, topic=TOPIC, producer_options={}, factory=broker.producer, scope=scope
        )
        self.commits = TransactionCommits(self.app, TOPIC, emitter, topics=OUTPUTS)
        self.cache = RecordingCache(broker.timeline)
        model = models[serving]
        self.scorer = Scorer(model=model, rules=RULES, store=InMemoryFeatureStore(), cache=self.cache,
                             model_budget_s=2.0)  # fmt: skip
        (registry / CURRENT).write_text(serving)
        self.reloader = Reloader(
            registry=registry, rules_path=registry / "rules.json", model=model, rules=RULES, check_every_s=0.0,
            load=lambda _registry, version: models[version],
        )  # fmt: skip
        self.metrics = WorkerMetrics(Settings())

    async def assign(self, *partitions: int) -> None:
        self.app.consumer._coordinator.join()
        await self.commits.on_assigned({TP(TOPIC, p) for p in partitions})

    async def batch(self, batch: Sequence[Event]) -> BatchOutput | None:
        return await handle_batch(
            batch, commits=self.commits, scorer=self.scorer, reloader=self.reloader, metrics=self.metrics
        )

    def messages_observed(self) -> float:
        return self.metrics.registry.get_sample_value("fraud_messages_total") or 0.0


@pytest.fixture
def broker() -> Broker:
    return Broker()


@pytest.fixture
def models() -> dict[str, ConstantModel]:
    return {"v1": ConstantModel(0.1, version="v1"), "v2": ConstantModel(0.2, version="v2")}


@pytest.fixture
def worker(broker: Broker, tmp_path: Path, models: dict[str, ConstantModel]) -> Worker:
    return Worker(broker, tmp_path, models, serving="v1")


def ids(decisions: Sequence[dict[str, Any]]) -> list[str]:
    return [d["transaction_id"] for d in decisions]


# --- tests ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("scope", ["batch", "partition"])
def test_each_admitted_event_gets_exactly_one_decision_committed_with_its_offset(
    broker: Broker, tmp_path: Path, models: dict[str, ConstantModel], scope: Literal["batch", "partition"]
) -> None:
    worker = Worker(broker, tmp_path, models, serving="v1", scope=scope)
    if scope == "partition":  # a broker before 2.5: no stable OffsetFetch, and none needed
        broker.fail_offset_reads = 10

    async def go() -> None:
        await worker.assign(0, 1)
        first = events(0, range(0, 4)) + events(1, range(0, 3))
        await worker.batch(first)
        # faust delivers some again (a seek, a rebalance): only offset 4 is new.
        await worker.batch(first[2:4] + events(0, range(4, 5)))

    asyncio.run(go())
    expected = [f"t-agent-0-{o}" for o in range(5)] + [f"t-agent-1-{o}" for o in range(3)]
    assert sorted(ids(broker.decisions())) == sorted(expected)
    assert {d["cached"] for d in broker.decisions()} == {False}
    assert broker.offsets == {(TOPIC, 0): 5, (TOPIC, 1): 3}
    partitions = [(sorted(entry[1]), sorted(entry[2])) for entry in broker.timeline if entry[0] == "commit"]
    if scope == "batch":  # one transaction per batch, with every partition's offsets and decisions
        assert partitions == [([0, 1], sorted(expected[:4] + expected[5:])), ([0], ["t-agent-0-4"])]
    else:  # one transaction per input partition and batch, holding that partition's decisions
        assert partitions == [
            ([0], [f"t-agent-0-{o}" for o in range(4)]),
            ([1], [f"t-agent-1-{o}" for o in range(3)]),
            ([0], ["t-agent-0-4"]),
        ]
    assert worker.messages_observed() == 8


def test_an_unreadable_record_gets_its_dead_letter_committed_and_its_offset_moves(
    worker: Worker, broker: Broker
) -> None:
    async def go() -> None:
        await worker.assign(0)
        await worker.batch([*events(0, range(0, 1)), event(0, 1, b"\xff not json"), *events(0, range(2, 3))])

    asyncio.run(go())
    assert ids(broker.decisions()) == ["t-agent-0-0", "t-agent-0-2"]
    assert len(broker.records("dead_letters")) == 1
    assert broker.offsets == {(TOPIC, 0): 3}


def test_decisions_reach_the_cache_only_after_their_transaction_committed(worker: Worker, broker: Broker) -> None:
    async def go() -> None:
        await worker.assign(0, 1)
        await worker.batch(events(0, range(0, 3)) + events(1, range(0, 2)))

    asyncio.run(go())
    kinds = [entry[0] for entry in broker.timeline]
    assert kinds == ["commit", "cache"]  # one transaction for both partitions, then the cache
    committed = {i for entry in broker.timeline if entry[0] == "commit" for i in entry[2]}
    assert set(broker.timeline[-1][1]) == committed == set(ids(broker.decisions()))


def test_a_failed_transaction_is_retried_and_its_decisions_committed_once(worker: Worker, broker: Broker) -> None:
    broker.fail_commits = 1

    async def go() -> None:
        await worker.assign(0)
        await worker.batch(events(0, range(0, 3)))

    asyncio.run(go())
    assert ids(broker.decisions()) == ["t-agent-0-0", "t-agent-0-1", "t-agent-0-2"]
    assert broker.offsets == {(TOPIC, 0): 3}
    assert worker.cache.stored == ids(broker.decisions())


def test_a_producer_whose_id_was_taken_is_replaced_and_the_batch_committed_once(
    worker: Worker, broker: Broker
) -> None:
    """Scope ``batch``: the worker's transactional id is its own, not a
    partition's. If something else takes it (a restart of the same worker slot
    with the same FRAUD_WORKER_ID bumps its epoch), the commit fails as a
    failure, not as a lost partition: the worker keeps its partitions, starts a
    fresh producer and commits the same batch once."""
    emitter = worker.commits.emitter

    async def go() -> None:
        await worker.assign(0)
        await worker.batch(events(0, range(0, 2)))
        broker.epochs[emitter.worker_transactional_id] += 1  # the id's epoch moved on elsewhere
        await worker.batch(events(0, range(2, 4)))

    asyncio.run(go())
    assert ids(broker.decisions()) == [f"t-agent-0-{o}" for o in range(4)]
    assert broker.offsets == {(TOPIC, 0): 4}
    assert emitter.partitions == frozenset({0})
    assert worker.cache.stored == ids(broker.decisions())


def test_a_takeover_whose_offset_read_fails_admits_nothing_and_is_tried_again(worker: Worker, broker: Broker) -> None:
    """The committed offsets cannot be read at assignment (the coordinator is
    away): that batch is decided by nobody yet, the worker keeps running, and
    the next batch takes the partition over from its committed offset; the
    records skipped meanwhile are sought back to, not lost."""
    broker.offsets[(TOPIC, 0)] = 2  # decided before, by the previous owner
    broker.fail_offset_reads = 1

    async def go() -> tuple[BatchOutput | None, list[tuple[int, int]]]:
        await worker.assign(0)
        first = await worker.batch(events(0, range(2, 4)))
        await worker.batch(events(0, range(4, 6)))  # a hole: 2 and 3 were never decided
        await worker.batch(events(0, range(2, 6)))  # what the seek back delivers
        return first, worker.app.consumer.seeks

    first, seeks = asyncio.run(go())
    assert first is None
    assert (0, 2) in seeks
    assert ids(broker.decisions()) == [f"t-agent-0-{o}" for o in range(2, 6)]
    assert broker.offsets == {(TOPIC, 0): 6}


class Exited(BaseException):
    pass


def test_a_batch_whose_commit_fails_is_not_cached_and_is_decided_afresh_after_the_restart(
    broker: Broker, tmp_path: Path, models: dict[str, ConstantModel], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The worker exits (code 75) without committing; the next one decides the
    batch again, from scratch: nothing of the failed batch is in the cache to
    answer it as a resend."""

    def exit_(code: int) -> None:
        raise Exited(code)

    monkeypatch.setattr(app.commits, "COMMIT_ATTEMPTS", 2)
    monkeypatch.setattr(app.commits.os, "_exit", exit_)
    broker.fail_commits = 2
    batch = events(0, range(0, 3))
    failing = Worker(broker, tmp_path, models, serving="v1")

    async def fail() -> None:
        await failing.assign(0)
        with pytest.raises(Exited) as exited:
            await failing.batch(batch)
        assert exited.value.args == (75,)

    asyncio.run(fail())
    assert failing.cache.stored == []
    assert broker.decisions() == [] and broker.offsets == {}
    assert failing.messages_observed() == 0

    restarted = Worker(broker, tmp_path, models, serving="v1")
    restarted.cache = failing.cache  # a shared cache (Redis) survives the restart
    restarted.scorer.cache = failing.cache

    async def again() -> None:
        await restarted.assign(0)
        await restarted.batch(batch)

    asyncio.run(again())
    assert ids(broker.decisions()) == ["t-agent-0-0", "t-agent-0-1", "t-agent-0-2"]
    assert {d["cached"] for d in broker.decisions()} == {False}
    assert broker.offsets == {(TOPIC, 0): 3}


def test_a_restarted_worker_resumes_after_the_committed_offsets(
    broker: Broker, tmp_path: Path, models: dict[str, ConstantModel]
) -> None:
    batch = events(0, range(0, 4))

    async def run(worker: Worker, delivered: list[Event]) -> None:
        await worker.assign(0)
        await worker.batch(delivered)

    asyncio.run(run(Worker(broker, tmp_path, models, serving="v1"), batch[:2]))
    # The next worker gets the whole log again: it decides what was not committed only.
    asyncio.run(run(Worker(broker, tmp_path, models, serving="v1"), batch))
    assert ids(broker.decisions()) == [f"t-agent-0-{o}" for o in range(4)]
    assert broker.offsets == {(TOPIC, 0): 4}


def test_a_batch_with_nothing_admitted_does_nothing(worker: Worker, broker: Broker, tmp_path: Path) -> None:
    async def go() -> None:
        await worker.assign(0)
        await worker.batch(events(0, range(0, 2)))
        before = (broker.commits, list(worker.cache.stored), worker.messages_observed())
        (tmp_path / CURRENT).write_text("v2")  # a promotion waiting to be swapped in
        await worker.reloader.poll(force=True)
        await asyncio.sleep(0.05)  # its load finishes on a thread
        # Already decided, and a partition this worker does not own:
        assert await worker.batch(events(0, range(0, 2)) + events(3, range(0, 2))) is None
        assert (broker.commits, worker.cache.stored, worker.messages_observed()) == before
        assert worker.scorer.model is not None and worker.scorer.model.version == "v1"  # nothing swapped either
        output = await worker.batch(events(0, range(2, 3)))
        assert output is not None and worker.scorer.model.version == "v2"

    asyncio.run(go())
    assert broker.offsets == {(TOPIC, 0): 3}


def test_a_promoted_model_is_swapped_in_between_batches(
    worker: Worker, broker: Broker, tmp_path: Path, models: dict[str, ConstantModel]
) -> None:
    """Every batch is decided by one model; the promotion takes over at a batch boundary."""
    promoted = False
    v1_predict = models["v1"].predict

    def predict_then_promote(matrix: Any, explain_above: float | None = 0.0) -> Any:
        nonlocal promoted
        if not promoted:  # promoted while the first batch is being scored
            (tmp_path / CURRENT).write_text("v2")
            promoted = True
        return v1_predict(matrix, explain_above)

    models["v1"].predict = predict_then_promote  # type: ignore[method-assign]
    versions: list[set[str]] = []

    async def go() -> None:
        await worker.assign(0)
        deadline = time.monotonic() + 5.0
        offset = 0
        while not versions or versions[-1] != {"v2"}:
            assert time.monotonic() < deadline, f"v2 never served: {versions}"
            output = await worker.batch(events(0, range(offset, offset + 4)))
            assert output is not None
            versions.append({orjson.loads(v)["model_version"] for _, v in output.decisions})
            offset += 4
            await asyncio.sleep(0.01)  # the load runs on a thread meanwhile

    asyncio.run(go())
    assert versions[0] == {"v1"}
    assert all(len(v) == 1 for v in versions), versions
    assert [v for (v,) in versions] == sorted(v for (v,) in versions)  # v1 ... v1, v2: never back
    committed = [d["model_version"] for d in broker.decisions()]
    assert committed == [v for (v,) in versions for _ in range(4)]


def test_the_shadow_models_verdict_is_committed_with_the_feedback(
    worker: Worker, broker: Broker, tmp_path: Path
) -> None:
    (tmp_path / SHADOW).write_text("v2")

    async def go() -> None:
        await worker.assign(0)
        deadline = time.monotonic() + 5.0
        offset = 0
        while worker.scorer.shadow is None:  # the shadow loads on a thread
            assert time.monotonic() < deadline, "the shadow never loaded"
            await worker.batch(events(0, range(offset, offset + 1)))
            offset += 1
            await asyncio.sleep(0.01)
        await worker.batch(events(0, range(offset, offset + 3), prefix="t-shadowed"))

    asyncio.run(go())
    feedback = [orjson.loads(v) for _, v in broker.records("feedback")]
    shadowed = [f for f in feedback if f["decision"]["transaction_id"].startswith("t-shadowed")]
    assert len(shadowed) == 3
    assert all(f["shadow"]["model_version"] == "v2" and f["shadow"]["fraud_score"] == 0.2 for f in shadowed)
    assert any(orjson.loads(v).get("kind") == "shadow" for _, v in broker.records("monitoring"))


@pytest.mark.parametrize("scope", ["batch", "partition"])
def test_a_partition_taken_over_by_another_worker_is_decided_by_that_worker_only(
    broker: Broker, tmp_path: Path, models: dict[str, ConstantModel], scope: Literal["batch", "partition"]
) -> None:
    """The old owner missed the rebalance (a long pause): under ``batch`` the
    group's generation moved on, under ``partition`` its producer's epoch did."""
    old = Worker(broker, tmp_path, models, serving="v1", scope=scope)
    new = Worker(broker, tmp_path, models, serving="v1", scope=scope)
    batch = events(0, range(0, 3))

    async def go() -> None:
        await old.assign(0)
        await old.batch(batch[:1])
        await new.assign(0)  # a new generation; under "partition" its first batch fences the old producer
        await new.batch(batch[1:])
        await old.batch(batch[1:])  # the old owner had fetched these already: fenced, nothing visible
        assert old.commits.progress.assigned == frozenset()  # it lets the partition go
        assert await old.batch(events(0, range(3, 4))) is None

    asyncio.run(go())
    assert ids(broker.decisions()) == ["t-agent-0-0", "t-agent-0-1", "t-agent-0-2"]
    assert broker.offsets == {(TOPIC, 0): 3}
    # The fenced batch's decisions were never visible: kept out of the old
    # owner's resend cache, so a resend to it cannot be answered with them.
    assert old.cache.stored == ["t-agent-0-0"]
    assert new.cache.stored == ["t-agent-0-1", "t-agent-0-2"]
