"""``python -m tools.stack up --secure`` and the tools that run against it, each as
its own principal: the stack's env holds no password, Redis has ACL users too,
``status`` / ``down`` / reuse work; replay reads as the ``analyst``, the
autoscaler's broker reading runs as the ``operator`` (which reads no record),
and the load generator refuses to write labels as the payment client."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from unittest import mock

import orjson
import pytest
import redis
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.errors import GroupAuthorizationFailedError, TopicAuthorizationFailedError

from agents.wiring import scoring_group
from app.settings import Settings
from app.topics import kafka_auth
from tests.integration.workers import commit_offset, produce_one
from tools import kafka_secure, stack
from tools.replay import read_labels
from tools.stack import cli as stack_cli

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

REPO = Path(__file__).resolve().parents[2]
S = Settings()


class SecureStack:
    def __init__(self, state_dir: Path, env: dict[str, str], command_lines: set[str]) -> None:
        self.state_dir = state_dir
        self.env = env
        self.command_lines = command_lines  # every process's, seen while the stack started

    def process_env(self, kafka_user: str | None, redis_user: str | None = None) -> dict[str, str]:
        """The environment of a process of one role, as a user builds it: the stack's env + the role's users."""
        base = {k: v for k, v in os.environ.items() if not k.startswith("FRAUD_") and k not in ("KAFKA_BOOTSTRAP", "REDIS_URL")}
        return {**base, **self.env, **stack.role_env(self.state_dir, kafka_user, redis_user)}

    def settings(self, kafka_user: str) -> Settings:
        env = self.process_env(kafka_user)
        return Settings.model_validate(
            {"kafka_bootstrap": env["KAFKA_BOOTSTRAP"]}
            | {k.removeprefix("FRAUD_").lower(): v for k, v in env.items() if k.startswith("FRAUD_")}
        )


class CommandLines(threading.Thread):
    """Reads every process's command line (``/proc/<pid>/cmdline``, which any local
    user may read) over and over until stopped: what another user could have seen."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.seen: set[str] = set()
        self.stopping = threading.Event()

    def run(self) -> None:
        while not self.stopping.is_set():
            for entry in Path("/proc").iterdir():
                if entry.name.isdigit():
                    try:
                        self.seen.add((entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"))
                    except OSError:
                        pass  # the process ended meanwhile
            self.stopping.wait(0.01)  # the format's JVM lives for seconds

    def stop(self) -> set[str]:
        self.stopping.set()
        self.join()
        return self.seen


@pytest.fixture(scope="module")
def secure(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SecureStack]:
    state_dir = tmp_path_factory.mktemp("secure-stack")
    ports = dict(zip(("broker_port", "redis_port"), stack.free_ports(2), strict=True))
    with mock.patch.dict(os.environ):
        os.environ.pop("KAFKA_BOOTSTRAP", None)  # a set one would be taken as given, not started
        os.environ.pop("REDIS_URL", None)
        sampler = CommandLines()
        sampler.start()
        try:
            try:
                env = stack.stack_up(state_dir, secure=True, **ports)
            finally:
                seen = sampler.stop()
            yield SecureStack(state_dir, env, seen)
        finally:
            stack.stack_down(state_dir)


def all_passwords(state_dir: Path) -> list[str]:
    """Every SCRAM user's password and every Redis user's."""
    passwords = [kafka_secure.password_file(state_dir, u).read_text().strip() for u in kafka_secure.USERS]
    return passwords + [p.read_text().strip() for p in (state_dir / "redis-users").glob("*.password")]


def cli(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tools.cli", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)  # fmt: skip


# --- the stack ------------------------------------------------------------------------------


def test_the_secure_stack_env_names_no_user_and_holds_no_password(secure: SecureStack) -> None:
    text = (secure.state_dir / "env").read_text()
    passwords = all_passwords(secure.state_dir)
    assert len(passwords) == len(kafka_secure.USERS) + 4  # Redis: worker, gateway, materialize, admin
    assert not [p for p in passwords if p in text]
    assert "@" not in secure.env["REDIS_URL"] and "SASL_USERNAME" not in text and "PASSWORD" not in text
    # Redis is secured too: the anonymous default user is off.
    with pytest.raises(redis.exceptions.AuthenticationError):
        redis.Redis.from_url(secure.env["REDIS_URL"], socket_timeout=5).ping()


def test_no_password_is_on_a_command_line_while_the_stack_starts(secure: SecureStack) -> None:
    """The first start formats the broker's log dir with every SCRAM user: no
    password may be in a process's arguments, which every local user can read."""
    passwords = all_passwords(secure.state_dir)
    assert any("kafka.Kafka" in line for line in secure.command_lines)  # the sampler saw the stack start
    # ... and the JVM before it: the storage tool formatting the log dir
    assert any(" -cp " in line and "kafka.Kafka" not in line for line in secure.command_lines)
    leaks = [line.split(" -cp ")[0] for line in secure.command_lines if any(p in line for p in passwords)]
    assert len(leaks) == 0, f"passwords on the command lines of {leaks}"  # the programs, not the passwords


def test_status_and_reuse_work_on_the_secure_stack(secure: SecureStack) -> None:
    rows = stack.stack_status(secure.state_dir)
    assert [(name, ready) for name, _, _, ready in rows] == [("broker", True), ("redis", True)]
    pids = {name: pid for name, pid, _, _ in rows}
    ports = {"broker_port": int(secure.env["KAFKA_BOOTSTRAP"].rsplit(":", 1)[1]),
             "redis_port": int(secure.env["REDIS_URL"].rsplit(":", 1)[1].split("/")[0])}  # fmt: skip
    with mock.patch.dict(os.environ):
        os.environ.pop("KAFKA_BOOTSTRAP", None)
        os.environ.pop("REDIS_URL", None)
        assert stack.stack_up(secure.state_dir, secure=True, **ports) == secure.env
    assert {name: pid for name, pid, _, _ in stack.stack_status(secure.state_dir)} == pids  # the same processes


def test_a_role_reaches_redis_with_its_own_user(secure: SecureStack) -> None:
    from app import redis_client
    from app.redis_keys import decision_id_key, profile_key

    env = secure.process_env(None, "materialize")
    settings = Settings(redis_url=env["REDIS_URL"], redis_username=env["FRAUD_REDIS_USERNAME"],
                        redis_password_file=Path(env["FRAUD_REDIS_PASSWORD_FILE"]))  # fmt: skip
    client = redis_client.sync_client(settings, timeout_s=5.0)
    client.hset(profile_key("u-stack"), "txn_count_30d", 1)
    with pytest.raises(redis.exceptions.NoPermissionError):
        client.get(decision_id_key("u-stack", "t-1"))


# --- replay: the analyst -------------------------------------------------------------------


def test_replay_reads_feedback_and_labels_as_the_analyst(secure: SecureStack) -> None:
    analyst = secure.settings("analyst")
    label = {"transaction_id": "t-replay-1", "label": "fraud", "source": "analyst", "labeled_at": "2026-01-02T03:04:05+00:00"}
    asyncio.run(produce_one(analyst.kafka_bootstrap, kafka_auth(analyst), S.topic_labels, orjson.dumps(label)))
    assert "t-replay-1" in {lb.transaction_id for lb in read_labels(analyst)}
    # The command an analyst runs: feedback and labels from offset 0.
    done = cli(["report", "quality", "--replay", "--json"], secure.process_env("analyst"))
    assert done.returncode == 0, done.stderr[-3000:]
    assert isinstance(json.loads(done.stdout), dict)
    # A payment client may not read the labels.
    with pytest.raises(TopicAuthorizationFailedError):
        read_labels(secure.settings("payments"))


# --- autoscale: the operator ---------------------------------------------------------------


def test_scale_advise_from_the_broker_runs_as_the_operator_who_reads_no_record(secure: SecureStack) -> None:
    scoring = secure.settings("scoring")

    async def commit_as_the_workers() -> None:
        # 5 payments on partition 0; the workers' group has committed 2 of them.
        payments = secure.settings("payments")
        producer = AIOKafkaProducer(bootstrap_servers=payments.kafka_bootstrap, **kafka_auth(payments))
        await producer.start()
        try:
            for _ in range(5):
                await producer.send_and_wait(S.topic_transactions, b"{}", partition=0)
        finally:
            await producer.stop()
        await commit_offset(scoring.kafka_bootstrap, kafka_auth(scoring), scoring_group(S), S.topic_transactions, 2)

    asyncio.run(commit_as_the_workers())
    done = cli(["scale", "advise", "--from-broker", "--interval", "1", "--capacity-tps", "1", "--json"],
               secure.process_env("operator"))  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout)["measurement"]["lag"] == 3.0

    operator = secure.settings("operator")

    async def read_a_payment() -> Any:
        consumer = AIOKafkaConsumer(bootstrap_servers=operator.kafka_bootstrap, auto_offset_reset="earliest",
                                    **kafka_auth(operator))  # fmt: skip
        await consumer.start()
        try:
            consumer.assign([TopicPartition(S.topic_transactions, 0)])
            async with asyncio.timeout(20):
                return await consumer.getmany(timeout_ms=5000)
        finally:
            await consumer.stop()

    async def reset_the_group() -> None:
        await commit_offset(operator.kafka_bootstrap, kafka_auth(operator), scoring_group(S), S.topic_transactions, 5)

    with pytest.raises(TopicAuthorizationFailedError):
        asyncio.run(read_a_payment())
    with pytest.raises(GroupAuthorizationFailedError):
        asyncio.run(reset_the_group())


# --- the load generator: the payment client --------------------------------------------------


def test_the_load_generator_refuses_to_write_labels_as_the_payment_client(secure: SecureStack, tmp_path: Path) -> None:
    """``--labels`` writes `labels`, the analyst's right: on an authenticated broker
    the payment client says so in one line instead of failing mid-load. (The
    demo's test runs the load generator as ``payments`` end to end.)"""
    done = cli(["loadgen", "--rate", "5", "--duration", "1", "--labels", "0.5", "--data", str(tmp_path / "none.parquet")],
               secure.process_env("payments"))  # fmt: skip
    assert done.returncode == 2, done.stdout + done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "--labels writes `labels`" in lines[0] and "'payments'" in lines[0], done.stderr


def test_up_says_in_one_line_when_the_other_stack_holds_the_ports(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`make demo` after `make stack-up` (or the other way round): both stacks use
    the same ports, so `up` names the one that runs instead of failing on a port."""
    plain, secure_dir = tmp_path / "plain", tmp_path / "plain" / "secure"
    monkeypatch.setattr(stack_cli, "DEFAULT_STATE_DIR", plain)
    monkeypatch.setattr(stack_cli, "DEFAULT_SECURE_STATE_DIR", secure_dir)
    running = stack.start_redis(workdir=plain)  # what `make stack-up` left running
    (plain / "redis.pid").write_text(f"{running.pid}\n")
    try:
        assert stack.main(["up", "--secure"]) == 1
    finally:
        running.stop()
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: the plaintext stack ({plain}: redis (pid {running.pid})) holds the ports: "
                   "stop it first (`python -m tools.stack down`)"]  # fmt: skip
    assert not (secure_dir / "broker.pid").exists()  # nothing started
