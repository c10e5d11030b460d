"""app/eos.py on the real broker: a transaction's records and offsets become
visible together, a producer fenced by its own id is replaced and the records
come back, compressed batches read back as sent, a worker reading a
transactional payment client's records decides each committed one once, and
the merchant tally counts a transactional labeller's committed labels only."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest
from aiokafka import AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from confluent_kafka import Consumer, Producer, TopicPartition

from app.eos import ExactlyOnce, TakenBatch

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


async def _topics(bootstrap: str, *names: str) -> None:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(n, 2, 1) for n in names])
    finally:
        await admin.close()


def _stream(bootstrap: str, group: str, source: str, worker: str = "w1", **options: Any) -> ExactlyOnce:
    return ExactlyOnce(
        topic=source, group_id=group, transactional_id=f"{group}-{source}-{worker}",
        client_config={"bootstrap.servers": bootstrap}, **options,
    )  # fmt: skip


def _committed_view(bootstrap: str, group: str, source: str, out: str) -> tuple[list[bytes], dict[int, int]]:
    """What a read_committed reader of ``out`` sees, and the group's committed offsets of ``source``."""
    # In the group, never joining it (no subscribe): committed() reads the group's offsets.
    reader = Consumer({"bootstrap.servers": bootstrap, "group.id": group, "enable.auto.commit": False,
                       "isolation.level": "read_committed", "auto.offset.reset": "earliest"})  # fmt: skip
    try:
        reader.assign([TopicPartition(out, p, 0) for p in range(2)])
        values: list[bytes] = []
        for _ in range(10):
            values += [m.value() for m in reader.consume(1000, 0.3) if m.error() is None]
        committed = reader.committed([TopicPartition(source, p) for p in range(2)], 10.0)
        # The group's offsets, asked with require_stable (librdkafka's default).
        offsets = {tp.partition: tp.offset for tp in committed if tp.offset >= 0}
    finally:
        reader.close()
    return sorted(values), offsets


def _feed(bootstrap: str, source: str, values: list[bytes]) -> None:
    producer = Producer({"bootstrap.servers": bootstrap})
    for i, v in enumerate(values):
        producer.produce(source, v, partition=i % 2)
    assert producer.flush(10.0) == 0


async def _take_all(stream: ExactlyOnce, n: int, within_s: float = 30.0) -> list[TakenBatch]:
    """Batches until ``n`` records have been taken (the first calls serve the assignment)."""
    batches: list[TakenBatch] = []
    deadline = asyncio.get_running_loop().time() + within_s
    while sum(len(b.messages) for b in batches) < n:
        assert asyncio.get_running_loop().time() < deadline, f"took {sum(len(b.messages) for b in batches)} of {n}"
        batch = await stream.take(100, 0.2)
        if batch.messages:
            batches.append(batch)
    return batches


def _echo(out: str, batch: TakenBatch) -> list[tuple[str, bytes | None, bytes, list[tuple[str, bytes]]]]:
    return [(out, m.key(), m.value(), [("source-offset", b"%d" % m.offset())]) for m in batch.messages]


def test_records_and_offsets_commit_together_and_a_fenced_producer_is_replaced(
    kafka_bootstrap: str, unique_name: Callable[[str], str]
) -> None:
    group, source, out = unique_name("eos"), unique_name("eos-in"), unique_name("eos-out")
    first = [b"first-%d" % i for i in range(6)]
    second = [b"second-%d" % i for i in range(4)]

    async def scenario() -> list[tuple[int, str]]:
        await _topics(kafka_bootstrap, source, out)
        _feed(kafka_bootstrap, source, first)
        stream = _stream(kafka_bootstrap, group, source)
        outcomes: list[tuple[int, str]] = []
        await stream.start()
        try:
            for batch in await _take_all(stream, len(first)):
                assert await stream.send(batch, _echo(out, batch)) is not None
            # Open: a read_committed reader sees nothing of it yet.
            assert await asyncio.to_thread(_committed_view, kafka_bootstrap, group, source, out) == ([], {})
            outcomes += await stream.commit()
            _feed(kafka_bootstrap, source, second)
            taken = await _take_all(stream, len(second))
            for batch in taken:
                await stream.send(batch, _echo(out, batch))
            # The worker's slot restarted elsewhere: a new epoch of its transactional id.
            usurper = Producer({"bootstrap.servers": kafka_bootstrap, "transactional.id": stream.transactional_id})
            usurper.init_transactions(30.0)
            outcomes += await stream.commit()  # fenced by its own id: replaced, its records come back
            for batch in await _take_all(stream, len(second)):
                await stream.send(batch, _echo(out, batch))
            outcomes += await stream.commit()
        finally:
            await stream.close()
        return outcomes

    outcomes = asyncio.run(scenario())
    assert [o for _, o in outcomes] == ["committed", "aborted", "committed"]
    values, offsets = _committed_view(kafka_bootstrap, group, source, out)
    assert values == sorted(first + second)  # each once
    assert offsets == {0: 5, 1: 5}


def test_a_revocation_commits_the_open_transaction_before_the_partitions_move(
    kafka_bootstrap: str, unique_name: Callable[[str], str]
) -> None:
    group, source, out = unique_name("eos"), unique_name("eos-in"), unique_name("eos-out")
    values = [b"v-%d" % i for i in range(8)]

    async def scenario() -> tuple[list[tuple[int, str]], set[int], set[int]]:
        await _topics(kafka_bootstrap, source, out)
        _feed(kafka_bootstrap, source, values)
        a = _stream(kafka_bootstrap, group, source, "a")
        b = _stream(kafka_bootstrap, group, source, "b")
        await a.start()
        try:
            for batch in await _take_all(a, len(values)):
                await a.send(batch, _echo(out, batch))
            await b.start()  # joins: a's next polls serve the revocation
            deadline = asyncio.get_running_loop().time() + 30
            while not a.has_settled():
                assert asyncio.get_running_loop().time() < deadline, "no rebalance reached a"
                assert (await a.take(100, 0.2)).messages == []  # everything was taken already
                await b.take(100, 0.2)  # b's join completes as it polls
            settled = await a.commit()
            for _ in range(10):  # let the group settle on both
                await a.take(100, 0.1)
                await b.take(100, 0.1)
            return settled, set(a.assigned), set(b.assigned)
        finally:
            await b.close()
            await a.close()

    settled, held_a, held_b = asyncio.run(scenario())
    assert [o for _, o in settled] == ["committed"]
    assert held_a | held_b == {0, 1}
    seen, offsets = _committed_view(kafka_bootstrap, group, source, out)
    assert seen == sorted(values)
    assert offsets == {0: 4, 1: 4}


@pytest.mark.parametrize("codec", ["lz4", "zstd"])
def test_a_compressed_transaction_reads_back_byte_for_byte(
    kafka_bootstrap: str, unique_name: Callable[[str], str], codec: str
) -> None:
    """``FRAUD_PRODUCER_COMPRESSION``: what a read_committed reader gets back is the records as sent."""
    group, source, out = unique_name("eos"), unique_name("eos-in"), unique_name("eos-out")
    values = [orjson_like(i) for i in range(40)]

    async def scenario() -> None:
        await _topics(kafka_bootstrap, source, out)
        _feed(kafka_bootstrap, source, values)
        stream = _stream(kafka_bootstrap, group, source, compression=codec)
        await stream.start()
        try:
            for batch in await _take_all(stream, len(values)):
                await stream.send(batch, _echo(out, batch))
            assert [o for _, o in await stream.commit()] == ["committed"]
        finally:
            await stream.close()

    asyncio.run(scenario())
    assert _committed_view(kafka_bootstrap, group, source, out)[0] == sorted(values)


def orjson_like(i: int) -> bytes:
    """A feedback-sized JSON record (~1.5 KB) that compresses the way the real ones do."""
    features = ",".join(f'"feature_{n}":{(i * 31 + n) % 97 / 7:.4f}' for n in range(40))
    return (f'{{"transaction_id":"t-{i}","decision":{{"action":"approve","fraud_score":0.0{i % 10}}},'
            f'"features":{{{features}}},"rule":"model"}}').encode()  # fmt: skip


def test_labels_of_an_aborted_transaction_are_not_counted_by_the_merchant_tally(
    kafka_bootstrap: str, redis_url: str, trained_registry: Any, tmp_path: Any
) -> None:
    """A labeller writing `labels` in transactions: the merchant tally
    (agents/tally.py, read_committed) counts the committed labels only, never
    those of a transaction it aborted."""
    import orjson
    from workers import Topics, Workers, read_shares, tally_by_merchant, worker_env

    topics = Topics.unique("txlabels")
    asyncio.run(topics.create(kafka_bootstrap, 2))
    env = worker_env(bootstrap=kafka_bootstrap, redis_url=redis_url, topics=topics, registry=trained_registry,
                     workdir=tmp_path, partitions=2, FRAUD_WORKER_ROLE="score")  # fmt: skip
    workers = Workers(tmp_path, env)
    tally_topic = f"{env['FRAUD_APP_ID']}-merchant-tally"

    def label(i: int, verdict: str) -> bytes:
        return orjson.dumps({"transaction_id": f"lt-{i}", "label": verdict, "source": "analyst", "merchant_id": "m-tx"})

    async def scenario() -> dict[str, tuple[int, int]]:
        worker = workers.start()
        await worker.wait_for_log("Ready", 90)
        producer = AIOKafkaProducer(bootstrap_servers=kafka_bootstrap, transactional_id=f"labeller-{topics.labels}")
        await producer.start()
        try:
            await producer.begin_transaction()
            for i in range(6):  # aborted: six frauds that never happened
                await producer.send(topics.labels, label(i, "fraud"), key=f"lt-{i}".encode())
            await producer.abort_transaction()
            async with producer.transaction():
                for i in range(6, 10):
                    await producer.send(topics.labels, label(i, "fraud" if i == 6 else "legit"), key=f"lt-{i}".encode())
        finally:
            await producer.stop()
        counted: dict[str, tuple[int, int]] = {}
        for _ in range(60):  # the committed labels counted; the aborted ones, before them in the log, never
            counted = tally_by_merchant(await read_shares(kafka_bootstrap, tally_topic, 2))
            if sum(counted.get("m-tx", (0, 0))) >= 4:
                break
            await asyncio.sleep(0.5)
        await asyncio.sleep(2.0)
        return tally_by_merchant(await read_shares(kafka_bootstrap, tally_topic, 2))

    try:
        counted = asyncio.run(scenario())
    finally:
        workers.stop_all()
    assert counted == {"m-tx": (1, 3)}, f"{counted}\n{workers.logs()}"


def test_a_transactional_payment_client_is_decided_exactly_once(
    kafka_bootstrap: str, redis_url: str, sim_frame: Any, trained_registry: Any, tmp_path: Any
) -> None:
    """A payment system that writes `transactions` with a transactional producer leaves
    commit markers between its records (offsets with no record). The worker reads past
    them, decides every committed transaction once, and never an aborted one."""
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
