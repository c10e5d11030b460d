"""The scoring loop (agents/score.py ``ScoringLoop``) in process: take, score,
send in the open transaction, commit, then cache.

Everything the worker builds is real (``ExactlyOnce``, ``Scorer`` with a
``LocalFirstCache``, ``Reloader``, ``WorkerMetrics``) but the outside world:
Kafka is :class:`tests.kafka_fakes.FakeKafka` behind librdkafka's API, the
shared decision cache (Redis) is an in-memory one that notes on the cluster's
timeline when it stores, the feature store is in memory, models are constant.
What is asserted is what a reader of ``decisions`` (read_committed) and of the
group's offsets sees.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import orjson
import pytest
from confluent_kafka import KafkaError

from agents.metrics import WorkerMetrics
from agents.reload import Reloader
from agents.score import ScoringLoop
from app.contract import Transaction
from app.eos import ExactlyOnce
from app.settings import Settings
from models.lifecycle import SHADOW
from models.registry import CURRENT
from pipeline.cache import InMemoryDecisionCache, LocalFirstCache
from pipeline.feature_store import InMemoryFeatureStore
from pipeline.resend_index import CONTENT_HASH, MemoryStore, ResendIndex
from pipeline.scorer import Scorer
from pipeline.validate import validate
from tests.factories import RULES, ConstantModel, tx_doc
from tests.kafka_fakes import FakeConsumer, FakeKafka, error

TOPIC = "transactions"
GROUP = "fraud-unit-score"
OUTPUTS = {
    "decisions": "decisions", "dead_letters": "dead-letters", "feedback": "feedback", "monitoring": "monitoring",
    "transactions": "transactions",
}  # fmt: skip
#: Long enough that a test commits when it says so (``Worker.commit``).
NEVER = 3600.0


# --- the outside world ---------------------------------------------------------------------------


class SharedCache(InMemoryDecisionCache):
    """The shared decision cache (Redis in a worker), noting on the cluster's timeline when it stores."""

    def __init__(self, timeline: list[tuple[Any, ...]]) -> None:
        super().__init__()
        self.timeline = timeline
        self.stored: list[str] = []

    async def put_many(self, items: Sequence[tuple[Transaction, bytes]]) -> None:
        ids = [tx.transaction_id for tx, _ in items]
        self.timeline.append(("cache", ids))
        self.stored += ids
        await super().put_many(items)


def new_kafka() -> FakeKafka:
    # ``decisions``, partition for partition with ``transactions``: the resend index's changelog.
    return FakeKafka({**{topic: 1 for topic in OUTPUTS.values()}, TOPIC: 2, OUTPUTS["decisions"]: 2})


def doc(partition: int, offset: int, prefix: str = "t-loop") -> dict[str, Any]:
    """A valid transaction of its own content (none is a resend of another)."""
    return tx_doc(offset, transaction_id=f"{prefix}-{partition}-{offset}", amount=10.0 + 1000 * partition + offset)


def write(kafka: FakeKafka, partition: int, value: dict[str, Any] | bytes) -> int:
    """A payment client's record: ``value`` (a document, or raw bytes) on ``partition``."""
    raw = value if isinstance(value, bytes) else orjson.dumps(value)
    offset = len(kafka.logs[(TOPIC, partition)])
    return kafka.append(TOPIC, partition, raw, key=f"k-{partition}-{offset}".encode(),
                        headers=[("correlation-id", f"c-{partition}-{offset}".encode())],
                        timestamp_ms=int((time.time() - 0.01) * 1000))  # fmt: skip


def write_new(kafka: FakeKafka, partition: int, n: int, prefix: str = "t-loop") -> list[dict[str, Any]]:
    docs = []
    for _ in range(n):
        d = doc(partition, len(kafka.logs[(TOPIC, partition)]), prefix)
        write(kafka, partition, d)
        docs.append(d)
    return docs


def decisions(kafka: FakeKafka) -> list[dict[str, Any]]:
    return kafka.values(OUTPUTS["decisions"])


def fresh(kafka: FakeKafka) -> list[str]:
    """Ids of the visible decisions made (not answered from a cache), in order."""
    return [d["transaction_id"] for d in decisions(kafka) if not d["cached"]]


# --- a worker, built as create_app builds it -----------------------------------------------------


class Worker:
    def __init__(
        self, kafka: FakeKafka, registry: Path, models: dict[str, ConstantModel], *, name: str = "w1",
        serving: str = "v1", interval_s: float = NEVER, shared: SharedCache | None = None, window_s: float = 0.0,
        caught_up: bool = False,
    ) -> None:  # fmt: skip
        self.kafka = kafka
        # By default a test commits when it says so (``commit``), or when a
        # short interval it sets has passed; ``caught_up``: as a worker ships.
        settings = Settings(batch_size=32, batch_window_s=window_s, commit_interval_s=interval_s,
                            commit_caught_up=caught_up)  # fmt: skip
        self.stream = ExactlyOnce(
            topic=TOPIC, group_id=GROUP, transactional_id=f"{GROUP}-{TOPIC}-{name}", client_config={},
            consumer_factory=kafka.consumer, producer_factory=kafka.producer,
        )  # fmt: skip
        self.shared = shared if shared is not None else SharedCache(kafka.timeline)
        self.index = ResendIndex(MemoryStore(), 3600)
        self.cache = LocalFirstCache(self.shared, index=self.index, ttl_s=3600, wait_s=0.05)
        model = models[serving]
        self.scorer = Scorer(model=model, rules=RULES, store=InMemoryFeatureStore(), cache=self.cache,
                             model_budget_s=2.0)  # fmt: skip
        (registry / CURRENT).write_text(serving)
        self.reloader = Reloader(
            registry=registry, rules_path=registry / "rules.json", model=model, rules=RULES, check_every_s=0.0,
            load=lambda _registry, version: models[version],
        )  # fmt: skip
        self.metrics = WorkerMetrics(settings)
        # as agents.wiring.exactly_once wires them
        self.stream.on_result = lambda result: self.metrics.transactions.labels(result).inc()
        self.metrics.offsets = self.stream.offsets
        self.loop = ScoringLoop(
            self.stream, self.scorer, self.reloader, self.metrics, OUTPUTS, None, settings, cache=self.cache
        )

    async def start(self) -> None:
        await self.stream.start()
        await self.step()  # joins the group: the assignment is served inside consume

    async def step(self) -> None:
        """One take, score and send (and a commit when one is due, or a rebalance settled one)."""
        await self.loop.step()
        await asyncio.sleep(0.01)  # the committed decisions' cache write runs as a task

    async def commit(self) -> None:
        self.loop.settle(await self.stream.commit())
        await asyncio.sleep(0.01)

    async def stop(self) -> None:
        await self.loop.drain()
        await self.stream.close()
        await asyncio.sleep(0.01)

    def record_take_waits(self) -> list[float]:
        """How long each later take may wait for its batch (``within_s``), in order."""
        waits: list[float] = []
        take = self.stream.take

        async def recording_take(max_records: int, within_s: float, idle_s: float = 0.0) -> Any:
            waits.append(within_s)
            return await take(max_records, within_s, idle_s)

        self.stream.take = recording_take  # type: ignore[method-assign]
        return waits

    @property
    def consumer(self) -> FakeConsumer:
        consumer: FakeConsumer = self.stream._consumer
        return consumer

    def messages_observed(self) -> float:
        return self.metrics.registry.get_sample_value("fraud_messages_total") or 0.0


@pytest.fixture
def models() -> dict[str, ConstantModel]:
    return {"v1": ConstantModel(0.1, version="v1"), "v2": ConstantModel(0.2, version="v2")}


# --- every message: one decision or one dead letter ----------------------------------------------


def test_every_message_gets_exactly_one_decision_or_a_dead_letter(tmp_path: Path, models: Any) -> None:
    """One batch mixes new transactions of both partitions, an unreadable
    record, and a transaction sent twice; the next batch of the same open
    transaction resends two of them. Each message gets one outcome; each
    transaction one decision made, the rest answered from it."""
    kafka = new_kafka()
    worker = Worker(kafka, tmp_path, models)
    first = write_new(kafka, 0, 3) + write_new(kafka, 1, 2)
    write(kafka, 0, b"\xff not json")
    write(kafka, 1, first[3])  # the same transaction twice in one batch
    sent = 7

    async def go() -> None:
        await worker.start()
        await worker.step()
        write(kafka, 0, first[0])  # resends, in a later batch of the same transaction
        write(kafka, 1, first[4])
        write_new(kafka, 0, 1)
        await worker.step()
        assert decisions(kafka) == []  # nothing visible before the commit
        await worker.commit()
        await worker.stop()

    asyncio.run(go())
    made = fresh(kafka)
    assert sorted(made) == sorted([d["transaction_id"] for d in first] + ["t-loop-0-5"])
    assert len(made) == len(set(made))  # one decision made per transaction
    answered = Counter(d["transaction_id"] for d in decisions(kafka) if d["cached"])
    assert answered == {first[3]["transaction_id"]: 1, first[0]["transaction_id"]: 1,
                        first[4]["transaction_id"]: 1}  # fmt: skip
    assert len(kafka.visible(OUTPUTS["dead_letters"])) == 1
    messages = sent + 3
    assert len(decisions(kafka)) + len(kafka.visible(OUTPUTS["dead_letters"])) == messages
    assert kafka.committed(GROUP, TOPIC) == {0: 6, 1: 4}
    assert worker.messages_observed() == messages
    # An answer repeats the decision it was answered from.
    by_id: dict[str, dict[str, Any]] = {}
    for d in decisions(kafka):
        first_seen = by_id.setdefault(d["transaction_id"], d)
        assert (d["action"], d["fraud_score"]) == (first_seen["action"], first_seen["fraud_score"])


def test_an_unreadable_record_gets_its_dead_letter_committed_and_its_offset_moves(tmp_path: Path, models: Any) -> None:
    kafka = new_kafka()
    worker = Worker(kafka, tmp_path, models, interval_s=0.0)
    write_new(kafka, 0, 1)
    write(kafka, 0, b"\xff not json")
    write_new(kafka, 0, 1)

    async def go() -> None:
        await worker.start()
        await worker.step()  # interval 0: every batch commits on its own
        await worker.stop()

    asyncio.run(go())
    assert fresh(kafka) == ["t-loop-0-0", "t-loop-0-2"]
    assert len(kafka.visible(OUTPUTS["dead_letters"])) == 1
    assert kafka.committed(GROUP, TOPIC) == {0: 3}


# --- held decisions: answered within the open transaction, cached after it ----------------------


def test_a_resend_in_a_later_batch_of_the_open_transaction_is_answered_from_the_held_decision(
    tmp_path: Path, models: Any
) -> None:
    kafka = new_kafka()
    worker = Worker(kafka, tmp_path, models)
    docs = write_new(kafka, 0, 3)

    async def go() -> None:
        await worker.start()
        await worker.step()
        assert worker.stream.open_since is not None
        write(kafka, 0, docs[1])  # the client resends before the decision is visible
        await worker.step()
        assert worker.shared.stored == []  # held by this worker only
        await worker.commit()

    asyncio.run(go())
    made = [d for d in decisions(kafka) if not d["cached"]]
    answers = [d for d in decisions(kafka) if d["cached"]]
    assert [d["transaction_id"] for d in made] == ["t-loop-0-0", "t-loop-0-1", "t-loop-0-2"]
    assert [d["transaction_id"] for d in answers] == ["t-loop-0-1"]
    assert answers[0]["action"] == made[1]["action"]
    assert len(kafka.events("commit")) == 1  # both batches in one transaction


def test_decisions_reach_the_shared_cache_only_after_their_transaction_committed(tmp_path: Path, models: Any) -> None:
    kafka = new_kafka()
    worker = Worker(kafka, tmp_path, models)
    write_new(kafka, 0, 3)
    write_new(kafka, 1, 2)

    async def go() -> None:
        await worker.start()
        await worker.step()
        assert worker.shared.stored == []
        await worker.commit()

    asyncio.run(go())
    kinds = [e[0] for e in kafka.timeline if e[0] in ("commit", "cache")]
    assert kinds == ["commit", "cache"]
    assert sorted(worker.shared.stored) == sorted(fresh(kafka))


def test_a_transaction_of_several_batches_is_stored_in_the_shared_cache_in_one_write(
    tmp_path: Path, models: Any
) -> None:
    kafka = new_kafka()
    worker = Worker(kafka, tmp_path, models)

    async def go() -> None:
        await worker.start()
        for _ in range(3):
            write_new(kafka, 0, 2)
            await worker.step()
        await worker.commit()

    asyncio.run(go())
    assert [e for e in kafka.timeline if e[0] == "cache"] == [("cache", fresh(kafka))]
    assert len(fresh(kafka)) == 6


def test_a_transaction_that_aborts_releases_its_held_decisions_and_its_records_are_decided_again_once(
    tmp_path: Path, models: Any
) -> None:
    kafka = new_kafka()
    worker = Worker(kafka, tmp_path, models)
    docs = write_new(kafka, 0, 3)

    async def go() -> None:
        await worker.start()
        await worker.step()
        write(kafka, 0, docs[0])  # a resend, answered from the held decision
        await worker.step()
        kafka.commit_errors.append(error(KafkaError.OUT_OF_ORDER_SEQUENCE_NUMBER, abortable=True))
        await worker.commit()
        assert decisions(kafka) == [] and worker.shared.stored == []
        assert worker.messages_observed() == 0  # observed when committed only
        await worker.step()  # the same four records, from the committed offsets
        await worker.commit()

    asyncio.run(go())
    # Decided afresh (the aborted decisions were released, never answered from),
    # and visible once: the resend answered from the new decision.
    assert fresh(kafka) == ["t-loop-0-0", "t-loop-0-1", "t-loop-0-2"]
    assert [d["transaction_id"] for d in decisions(kafka) if d["cached"]] == ["t-loop-0-0"]
    assert kafka.committed(GROUP, TOPIC) == {0: 4}
    assert worker.shared.stored == fresh(kafka)
    assert worker.messages_observed() == 4
    assert worker.metrics.registry.get_sample_value("fraud_kafka_transactions_total", {"result": "aborted"}) == 1
    assert worker.metrics.registry.get_sample_value("fraud_kafka_transactions_total", {"result": "committed"}) == 1


def test_a_producer_whose_id_was_taken_is_replaced_and_the_batch_decided_once(tmp_path: Path, models: Any) -> None:
    """Two processes given one FRAUD_WORKER_ID, or a restart of the slot: the
    id's epoch moves on, the producer's commit fails fatally; the worker keeps
    its partitions, starts a new producer and decides the batch again, once."""
    kafka = new_kafka()
    worker = Worker(kafka, tmp_path, models)
    write_new(kafka, 0, 2)

    async def go() -> None:
        await worker.start()
        await worker.step()
        kafka.producer(dict(worker.stream._producer_config)).init_transactions()
        await worker.commit()
        assert decisions(kafka) == []
        await worker.step()
        await worker.commit()

    asyncio.run(go())
    assert fresh(kafka) == ["t-loop-0-0", "t-loop-0-1"]
    assert [d["cached"] for d in decisions(kafka)] == [False, False]
    assert kafka.committed(GROUP, TOPIC) == {0: 2}
    assert worker.shared.stored == fresh(kafka)


# --- rebalances and restarts ---------------------------------------------------------------------


def test_a_rebalance_commits_the_open_transaction_and_the_new_owner_answers_resends_from_the_cache(
    tmp_path: Path, models: Any
) -> None:
    kafka = new_kafka()
    shared = SharedCache(kafka.timeline)  # one Redis for both workers
    a = Worker(kafka, tmp_path, models, name="w1", shared=shared)
    b = Worker(kafka, tmp_path, models, name="w2", shared=shared)
    docs = write_new(kafka, 1, 2)

    async def go() -> None:
        await a.start()
        await a.step()  # open: partition 1's two decisions
        await b.stream.start()  # b joins: partition 1 moves to it
        await a.step()  # the revocation, inside take(): committed, then cached
        assert sorted(fresh(kafka)) == ["t-loop-1-0", "t-loop-1-1"]
        assert sorted(shared.stored) == ["t-loop-1-0", "t-loop-1-1"]
        await b.step()  # its assignment
        write(kafka, 1, docs[0])  # a resend, now read by b
        await b.step()
        await b.commit()
        await a.stop()
        await b.stop()

    asyncio.run(go())
    assert fresh(kafka) == ["t-loop-1-0", "t-loop-1-1"]
    assert [(d["transaction_id"], d["cached"]) for d in decisions(kafka)][-1] == ("t-loop-1-0", True)
    assert kafka.committed(GROUP, TOPIC) == {1: 3}


def test_a_worker_that_missed_the_rebalance_is_fenced_and_the_new_owner_decides_its_batch_once(
    tmp_path: Path, models: Any
) -> None:
    """A long pause: the group moved on without it. Its transaction is refused
    (KIP-447), nothing of it is visible, and its held decisions are released:
    a resend to it cannot be answered with them."""
    kafka = new_kafka()
    shared = SharedCache(kafka.timeline)
    old = Worker(kafka, tmp_path, models, name="w1", shared=shared)
    new = Worker(kafka, tmp_path, models, name="w2", shared=shared)
    docs = write_new(kafka, 0, 3)
    tx = validate(orjson.dumps(docs[0]), time.time())
    assert isinstance(tx, Transaction)

    async def go() -> None:
        await old.start()
        await old.step()
        assert (await old.cache.get_many([tx]))[0] is not None  # held
        await new.stream.start()
        kafka.rebalance(GROUP, {new.consumer: {0, 1}})  # the old worker's session expired
        await old.commit()
        assert decisions(kafka) == [] and shared.stored == []
        assert await old.cache.get_many([tx]) == [None]  # released
        await new.step()  # its assignment
        await new.step()
        await new.commit()
        await old.step()  # it learns it lost its partitions
        assert old.stream.assigned == set()

    asyncio.run(go())
    assert fresh(kafka) == ["t-loop-0-0", "t-loop-0-1", "t-loop-0-2"]
    assert [d["cached"] for d in decisions(kafka)] == [False] * 3
    assert kafka.committed(GROUP, TOPIC) == {0: 3}
    assert old.metrics.registry.get_sample_value("fraud_kafka_transactions_total", {"result": "fenced"}) == 1
    assert shared.stored == fresh(kafka)


def test_a_killed_worker_s_open_transaction_is_aborted_and_its_successor_decides_it_once(
    tmp_path: Path, models: Any
) -> None:
    """kill -9 with a transaction open: its restart takes the same transactional
    id (a new epoch aborts what was left open) and resumes after the committed offsets."""
    kafka = new_kafka()
    shared = SharedCache(kafka.timeline)
    write_new(kafka, 0, 4)

    async def killed() -> None:
        worker = Worker(kafka, tmp_path, models, name="w1", shared=shared)
        worker.loop.batch_size = 2
        await worker.start()  # joins, and takes 0 and 1 with its assignment
        await worker.commit()  # 0 and 1: committed
        await worker.step()  # 2 and 3: sent, open, never committed
        worker.stream._thread.shutdown(wait=False)

    asyncio.run(killed())
    assert fresh(kafka) == ["t-loop-0-0", "t-loop-0-1"]
    dead = kafka.consumers[0]  # the scoring consumer; the one after it only gave the gate group's metadata
    restarted = Worker(kafka, tmp_path, models, name="w1", shared=shared)

    async def restart() -> None:
        await restarted.stream.start()
        assert kafka.events("init")[-1][3] is True  # the new epoch aborted the open transaction
        kafka.rebalance(GROUP, {restarted.consumer: {0, 1}})  # the dead member's session expired
        await restarted.step()
        await restarted.step()
        await restarted.commit()
        await restarted.stop()

    asyncio.run(restart())
    assert dead.member_id not in kafka.groups[GROUP].members
    assert fresh(kafka) == [f"t-loop-0-{o}" for o in range(4)]
    assert [d["cached"] for d in decisions(kafka)] == [False] * 4
    assert kafka.committed(GROUP, TOPIC) == {0: 4}


def test_partitions_gained_in_an_incremental_rebalance_leave_the_open_transaction_open(
    tmp_path: Path, models: Any
) -> None:
    """Cooperative rebalancing (the worker's assignor): a rebalance that only adds
    partitions revokes nothing, so the batches already sent stay in the open
    transaction and commit with the group's new metadata; one that takes a
    partition away commits them first. Nothing is decided twice."""
    kafka = new_kafka()
    kafka.cooperative = True
    worker = Worker(kafka, tmp_path, models)

    async def go() -> None:
        await worker.start()
        kafka.rebalance(GROUP, {worker.consumer: {0}})  # partition 1 goes elsewhere
        await worker.step()
        write_new(kafka, 0, 2)
        await worker.step()  # sent; the transaction stays open (no interval)
        kafka.rebalance(GROUP, {worker.consumer: {0, 1}})  # partition 1 comes back
        write_new(kafka, 1, 2)
        await worker.step()
        await worker.step()
        assert kafka.events("commit") == []  # the gain revoked nothing: still one open transaction
        kafka.rebalance(GROUP, {worker.consumer: {0}})  # a loss: what is open commits before it
        await worker.step()
        await worker.stop()

    asyncio.run(go())
    # As librdkafka tells it: only what changes, an empty assignment after a revocation.
    assert [(e[0], e[2]) for e in kafka.timeline if e[0] in ("revoke", "assign")] == [
        ("assign", [0, 1]), ("revoke", [1]), ("assign", []), ("assign", [1]),
        ("revoke", [1]), ("assign", []), ("revoke", [0]),  # the last: leaving, on stop
    ]  # fmt: skip
    (commit,) = kafka.events("commit")
    assert commit[2] == {(TOPIC, 0): 2, (TOPIC, 1): 2}
    assert sorted(fresh(kafka)) == ["t-loop-0-0", "t-loop-0-1", "t-loop-1-0", "t-loop-1-1"]
    assert kafka.committed(GROUP, TOPIC) == {0: 2, 1: 2}


def test_stopping_commits_what_is_open_and_caches_it(tmp_path: Path, models: Any) -> None:
    kafka = new_kafka()
    worker = Worker(kafka, tmp_path, models)
    write_new(kafka, 0, 2)

    async def go() -> None:
        await worker.start()
        await worker.step()
        await worker.stop()

    asyncio.run(go())
    assert fresh(kafka) == ["t-loop-0-0", "t-loop-0-1"]
    assert worker.shared.stored == fresh(kafka)
    assert kafka.committed(GROUP, TOPIC) == {0: 2}


def test_a_stop_swallowed_by_a_bounded_call_inside_a_step_still_ends_the_loop(tmp_path: Path, models: Any) -> None:
    """faust stops the scoring task by cancelling it; on Python 3.11 a
    cancellation that arrives as an ``asyncio.wait_for``'s awaitable completes
    is swallowed (it returns the result), as the model's and Redis's bounded
    calls would: the loop ends after that step all the same."""
    kafka = new_kafka()
    worker = Worker(kafka, tmp_path, models)
    write_new(kafka, 0, 2)
    score = worker.loop.score
    inside = asyncio.Event()
    answer: asyncio.Future[None] | None = None

    async def bounded_then_score(batch: Any) -> Any:
        nonlocal answer
        answer = asyncio.get_running_loop().create_future()
        inside.set()
        await asyncio.wait_for(answer, 10.0)
        return await score(batch)

    worker.loop.score = bounded_then_score  # type: ignore[method-assign]

    async def go() -> bool:
        await worker.stream.start()
        task = asyncio.create_task(worker.loop.run())
        await asyncio.wait_for(inside.wait(), 5.0)
        assert answer is not None
        task.cancel()
        answer.set_result(None)  # the bounded call completes as the stop arrives
        try:
            await asyncio.wait_for(task, 5.0)
        except asyncio.CancelledError:
            pass
        stopped = task.cancelled()
        await worker.stop()
        return stopped

    assert asyncio.run(go()), "the loop went on after its task was cancelled"
    assert fresh(kafka) == ["t-loop-0-0", "t-loop-0-1"]


def test_a_transaction_commits_once_the_commit_interval_has_passed(tmp_path: Path, models: Any) -> None:
    kafka = new_kafka()
    worker = Worker(kafka, tmp_path, models, interval_s=0.2)

    async def go() -> None:
        await worker.start()
        for _ in range(3):
            write_new(kafka, 0, 1)
            await worker.step()
        assert kafka.events("commit") == []  # within the interval: one transaction, still open
        await asyncio.sleep(0.2)
        await worker.step()  # nothing new: the wait ends at the interval, and it commits
        assert len(kafka.events("commit")) == 1
        await worker.stop()

    asyncio.run(go())
    assert fresh(kafka) == ["t-loop-0-0", "t-loop-0-1", "t-loop-0-2"]


def test_at_a_low_rate_each_batch_commits_as_soon_as_the_worker_has_caught_up(tmp_path: Path, models: Any) -> None:
    """As a worker ships: no window for a batch to fill, no interval to wait
    out: the take after a batch finds nothing queued, and its transaction commits."""
    kafka = new_kafka()
    worker = Worker(kafka, tmp_path, models, caught_up=True)
    waits: list[tuple[float, float]] = []
    take = worker.stream.take

    async def recording_take(max_records: int, within_s: float, idle_s: float = 0.0) -> Any:
        waits.append((within_s, idle_s))
        return await take(max_records, within_s, idle_s)

    worker.stream.take = recording_take  # type: ignore[method-assign]

    async def go() -> None:
        await worker.start()
        write_new(kafka, 0, 2)
        await worker.step()  # taken, scored, sent
        await worker.step()  # nothing queued: the transaction commits
        assert len(kafka.events("commit")) == 1
        assert fresh(kafka) == ["t-loop-0-0", "t-loop-0-1"]
        write_new(kafka, 0, 1)
        await worker.step()
        await worker.step()
        assert len(kafka.events("commit")) == 2
        await worker.stop()

    asyncio.run(go())
    assert waits[2] == (0.0, 0.0)  # a transaction open: no wait for more records
    assert fresh(kafka) == ["t-loop-0-0", "t-loop-0-1", "t-loop-0-2"]


def test_the_next_batch_is_scored_while_the_last_transaction_commits_and_is_sent_after_it(
    tmp_path: Path, models: Any
) -> None:
    kafka = new_kafka()
    worker = Worker(kafka, tmp_path, models, caught_up=True)
    second_scored = threading.Event()
    scores = 0
    score_batch = worker.scorer.score_batch

    async def noting_score_batch(inbound: Any) -> Any:
        nonlocal scores
        scores += 1
        if scores == 2:
            second_scored.set()
        return await score_batch(inbound)

    worker.scorer.score_batch = noting_score_batch  # type: ignore[method-assign]
    overlapped: list[bool] = []

    async def go() -> None:
        await worker.start()
        producer = worker.stream._producer
        commit = producer.commit_transaction

        def commit_once_the_next_batch_is_scored(timeout: float | None = None) -> None:
            # Serial commits would wait out the 5 s here, the second batch not yet taken to scoring.
            overlapped.append(second_scored.wait(5.0))
            commit(timeout)

        producer.commit_transaction = commit_once_the_next_batch_is_scored
        write_new(kafka, 0, 2)
        await worker.step()
        write_new(kafka, 0, 3)  # arrived while the first batch was scored
        await worker.step()  # the first transaction commits while these are scored
        assert fresh(kafka) == ["t-loop-0-0", "t-loop-0-1"]  # the second batch is in the next one
        await worker.step()
        await worker.stop()

    asyncio.run(go())
    assert overlapped[0]
    assert len(kafka.events("commit")) == 2
    assert fresh(kafka) == [f"t-loop-0-{i}" for i in range(5)]
    assert kafka.committed(GROUP, TOPIC) == {0: 5}


def test_while_a_queue_has_formed_a_transaction_spans_full_batches(tmp_path: Path, models: Any) -> None:
    kafka = new_kafka()
    worker = Worker(kafka, tmp_path, models, caught_up=True)

    async def go() -> None:
        await worker.start()
        write_new(kafka, 0, 70)  # a backlog: two full batches of 32, then 6
        await worker.step()
        await worker.step()
        assert kafka.events("commit") == []  # full takes: the transaction stays open
        await worker.step()  # 6: caught up, the 64 commit together
        assert len(kafka.events("commit")) == 1 and len(fresh(kafka)) == 64
        await worker.step()
        await worker.stop()

    asyncio.run(go())
    assert len(fresh(kafka)) == 70 and len(set(fresh(kafka))) == 70


def test_a_batch_taken_while_the_last_transaction_aborts_comes_again_and_is_decided_once(
    tmp_path: Path, models: Any
) -> None:
    """The loop takes the next batch before the last transaction's commit
    ends: when that commit fails, the batch in hand is void, and its records
    come again after the aborted ones, of the same partition or another."""
    kafka = new_kafka()
    worker = Worker(kafka, tmp_path, models, caught_up=True)

    async def go() -> None:
        await worker.start()
        write_new(kafka, 0, 2)
        await worker.step()  # partition 0's first two, in the open transaction
        write_new(kafka, 0, 1)
        write_new(kafka, 1, 2)  # a partition the failing transaction does not hold
        kafka.commit_errors.append(error(KafkaError.OUT_OF_ORDER_SEQUENCE_NUMBER, abortable=True))
        await worker.step()  # taken; the commit fails: nothing is sent
        assert decisions(kafka) == [] and worker.stream.open_since is None  # none of it sent
        for _ in range(4):
            await worker.step()
        await worker.stop()

    asyncio.run(go())
    assert sorted(fresh(kafka)) == ["t-loop-0-0", "t-loop-0-1", "t-loop-0-2", "t-loop-1-0", "t-loop-1-1"]
    assert kafka.committed(GROUP, TOPIC) == {0: 3, 1: 2}


def test_a_committed_transaction_s_decisions_are_in_the_resend_index_and_an_aborted_one_s_nowhere(
    tmp_path: Path, models: Any
) -> None:
    """Each new decision is produced on its transaction's partition of
    ``decisions``, with its index entry's header: its record there is the
    index's changelog. The index takes it once the transaction committed.
    What an aborted transaction decided is in neither."""
    kafka = new_kafka()
    worker = Worker(kafka, tmp_path, models)
    aborted_docs: list[dict[str, Any]] = []

    async def go() -> None:
        await worker.start()
        aborted_docs.extend(write_new(kafka, 0, 2, prefix="t-aborted"))
        await worker.step()
        kafka.commit_errors.append(error(KafkaError.OUT_OF_ORDER_SEQUENCE_NUMBER, abortable=True))
        await worker.commit()  # aborted: the records come again
        assert worker.index.get_many([_tx(d) for d in aborted_docs]) == [None, None]
        aborted_docs.extend(write_new(kafka, 1, 1))
        await worker.step()
        await worker.commit()
        await worker.stop()

    asyncio.run(go())
    made = fresh(kafka)
    assert sorted(made) == ["t-aborted-0-0", "t-aborted-0-1", "t-loop-1-0"]
    topic = OUTPUTS["decisions"]
    entries = [(m.partition(), m.key()) for p in (0, 1) for m in kafka.logs[(topic, p)]
               if CONTENT_HASH in dict(m.headers() or [])]  # fmt: skip
    assert sorted((p, key.decode()) for p, key in entries) == [
        (0, "t-aborted-0-0"), (0, "t-aborted-0-1"), (1, "t-loop-1-0"),
    ]  # one each: the aborted transaction's records never became visible
    assert None not in worker.index.get_many([_tx(d) for d in aborted_docs])  # decided again, and committed


def _tx(doc: dict[str, Any]) -> Transaction:
    checked = validate(orjson.dumps(doc), time.time())
    assert isinstance(checked, Transaction)
    return checked


def test_records_that_queued_while_a_batch_was_scored_are_taken_without_another_window(
    tmp_path: Path, models: Any
) -> None:
    """The batch window bounds how long a record waits for its batch to fill,
    counted from the last take: a worker that was busy takes what queued at once."""
    kafka = new_kafka()
    worker = Worker(kafka, tmp_path, models, window_s=0.5)
    waits = worker.record_take_waits()

    async def go() -> None:
        await worker.start()
        write_new(kafka, 0, 2)
        await asyncio.sleep(0.6)  # as long as scoring a batch may take: the records wait meanwhile
        await worker.step()
        await worker.step()  # nothing queued: this take may wait for a batch to fill
        await worker.stop()

    asyncio.run(go())
    assert waits[1] == 0.0  # both records taken at once
    assert waits[2] > 0.4
    assert fresh(kafka) == ["t-loop-0-0", "t-loop-0-1"]


def test_the_loop_reports_where_its_time_goes(tmp_path: Path, models: Any) -> None:
    """``fraud_loop_seconds``: each step's take, score, send and commit, as an operator sees them on /metrics."""
    kafka = new_kafka()
    worker = Worker(kafka, tmp_path, models, interval_s=0.0)

    async def go() -> None:
        await worker.start()
        write_new(kafka, 0, 2)
        await worker.step()
        await worker.step()  # the interval (0) has passed: its transaction commits
        await worker.stop()

    asyncio.run(go())
    count = worker.metrics.registry.get_sample_value
    assert count("fraud_loop_seconds_count", {"phase": "take"}) == 3  # joining, the batch, the commit's
    assert count("fraud_loop_seconds_count", {"phase": "score"}) == 1
    assert count("fraud_loop_seconds_count", {"phase": "send"}) == 1
    assert count("fraud_loop_seconds_count", {"phase": "commit"}) == 1


# --- models --------------------------------------------------------------------------------------


def test_a_promoted_model_is_swapped_in_between_batches(tmp_path: Path, models: dict[str, ConstantModel]) -> None:
    """Every batch is decided by one model; the promotion takes over at a batch boundary."""
    kafka = new_kafka()
    worker = Worker(kafka, tmp_path, models, interval_s=0.0)
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
        await worker.start()
        deadline = time.monotonic() + 5.0
        while not versions or versions[-1] != {"v2"}:
            assert time.monotonic() < deadline, f"v2 never served: {versions}"
            seen = len(decisions(kafka))
            write_new(kafka, 0, 4)
            await worker.step()
            await worker.commit()
            versions.append({d["model_version"] for d in decisions(kafka)[seen:]})
            await asyncio.sleep(0.01)  # the load runs on a thread meanwhile
        await worker.stop()

    asyncio.run(go())
    assert versions[0] == {"v1"}
    assert all(len(v) == 1 for v in versions), versions
    assert [v for (v,) in versions] == sorted(v for (v,) in versions)  # v1 ... v1, v2: never back


def test_the_shadow_models_verdict_is_committed_with_the_feedback(tmp_path: Path, models: Any) -> None:
    kafka = new_kafka()
    worker = Worker(kafka, tmp_path, models, interval_s=0.0)
    (tmp_path / SHADOW).write_text("v2")

    async def go() -> None:
        await worker.start()
        deadline = time.monotonic() + 5.0
        while worker.scorer.shadow is None:  # the shadow loads on a thread
            assert time.monotonic() < deadline, "the shadow never loaded"
            write_new(kafka, 0, 1)
            await worker.step()
            await asyncio.sleep(0.01)
        write_new(kafka, 0, 3, prefix="t-shadowed")
        await worker.step()
        await worker.stop()

    asyncio.run(go())
    feedback = kafka.values(OUTPUTS["feedback"])
    shadowed = [f for f in feedback if f["decision"]["transaction_id"].startswith("t-shadowed")]
    assert len(shadowed) == 3
    assert all(f["shadow"]["model_version"] == "v2" and f["shadow"]["fraud_score"] == 0.2 for f in shadowed)
    assert any(m.get("kind") == "shadow" for m in kafka.values(OUTPUTS["monitoring"]))


def test_a_worker_joins_its_group_before_its_first_step_and_decides_what_came_meanwhile(
    tmp_path: Path, models: Any
) -> None:
    """What a starting worker does before it says Ready: join, keeping the records the join already took."""
    kafka = new_kafka()
    worker = Worker(kafka, tmp_path, models)
    write_new(kafka, 0, 2)

    async def go() -> None:
        await worker.stream.start()
        assert not worker.stream.joined
        first = await worker.stream.join(32, 5.0, list(OUTPUTS.values()))
        assert worker.stream.joined and worker.stream.assigned == {0, 1}
        await worker.loop.step(first)  # what the join took, if anything
        await worker.loop.step()
        await worker.commit()
        await worker.stop()

    asyncio.run(go())
    assert fresh(kafka) == ["t-loop-0-0", "t-loop-0-1"]  # once each, whichever step took them
