"""The replicated local stack, as an operator runs it: ``python -m tools.stack up
--brokers 3`` (three Kafka brokers and three KRaft controllers, real JVMs, three redis-servers, three
redis-sentinels), ``status`` and ``down``.

A minute or more each (six JVMs on two cores): marked ``cluster``, run by
``make test-cluster`` (``-m cluster``); ``make test`` deselects them.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from aiokafka import AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType

from app.redis_keys import profile_key
from app.settings import Settings
from app.topics import topic_partitions
from tools import cluster, kafka_secure, stack
from tools.stack.ports import below_ephemeral

pytestmark = [
    pytest.mark.integration,
    pytest.mark.timeout(300),
    pytest.mark.cluster,  # six JVMs for minutes
]
REPO = Path(__file__).resolve().parents[2]


def _free_run(offsets: tuple[int, ...]) -> int:
    """A base port with ``base + o`` free for every offset (the CLI lays ports out from a base)."""
    # Below the ephemeral range: a client connection of a parallel test could take a port in it.
    low, high = below_ephemeral(max(offsets))
    for _ in range(200):
        base = random.randrange(low, high)
        try:
            for offset in offsets:
                with socket.socket() as s:
                    s.bind(("127.0.0.1", base + offset))
        except OSError:
            continue
        return base
    raise AssertionError("no free run of ports")


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tools.stack", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=240, check=False)  # fmt: skip


def _env(stdout: str) -> dict[str, str]:
    import shlex

    return dict(shlex.split(line)[1].split("=", 1) for line in stdout.splitlines() if line.startswith("export "))


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, dict[str, str]]]:
    state = tmp_path_factory.mktemp("cluster")
    broker_port, redis_port = _free_run(tuple(range(6))), _free_run((0, 1, 2, 100, 101, 102))
    done = _cli("up", "--brokers", "3", "--state-dir", str(state), "--broker-port", str(broker_port),
                "--redis-port", str(redis_port))  # fmt: skip
    try:
        assert done.returncode == 0, done.stderr[-3000:]
        yield state, _env(done.stdout)
    finally:
        cluster.cluster_down(state)  # a no-op once the last test stopped it


def _pids(state: Path) -> dict[str, int]:
    return {p.stem: int(p.read_text()) for p in state.glob("*.pid")}


def test_every_topic_has_three_replicas_two_in_sync_and_no_unclean_election(up: tuple[Path, dict[str, str]]) -> None:
    state, env = up
    settings = Settings(kafka_bootstrap=env["KAFKA_BOOTSTRAP"])
    project = list(topic_partitions(settings))
    internal = ["__consumer_offsets", "__transaction_state"]
    described = asyncio.run(cluster.describe_partitions(settings, [*project, *internal]))
    for topic, parts in described.items():
        assert parts, topic
        for p in parts:
            assert len(p["replicas"]) == 3 and sorted(p["isr"]) == sorted(p["replicas"]), (topic, p)
    # Leaders spread over the nodes.
    assert {p["leader"] for p in described[settings.topic_transactions]} == {1, 2, 3}

    async def configs() -> tuple[dict[str, str], dict[str, str]]:
        admin = AIOKafkaAdminClient(bootstrap_servers=env["KAFKA_BOOTSTRAP"])
        await admin.start()
        try:
            [topic] = await admin.describe_configs([ConfigResource(ConfigResourceType.TOPIC, settings.topic_transactions)])
            [broker] = await admin.describe_configs([ConfigResource(ConfigResourceType.BROKER, "1")])
        finally:
            await admin.close()
        as_dict = lambda r: {c[0]: c[1] for c in r.resources[0][4]}  # noqa: E731
        return as_dict(topic), as_dict(broker)

    topic_config, broker_config = asyncio.run(configs())
    assert topic_config["min.insync.replicas"] == "2"
    assert topic_config["unclean.leader.election.enable"] == "false"
    assert broker_config["transaction.state.log.min.isr"] == "2"
    assert env["REDIS_URL"].startswith("redis+sentinel://")


def test_status_shows_each_node_the_leaders_the_isr_and_the_redis_primary(up: tuple[Path, dict[str, str]]) -> None:
    state, _ = up
    done = _cli("status", "--brokers", "3", "--state-dir", str(state))
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    for name in ("broker-1", "broker-2", "broker-3", "controller-1", "controller-2", "controller-3", "redis-1",
                 "redis-2", "redis-3", "sentinel-1", "sentinel-2", "sentinel-3"):  # fmt: skip
        assert f"{name} " in out and "NOT running" not in out
    assert out.count(", active") == 1  # one active controller
    partitions = out.split("(* under-replicated)\n", 1)[1]
    assert "__transaction_state" in partitions and "transactions " in partitions and "*" not in partitions
    assert "redis: primary 127.0.0.1:" in out and "3 Sentinels" in out


def test_losing_the_leader_of_most_partitions_leaves_writes_going(up: tuple[Path, dict[str, str]]) -> None:
    """kill -9 the node leading most ``transactions`` partitions: an ``acks=all``
    producer writes to every partition again within seconds (2 replicas still in
    sync); restarted on its log dir, the node catches up and rejoins every ISR."""
    state, env = up
    settings = Settings(kafka_bootstrap=env["KAFKA_BOOTSTRAP"])
    parts = asyncio.run(cluster.describe_partitions(settings, [settings.topic_transactions]))[settings.topic_transactions]
    leaders = [p["leader"] for p in parts]
    victim = max(set(leaders), key=leaders.count)
    pid = _pids(state)[f"broker-{victim}"]

    async def write_everywhere(producer: AIOKafkaProducer) -> None:
        await asyncio.gather(*(producer.send_and_wait(settings.topic_transactions, b"{}", partition=p["partition"])
                               for p in parts))  # fmt: skip

    async def scenario() -> float:
        producer = AIOKafkaProducer(bootstrap_servers=env["KAFKA_BOOTSTRAP"], acks="all", enable_idempotence=True,
                                    request_timeout_ms=30_000, retry_backoff_ms=50)  # fmt: skip
        await producer.start()
        try:
            await write_everywhere(producer)
            os.kill(pid, signal.SIGKILL)
            killed = time.monotonic()
            await write_everywhere(producer)
            return time.monotonic() - killed
        finally:
            await producer.stop()

    gap = asyncio.run(scenario())
    assert not stack.pid_alive(pid)
    handle = cluster.start_node(state, victim)
    assert _pids(state)[f"broker-{victim}"] == handle.pid
    deadline = time.monotonic() + 60
    while True:
        now = asyncio.run(cluster.describe_partitions(settings, [settings.topic_transactions]))
        if all(len(p["isr"]) == 3 for p in now[settings.topic_transactions]):
            break
        assert time.monotonic() < deadline, f"node {victim} did not rejoin the ISRs: {now}"
        time.sleep(0.5)
    print(f"CLUSTER leader-loss write gap {gap:.1f} s (node {victim}, {leaders.count(victim)} leaderships)")
    # The controller fences the node after broker.session.timeout.ms (1.5 s on the cluster);
    # the producer then finds the new leaders.
    assert gap < 8, gap


def test_down_stops_exactly_what_up_started(up: tuple[Path, dict[str, str]]) -> None:
    state, _ = up
    pids = _pids(state)
    assert len(pids) == 12  # 3 brokers, 3 controllers, 3 Redis nodes, 3 Sentinels
    done = _cli("down", "--brokers", "3", "--state-dir", str(state))
    assert done.returncode == 0, done.stderr
    assert not any(stack.pid_alive(pid) for pid in pids.values())
    assert not list(state.glob("*.pid")) and not (state / "env").exists()


def test_the_secure_cluster(tmp_path: Path) -> None:
    """``up --secure --brokers 3``: TLS + SASL/SCRAM and ACLs on every node, the
    topics replicated 3 times; a role user writes with acks=all; the Redis
    nodes and Sentinels take only the ACL users."""
    import redis

    from app.redis_client import sync_client

    state = tmp_path / "secure"
    layout = cluster.Cluster.free()
    try:
        env = cluster.cluster_up(state, layout, secure=True)
        scoring = kafka_secure.client_settings(state.resolve(), "scoring", env["KAFKA_BOOTSTRAP"])
        admin = kafka_secure.client_settings(state.resolve(), kafka_secure.ADMIN, env["KAFKA_BOOTSTRAP"])
        parts = asyncio.run(cluster.describe_partitions(admin, [admin.topic_decisions]))[admin.topic_decisions]
        assert all(len(p["isr"]) == 3 for p in parts)

        async def write() -> None:
            from app.topics import kafka_auth

            producer = AIOKafkaProducer(bootstrap_servers=env["KAFKA_BOOTSTRAP"], acks="all", **kafka_auth(scoring))
            await producer.start()
            try:
                await producer.send_and_wait(scoring.topic_decisions, b"{}")
            finally:
                await producer.stop()

        asyncio.run(write())
        role = stack.role_env(state, redis_user="worker")
        worker = Settings(redis_url=env["REDIS_URL"], redis_username=role["FRAUD_REDIS_USERNAME"],
                          redis_password_file=Path(role["FRAUD_REDIS_PASSWORD_FILE"]))  # fmt: skip
        client = sync_client(worker, timeout_s=2)
        try:
            assert client.hgetall(profile_key("u-sec")) == {}  # what the worker's user may do, via the Sentinels
        finally:
            client.close()
        with pytest.raises(redis.AuthenticationError):  # the anonymous user is off on the Sentinels too
            redis.Redis(port=layout.sentinels[0], socket_timeout=2).execute_command("SENTINEL", "MASTERS")
        lines, ok = cluster.cluster_status(state)
        assert ok, "\n".join(lines)
    finally:
        cluster.cluster_down(state)
