"""Transactions on the real broker: a batch's outcomes and its offsets commit
together, and a worker that lost its partitions (a zombie) can no longer commit."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import ProducerFenced

from app.transactional import Fenced, PartitionBatch, TransactionalEmitter, transactional_id

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]


async def _topics(bootstrap: str, *names: str) -> None:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(n, 2, 1) for n in names])
    finally:
        await admin.close()


async def _committed_view(bootstrap: str, group: str, source: str, out: str) -> tuple[list[bytes], dict[int, int | None]]:
    """What a read_committed consumer of ``out`` sees, and the group's offsets of ``source``."""
    consumer = AIOKafkaConsumer(
        bootstrap_servers=bootstrap, group_id=group, enable_auto_commit=False,
        isolation_level="read_committed", auto_offset_reset="earliest",
    )  # fmt: skip
    await consumer.start()
    try:
        parts = [TopicPartition(out, p) for p in range(2)]
        consumer.assign(parts)
        await consumer.seek_to_beginning(*parts)
        values: list[bytes] = []
        for _ in range(10):
            batches = await consumer.getmany(timeout_ms=300)
            values += [r.value for records in batches.values() for r in records]
        # Offsets read after the records: a transaction's offsets become the
        # group's only once the coordinator has written its markers, a moment
        # after commit returns, and aiokafka's OffsetFetch does not ask for
        # stable offsets (it may answer the older value meanwhile).
        offsets = {p: await consumer.committed(TopicPartition(source, p)) for p in range(2)}
        return sorted(values), offsets
    finally:
        await consumer.stop()


def _emitter(bootstrap: str, group: str, source: str, scope: str = "partition") -> TransactionalEmitter:
    return TransactionalEmitter(
        app_id=group, group_id=group, topic=source, scope=scope,  # type: ignore[arg-type]
        producer_options={"bootstrap_servers": bootstrap, "linger_ms": 2, "retry_backoff_ms": 5},
    )  # fmt: skip


async def _member(bootstrap: str, group: str, source: str) -> AIOKafkaConsumer:
    """A consumer of ``source`` in ``group`` that has joined it (it has an assignment)."""
    consumer = AIOKafkaConsumer(source, bootstrap_servers=bootstrap, group_id=group, enable_auto_commit=False)
    await consumer.start()
    for _ in range(100):
        await consumer.getmany(timeout_ms=100)
        if consumer.assignment():
            return consumer
    raise AssertionError("the consumer never got an assignment")


def _membership(consumer: AIOKafkaConsumer) -> tuple[int, str]:
    return consumer._coordinator.generation, consumer._coordinator.member_id


def test_a_zombie_late_transaction_is_refused(kafka_bootstrap: str, unique_name: Callable[[str], str]) -> None:
    """The old owner of partition 0 has a transaction open (decisions sent, not
    committed) when the new owner starts: the new owner's producer aborts it, and the
    old owner's late commit fails. Its decision is never visible; its offset is never
    committed."""
    group, source, out = unique_name("eos"), unique_name("eos-in"), unique_name("eos-out")

    async def scenario() -> tuple[list[bytes], dict[int, int | None], BaseException | None]:
        await _topics(kafka_bootstrap, source, out)
        zombie = AIOKafkaProducer(bootstrap_servers=kafka_bootstrap, transactional_id=transactional_id(group, source, 0))
        await zombie.start()
        await zombie.begin_transaction()
        await zombie.send_and_wait(out, b"zombie: decline", key=b"t-1")  # on the broker, not committed
        owner = _emitter(kafka_bootstrap, group, source)
        await owner.assign([0, 1])  # a rebalance gave partition 0 to another worker
        late: BaseException | None = None
        try:
            await zombie.send_offsets_to_transaction({TopicPartition(source, 0): 1}, group)
            await zombie.commit_transaction()
        except ProducerFenced as exc:
            late = exc
        finally:
            await zombie.stop()
        results = await owner.commit({0: PartitionBatch(1, [(out, b"t-1", b"owner: approve", [])])})
        assert results == {0: None}
        await owner.close()
        values, offsets = await _committed_view(kafka_bootstrap, group, source, out)
        return values, offsets, late

    values, offsets, late = asyncio.run(scenario())
    assert isinstance(late, ProducerFenced)
    assert values == [b"owner: approve"]
    assert offsets == {0: 1, 1: None}


def test_a_fenced_worker_drops_the_partition_and_keeps_the_others(
    kafka_bootstrap: str, unique_name: Callable[[str], str]
) -> None:
    group, source, out = unique_name("eos"), unique_name("eos-in"), unique_name("eos-out")

    async def scenario() -> tuple[dict[int, BaseException | None], frozenset[int], list[bytes], dict[int, int | None]]:
        await _topics(kafka_bootstrap, source, out)
        old, new = _emitter(kafka_bootstrap, group, source), _emitter(kafka_bootstrap, group, source)
        await old.assign([0, 1])
        assert await old.commit({0: PartitionBatch(3, [(out, b"a", b"old p0 batch 1", [])])}) == {0: None}
        await new.assign([0])  # partition 0 moved; the old worker has not noticed yet
        results = await old.commit({
            0: PartitionBatch(5, [(out, b"a", b"old p0 batch 2 (late)", [])]),
            1: PartitionBatch(2, [(out, b"b", b"old p1 batch 1", [])]),
        })  # fmt: skip
        left = old.partitions
        await old.close()
        await new.close()
        values, offsets = await _committed_view(kafka_bootstrap, group, source, out)
        return results, left, values, offsets

    results, left, values, offsets = asyncio.run(scenario())
    assert isinstance(results[0], Fenced) and results[1] is None
    assert left == frozenset({1})
    assert values == sorted([b"old p0 batch 1", b"old p1 batch 1"])
    assert offsets == {0: 3, 1: 2}


def test_faust_worker_consumer_reads_committed_only(kafka_bootstrap: str) -> None:
    """The seam in app/seams.py (faust-streaming internals): the consumer faust
    builds for a worker hands read_committed to aiokafka's fetcher, so the feedback
    loop never reads an aborted batch's records. Fails if an upgrade makes it a no-op."""
    from aiokafka.consumer.fetcher import READ_COMMITTED

    from app.faust_app import base_app
    from app.settings import Settings

    async def scenario() -> Any:
        app = base_app(Settings(kafka_bootstrap=kafka_bootstrap, app_id="eos-isolation"))
        consumer = app.consumer._thread._create_worker_consumer(app.transport)
        await consumer.start()
        try:
            return consumer._fetcher._isolation_level
        finally:
            await consumer.stop()

    assert asyncio.run(scenario()) == READ_COMMITTED


def test_a_transactional_payment_client_is_decided_exactly_once_without_stalls(
    kafka_bootstrap: str, redis_url: str, sim_frame: Any, trained_registry: Any, tmp_path: Any
) -> None:
    """A payment system that writes `transactions` with a transactional producer leaves
    commit markers between its records (offsets with no record). The worker reads past
    them at once — checked in the log, not guessed — decides every committed
    transaction once, and never decides an aborted one."""
    import redis
    from workers import Collector, Topics, TxFactory, Workers, tx_msg, worker_env

    from tools.materialize import materialize

    client = redis.Redis.from_url(redis_url)
    try:
        materialize(sim_frame, client, progress=False)
    finally:
        client.close()
    topics = Topics.unique("txclient")
    asyncio.run(topics.create(kafka_bootstrap, 2))
    workers = Workers(tmp_path, worker_env(bootstrap=kafka_bootstrap, redis_url=redis_url, topics=topics,
                                           registry=trained_registry, workdir=tmp_path, partitions=2))  # fmt: skip
    make = TxFactory(sim_frame, f"t-txc-{topics.transactions[-6:]}")
    committed = [[tx_msg(make()) for _ in range(3)] for _ in range(20)]
    aborted = [tx_msg(make()) for _ in range(3)]

    async def scenario() -> Collector:
        async with Collector(kafka_bootstrap, topics, 2) as col:
            worker = workers.start()
            await worker.wait_for_log("Ready", 90)
            producer = AIOKafkaProducer(bootstrap_servers=kafka_bootstrap, transactional_id=f"pos-{topics.transactions}")
            await producer.start()
            try:
                for i, group in enumerate(committed):
                    async with producer.transaction():
                        for m in group:
                            await producer.send(topics.transactions, m.value, key=m.key, headers=m.all_headers())
                    if i == 10:  # an aborted transaction in the middle
                        await producer.begin_transaction()
                        for m in aborted:
                            await producer.send(topics.transactions, m.value, key=m.key, headers=m.all_headers())
                        await producer.abort_transaction()
            finally:
                await producer.stop()
            flat = [m for group in committed for m in group]
            # Unchecked, each commit marker would hold its partition through ten 1 s seeks.
            await col.wait_for(lambda: all(col.has_outcome(m) for m in flat), 60, "decisions")
            await asyncio.sleep(2.0)
            return col

    try:
        col = asyncio.run(scenario())
    finally:
        workers.stop_all()
    flat = [m for group in committed for m in group]
    assert all(len(col.by_tx[m.transaction_id or ""]) == 1 for m in flat)
    assert not any(col.by_tx.get(m.transaction_id or "") for m in aborted)
    assert "hold no committed record" in workers.started[0].text()


def test_one_transaction_per_batch_is_refused_once_the_group_moved_on(
    kafka_bootstrap: str, unique_name: Callable[[str], str]
) -> None:
    """Scope ``batch`` (KIP-447): a worker commits both partitions' decisions and
    offsets in one transaction under its generation. Another member joins (a
    rebalance: a new generation); the worker, which has not seen it yet, tries
    its next batch under the old one: the group coordinator refuses the offsets,
    the transaction aborts, nothing of it is visible, and the worker lets the
    partitions go. Under the new generation it commits again."""
    group, source, out = unique_name("eos"), unique_name("eos-in"), unique_name("eos-out")

    async def scenario() -> tuple[Any, ...]:
        await _topics(kafka_bootstrap, source, out)
        first = await _member(kafka_bootstrap, group, source)
        worker = _emitter(kafka_bootstrap, group, source, scope="batch")
        try:
            await worker.assign([0, 1], _membership(first))
            before = _membership(first)
            one = await worker.commit({
                0: PartitionBatch(3, [(out, b"a", b"batch 1 p0", [])]),
                1: PartitionBatch(2, [(out, b"b", b"batch 1 p1", [])]),
            })  # fmt: skip
            second = await _member(kafka_bootstrap, group, source)  # the group rebalances
            for _ in range(100):
                await first.getmany(timeout_ms=100)
                if _membership(first)[0] > before[0]:
                    break
            late = await worker.commit({0: PartitionBatch(5, [(out, b"a", b"batch 2 p0 (old generation)", [])])})
            left = worker.partitions
            await worker.assign(sorted(tp.partition for tp in first.assignment()), _membership(first))
            again = await worker.commit({
                p: PartitionBatch(9, [(out, b"c", f"batch 3 p{p}".encode(), [])])
                for p in sorted(tp.partition for tp in first.assignment())
            })  # fmt: skip
            await second.stop()
        finally:
            await worker.close()
            await first.stop()
        values, offsets = await _committed_view(kafka_bootstrap, group, source, out)
        return one, late, left, again, values, offsets

    one, late, left, again, values, offsets = asyncio.run(scenario())
    assert one == {0: None, 1: None}
    assert isinstance(late[0], Fenced)
    assert left == frozenset({1})  # partition 0 is let go; 1 is kept until the next assignment
    assert again and all(r is None for r in again.values())
    assert b"batch 2 p0 (old generation)" not in values
    assert {b"batch 1 p0", b"batch 1 p1"} <= set(values)
    kept = [p for p, r in again.items() if r is None]
    assert all(offsets[p] == 9 for p in kept)
    assert all(offsets[p] == {0: 3, 1: 2}[p] for p in {0, 1} - set(kept))


def test_a_new_owner_reads_offsets_only_once_the_open_transaction_holding_them_ends(
    kafka_bootstrap: str, unique_name: Callable[[str], str]
) -> None:
    """The previous owner's transaction holds offsets for partition 0 and is still
    open: the new owner's read (OffsetFetch with require_stable, app/seams.py)
    waits for it instead of answering the older offset, then sees the commit."""
    from app.seams import fetch_stable_offsets

    group, source, out = unique_name("eos"), unique_name("eos-in"), unique_name("eos-out")

    async def scenario() -> tuple[dict[Any, int | None], bool, dict[Any, int | None]]:
        await _topics(kafka_bootstrap, source, out)
        reader = await _member(kafka_bootstrap, group, source)
        tp = TopicPartition(source, 0)
        old = AIOKafkaProducer(bootstrap_servers=kafka_bootstrap, transactional_id=unique_name("old-owner"))
        await old.start()
        try:
            async with old.transaction():
                await old.send(out, b"first", key=b"a")
                await old.send_offsets_to_transaction({tp: 4}, group)
            before = await fetch_stable_offsets(reader, group, [tp], give_up_s=10)
            await old.begin_transaction()
            await old.send(out, b"second", key=b"a")
            await old.send_offsets_to_transaction({tp: 7}, group)
            read = asyncio.ensure_future(fetch_stable_offsets(reader, group, [tp], give_up_s=10))
            await asyncio.sleep(1.0)
            waited = not read.done()
            await old.commit_transaction()
            after = await read
        finally:
            await old.stop()
            await reader.stop()
        return before, waited, after

    before, waited, after = asyncio.run(scenario())
    assert before == {TopicPartition(source, 0): 4}
    assert waited
    assert after == {TopicPartition(source, 0): 7}


@pytest.mark.parametrize("codec", ["lz4", "zstd"])
def test_a_compressed_batch_reads_back_byte_for_byte(
    kafka_bootstrap: str, unique_name: Callable[[str], str], codec: str
) -> None:
    """``FRAUD_PRODUCER_COMPRESSION``: the scoring path's producer options with a
    codec; what a read_committed consumer gets back is the records as sent."""
    from app.settings import Settings
    from app.topics import producer_options

    group, source, out = unique_name("eos"), unique_name("eos-in"), unique_name("eos-out")
    options = producer_options(Settings(kafka_bootstrap=kafka_bootstrap, producer_compression=codec))
    assert options["compression_type"] == codec
    values = [orjson_like(i) for i in range(40)]

    async def scenario() -> list[bytes]:
        await _topics(kafka_bootstrap, source, out)
        member = await _member(kafka_bootstrap, group, source)
        emitter = TransactionalEmitter(app_id=group, group_id=group, topic=source, producer_options=options)
        try:
            await emitter.assign(sorted(tp.partition for tp in member.assignment()), _membership(member))
            partition = min(emitter.partitions)
            records = [(out, b"k", v, [("signature", b"s-%d" % i)]) for i, v in enumerate(values)]
            assert await emitter.commit({partition: PartitionBatch(1, records)}) == {partition: None}
        finally:
            await emitter.close()
            await member.stop()
        seen, _ = await _committed_view(kafka_bootstrap, group, source, out)
        return seen

    assert asyncio.run(scenario()) == sorted(values)


def orjson_like(i: int) -> bytes:
    """A feedback-sized JSON record (~1.5 KB) that compresses the way the real ones do."""
    features = ",".join(f'"feature_{n}":{(i * 31 + n) % 97 / 7:.4f}' for n in range(40))
    return (f'{{"transaction_id":"t-{i}","decision":{{"action":"approve","fraud_score":0.0{i % 10}}},'
            f'"features":{{{features}}},"rule":"model"}}').encode()  # fmt: skip
