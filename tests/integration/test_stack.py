"""The local stack: real broker and Redis processes, started and stopped by ``tools.stack``."""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import Callable
from pathlib import Path

import pytest
import redis
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

from tools import stack

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]


# --- the session fixtures ----------------------------------------------------


def test_broker_answers_metadata(kafka_bootstrap: str) -> None:
    async def list_topics() -> list[str]:
        admin = AIOKafkaAdminClient(bootstrap_servers=kafka_bootstrap)
        await admin.start()
        try:
            topics: list[str] = await admin.list_topics()
        finally:
            await admin.close()
        return topics

    assert isinstance(asyncio.run(list_topics()), list)


def test_topic_partitions_keys_and_headers_round_trip(
    kafka_bootstrap: str, unique_name: Callable[[str], str]
) -> None:
    topic = unique_name("stack")
    headers = [("trace-id", b"abc123"), ("schema", b"v1")]

    async def scenario() -> None:
        admin = AIOKafkaAdminClient(bootstrap_servers=kafka_bootstrap)
        await admin.start()
        try:
            await admin.create_topics([NewTopic(topic, num_partitions=3, replication_factor=1)])
            # CreateTopics answers once the controller has the topic; the broker's
            # metadata cache learns it a moment later, so describe until it does.
            for _ in range(50):
                [described] = await admin.describe_topics([topic])
                if described["partitions"]:
                    break
                await asyncio.sleep(0.1)
        finally:
            await admin.close()
        assert len(described["partitions"]) == 3

        producer = AIOKafkaProducer(bootstrap_servers=kafka_bootstrap)
        await producer.start()
        try:
            sent = await producer.send_and_wait(
                topic, b'{"amount": 12.5}', key=b"user-42", headers=headers
            )
        finally:
            await producer.stop()

        consumer = AIOKafkaConsumer(bootstrap_servers=kafka_bootstrap, auto_offset_reset="earliest")
        await consumer.start()
        try:
            consumer.assign([TopicPartition(topic, p) for p in range(3)])
            record = await asyncio.wait_for(consumer.getone(), timeout=10)
        finally:
            await consumer.stop()

        assert (record.partition, record.offset) == (sent.partition, sent.offset)
        assert record.key == b"user-42"
        assert record.value == b'{"amount": 12.5}'
        assert list(record.headers) == headers

    asyncio.run(scenario())


def test_redis_answers_ping_and_round_trips_a_hash(redis_client: redis.Redis) -> None:
    assert redis_client.ping() is True
    redis_client.hset("user:42", mapping={"txn_count_1h": 3, "amount_sum_1h": "99.5"})
    assert redis_client.hgetall("user:42") == {b"txn_count_1h": b"3", b"amount_sum_1h": b"99.5"}


# --- starting and stopping ---------------------------------------------------


def test_stopped_redis_leaves_no_process(tmp_path: Path) -> None:
    handle = stack.start_redis(workdir=tmp_path)
    assert stack.pid_alive(handle.pid)
    stack.wait_redis_ready(handle.url, timeout=1, pid=handle.pid)

    handle.stop()

    assert not stack.pid_alive(handle.pid)
    with pytest.raises(ProcessLookupError):  # reaped too: not even a zombie is left
        os.kill(handle.pid, 0)
    handle.stop()  # a second stop is a no-op


def test_start_fails_clearly_when_the_port_is_taken(tmp_path: Path) -> None:
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        port = squatter.getsockname()[1]
        with pytest.raises(stack.StackError, match="in use"):
            stack.start_redis(port, workdir=tmp_path)


def test_a_broker_that_cannot_start_says_why(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    lib = tmp_path / "lib"
    lib.mkdir()
    (lib / "kafka_2.13-0.0.jar").write_bytes(b"not a jar")  # the class path of a broken setup
    monkeypatch.setenv("FRAUD_KAFKA_LIB", str(lib))

    with pytest.raises(stack.StackError, match="formatting the broker's log dir failed") as failure:
        stack.start_broker(workdir=tmp_path / "broker")
    assert "kafka.tools.StorageTool" in str(failure.value)  # java's own words: the class is missing


def test_a_missing_setup_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FRAUD_KAFKA_LIB", str(tmp_path))
    with pytest.raises(stack.StackError, match="make setup"):
        stack.start_broker(workdir=tmp_path / "broker")


def test_broker_restart_keeps_topics_and_committed_transactions(tmp_path: Path) -> None:
    """The local broker is a real log: a restart on the same state dir finds what
    was committed, and transactions (InitProducerId) work on one node."""
    topic = "kept"

    async def produce(bootstrap: str) -> None:
        admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
        await admin.start()
        try:
            await admin.create_topics([NewTopic(topic, num_partitions=1, replication_factor=1)])
        finally:
            await admin.close()
        producer = AIOKafkaProducer(bootstrap_servers=bootstrap, transactional_id="stack-test")
        await producer.start()
        try:
            async with producer.transaction():
                await producer.send(topic, b"committed")
            await producer.begin_transaction()
            await producer.send_and_wait(topic, b"aborted")
            await producer.abort_transaction()
        finally:
            await producer.stop()

    async def read(bootstrap: str) -> list[bytes]:
        consumer = AIOKafkaConsumer(
            bootstrap_servers=bootstrap, isolation_level="read_committed", auto_offset_reset="earliest"
        )
        await consumer.start()
        try:
            consumer.assign([TopicPartition(topic, 0)])
            batches = await consumer.getmany(timeout_ms=5000)
            return [r.value for records in batches.values() for r in records]
        finally:
            await consumer.stop()

    port, controller = stack.free_ports(2)
    first = stack.start_broker(port, tmp_path, controller_port=controller)
    try:
        asyncio.run(produce(first.url))
    finally:
        first.stop()
    assert not stack.pid_alive(first.pid)
    again = stack.start_broker(port, tmp_path, controller_port=controller)
    try:
        assert asyncio.run(read(again.url)) == [b"committed"]
    finally:
        again.stop()


def test_waiting_for_nothing_times_out_with_the_reason() -> None:
    with pytest.raises(stack.StackError, match=r"not ready .* after 0\.5 s"):
        stack.wait_redis_ready(f"redis://127.0.0.1:{stack.free_port()}/0", timeout=0.5)


# --- up / down ---------------------------------------------------------------


def test_stack_up_reuses_and_down_stops_both(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("KAFKA_BOOTSTRAP", raising=False)
    monkeypatch.delenv("REDIS_URL", raising=False)
    ports = dict(zip(("broker_port", "redis_port"), stack.free_ports(2), strict=True))

    env = stack.stack_up(tmp_path, **ports)

    pids = {name: int((tmp_path / f"{name}.pid").read_text()) for name in ("broker", "redis")}
    assert all(stack.pid_alive(pid) for pid in pids.values())
    stack.wait_broker_ready(env["KAFKA_BOOTSTRAP"], timeout=2, pid=pids["broker"])
    stack.wait_redis_ready(env["REDIS_URL"], timeout=2, pid=pids["redis"])
    assert (tmp_path / "env").read_text() == (
        f"export KAFKA_BOOTSTRAP={env['KAFKA_BOOTSTRAP']}\nexport REDIS_URL={env['REDIS_URL']}\n"
    )
    assert [(name, pid, ready) for name, pid, _, ready in stack.stack_status(tmp_path)] == [
        ("broker", pids["broker"], True),
        ("redis", pids["redis"], True),
    ]

    assert stack.stack_up(tmp_path, **ports) == env  # idempotent: the same processes
    assert {name: int((tmp_path / f"{name}.pid").read_text()) for name in pids} == pids

    stack.stack_down(tmp_path)

    assert not any(stack.pid_alive(pid) for pid in pids.values())
    assert not list(tmp_path.glob("*.pid"))


def test_stack_up_only_waits_for_services_given_by_env(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, kafka_bootstrap: str, redis_url: str
) -> None:
    monkeypatch.setenv("KAFKA_BOOTSTRAP", kafka_bootstrap)
    monkeypatch.setenv("REDIS_URL", redis_url)

    env = stack.stack_up(tmp_path)

    assert env == {"KAFKA_BOOTSTRAP": kafka_bootstrap, "REDIS_URL": redis_url}
    assert not list(tmp_path.glob("*.pid"))
    stack.stack_down(tmp_path)  # nothing of ours to stop: the given services stay up
    stack.wait_broker_ready(kafka_bootstrap, timeout=2)
