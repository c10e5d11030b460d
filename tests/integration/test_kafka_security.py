"""The secure broker for real: SASL/SCRAM-SHA-512 over TLS and one principal per
role with least-privilege ACLs (``tools/kafka_acls.py``), one broker for the module.

A scoring worker with the scoring worker's credentials decides a signed
transaction end to end; each role is refused what its row does not grant; a
client without credentials, with a wrong password, or not trusting the CA gets
nowhere."""

from __future__ import annotations

import asyncio
import logging
import os
import re
import secrets
import ssl
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pandas as pd
import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import KafkaError, TopicAuthorizationFailedError

from app.settings import Settings
from app.topics import kafka_auth
from pipeline.auth import sign
from tests.integration.workers import Topics, TxFactory, Workers, produce_one, tx_msg, worker_env
from tools import kafka_acls, kafka_secure, stack
from tools.kafka_acls import acls
from tools.stack.broker import KAFKA_HOME, kafka_classpath, lib_kafka_version, write_log_config

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

CLIENT = "pos-secure"
DEFAULTS = Settings()
#: The project's own topic names: the secure broker's ACLs name them.
TOPICS = Topics(
    DEFAULTS.topic_transactions, DEFAULTS.topic_decisions, DEFAULTS.topic_dlq,
    DEFAULTS.topic_feedback, DEFAULTS.topic_monitoring, DEFAULTS.topic_labels,
)  # fmt: skip


class SecureBroker:
    def __init__(self, workdir: Path, bootstrap: str) -> None:
        self.workdir = workdir
        self.bootstrap = bootstrap

    def opts(self, user: str) -> dict[str, Any]:
        return kafka_auth(kafka_secure.client_settings(self.workdir, user, self.bootstrap))

    def env(self, user: str) -> dict[str, str]:
        return kafka_secure.client_env(self.workdir, user, self.bootstrap)


@pytest.fixture(scope="module")
def secure(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SecureBroker]:
    workdir = tmp_path_factory.mktemp("secure-broker")
    handle = stack.start_broker(workdir=workdir, secure=True)
    try:
        yield SecureBroker(workdir, handle.url)
    finally:
        handle.stop()


async def _fetch(bootstrap: str, opts: dict[str, Any], topic: str) -> Any:
    consumer = AIOKafkaConsumer(
        bootstrap_servers=bootstrap, group_id=None, enable_auto_commit=False,
        auto_offset_reset="earliest", request_timeout_ms=10_000, **opts,
    )  # fmt: skip
    await consumer.start()
    try:
        consumer.assign([TopicPartition(topic, 0)])
        async with asyncio.timeout(20):
            return await consumer.getmany(timeout_ms=5000)
    finally:
        await consumer.stop()


async def _connect(bootstrap: str, opts: dict[str, Any]) -> list[str]:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=5_000, **opts)
    try:
        async with asyncio.timeout(20):
            await admin.start()
            return list(await admin.list_topics())
    finally:
        await admin.close()


# --- the pipeline over SASL_SSL ------------------------------------------------------------


def test_a_scoring_worker_decides_a_signed_transaction_over_sasl_ssl(
    secure: SecureBroker, redis_url: str, sim_frame: pd.DataFrame, trained_registry: Path, tmp_path: Path
) -> None:
    key = secrets.token_bytes(32)
    env = worker_env(
        bootstrap=secure.bootstrap, redis_url=redis_url, topics=TOPICS, registry=trained_registry,
        workdir=tmp_path, app_id=DEFAULTS.app_id, partitions=DEFAULTS.partitions,
        FRAUD_CLIENT_KEYS=f"{CLIENT}:{key.hex()}", FRAUD_ALLOW_UNSIGNED="false", FRAUD_WORKER_ROLE="score",
        **secure.env("scoring"),
    )  # fmt: skip
    assert "FRAUD_KAFKA_SASL_PASSWORD" not in env  # the password comes from its file
    make = TxFactory(sim_frame, f"t-secure-{uuid.uuid4().hex[:6]}")
    doc = make(currency="USD")
    msg = tx_msg(doc, "c-secure-1")
    msg.headers = list(sign(msg.value, CLIENT, key, int(time.time() * 1000)).items())
    workers = Workers(tmp_path, env)

    async def submit_and_read(payments: dict[str, Any]) -> dict[str, Any]:
        producer = AIOKafkaProducer(bootstrap_servers=secure.bootstrap, **payments)
        consumer = AIOKafkaConsumer(
            bootstrap_servers=secure.bootstrap, group_id=None, enable_auto_commit=False,
            auto_offset_reset="earliest", **payments,
        )  # fmt: skip
        await producer.start()
        await consumer.start()
        try:
            await producer.send_and_wait(TOPICS.transactions, msg.value, key=msg.key, headers=msg.all_headers())
            consumer.assign([TopicPartition(TOPICS.decisions, p) for p in range(DEFAULTS.partitions)])
            deadline = time.monotonic() + 90
            while time.monotonic() < deadline:
                for records in (await consumer.getmany(timeout_ms=500)).values():
                    for r in records:
                        if not r.value:
                            continue  # a worker's handover record (app/eos.py)
                        decision = orjson.loads(r.value)
                        if decision.get("transaction_id") == doc["transaction_id"]:
                            return dict(decision)
            raise AssertionError(f"no decision for {doc['transaction_id']} in 90 s\n{workers.logs()}")
        finally:
            await consumer.stop()
            await producer.stop()

    try:
        worker = workers.start()
        asyncio.run(worker.wait_for_log("Ready", 120))
        decision = asyncio.run(submit_and_read(secure.opts("payments")))
        assert decision["action"] in ("approve", "review", "decline"), decision
        assert worker.alive()
        assert "TopicAuthorizationFailed" not in worker.text(), worker.log()
    finally:
        workers.stop_all()


def test_a_feedback_worker_runs_on_its_own_credentials(
    secure: SecureBroker, redis_url: str, trained_registry: Path, tmp_path: Path
) -> None:
    """``--role feedback`` as ``feedback``: its group, its faust topics, ``feedback``
    and ``labels`` in; no authorization error while it consumes a label."""
    env = worker_env(
        bootstrap=secure.bootstrap, redis_url=redis_url, topics=TOPICS, registry=trained_registry,
        workdir=tmp_path, app_id=DEFAULTS.app_id, partitions=DEFAULTS.partitions,
        FRAUD_WORKER_ROLE="feedback", **secure.env("feedback"),
    )  # fmt: skip
    workers = Workers(tmp_path, env)
    try:
        worker = workers.start()
        asyncio.run(worker.wait_for_log("Ready", 120))
        label = orjson.dumps({"transaction_id": "t-secure-fb-1", "label": "legit", "source": "analyst"})
        asyncio.run(produce_one(secure.bootstrap, secure.opts("analyst"), DEFAULTS.topic_labels, label))
        time.sleep(5)
        assert worker.alive(), worker.log()
        assert "AuthorizationFailed" not in worker.text(), worker.log()
    finally:
        workers.stop_all()


def test_the_gateway_decides_a_rest_call_on_its_own_credentials(
    secure: SecureBroker, redis_url: str, sim_frame: pd.DataFrame, trained_registry: Path, tmp_path: Path
) -> None:
    """The REST gateway as ``gateway`` submits, the worker as ``scoring`` decides, the
    gateway's reply reader (no consumer group) brings the decision back."""
    from tests.factories import new_key, write_keys
    from tests.integration.test_gateway import GatewayProc, http

    api_key = new_key()
    producers = write_keys(tmp_path / "producers.json", gateway=new_key())
    base = worker_env(
        bootstrap=secure.bootstrap, redis_url=redis_url, topics=TOPICS, registry=trained_registry,
        workdir=tmp_path, app_id=DEFAULTS.app_id, partitions=DEFAULTS.partitions,
        FRAUD_ALLOW_UNSIGNED="false", FRAUD_CLIENT_KEYS_FILE=str(producers),
    )  # fmt: skip
    workers = Workers(tmp_path, {**base, **secure.env("scoring"), "FRAUD_WORKER_ROLE": "score"})
    gateway_env = {
        **base, **secure.env("gateway"),
        "FRAUD_GATEWAY_KEYS_FILE": str(write_keys(tmp_path / "api.json", acme=api_key)),
        "FRAUD_GATEWAY_TIMEOUT_S": "20",
    }  # fmt: skip
    gateway = GatewayProc(gateway_env, tmp_path / "gateway.log")
    try:
        worker = workers.start()
        gateway.wait_ready(120)
        asyncio.run(worker.wait_for_log("Ready", 120))
        doc = TxFactory(sim_frame, f"t-secure-gw-{uuid.uuid4().hex[:6]}")(currency="USD")
        reply = http("POST", f"{gateway.url}/v1/transactions", doc, api_key, timeout=30)
        assert reply.status == 200, f"{reply.status} {reply.body!r}\n{gateway.log()}\n{workers.logs()}"
        assert reply.json()["transaction_id"] == doc["transaction_id"]
        assert "AuthorizationFailed" not in gateway.log_path.read_text(), gateway.log()
    finally:
        gateway.stop()
        workers.stop_all()


# --- each role is refused what its row does not grant --------------------------------------


async def _end_offsets(secure: SecureBroker, topic: str) -> dict[int, int]:
    """Every partition's end offset, read as the super user."""
    opts = secure.opts(kafka_secure.ADMIN)
    admin = AIOKafkaAdminClient(bootstrap_servers=secure.bootstrap, request_timeout_ms=10_000, **opts)
    await admin.start()
    try:
        (described,) = await admin.describe_topics([topic])
    finally:
        await admin.close()
    tps = [TopicPartition(topic, p["partition"]) for p in described["partitions"]]
    assert tps, f"no partitions for {topic}: {described}"
    consumer = AIOKafkaConsumer(bootstrap_servers=secure.bootstrap, group_id=None, request_timeout_ms=10_000, **opts)
    await consumer.start()
    try:
        return {tp.partition: offset for tp, offset in (await consumer.end_offsets(tps)).items()}
    finally:
        await consumer.stop()


#: (user, topic) writes that no row of the ACL table grants.
REFUSED_WRITES = [
    ("payments", DEFAULTS.topic_decisions),  # a forged approve
    ("payments", DEFAULTS.topic_labels),  # poisoning the tally and retraining
    ("analyst", DEFAULTS.topic_transactions),  # an analyst posing as a payment system
    ("analyst", DEFAULTS.topic_decisions),
    ("feedback", DEFAULTS.topic_decisions),
]


@pytest.mark.parametrize(("user", "topic"), REFUSED_WRITES, ids=[f"{u}->{t}" for u, t in REFUSED_WRITES])
def test_a_role_cannot_write_what_its_row_does_not_grant_and_leaves_nothing(
    secure: SecureBroker, user: str, topic: str
) -> None:
    """The broker's own TopicAuthorizationFailed, and the topic's end offsets do not move:
    nothing was appended, not even an aborted record."""
    before = asyncio.run(_end_offsets(secure, topic))
    with pytest.raises(TopicAuthorizationFailedError):
        asyncio.run(produce_one(secure.bootstrap, secure.opts(user), topic, b'{"action": "approve"}'))
    assert asyncio.run(_end_offsets(secure, topic)) == before


def test_a_payment_client_cannot_take_a_workers_transactional_id(secure: SecureBroker) -> None:
    """Fencing a worker needs its transactional id: the payment client may not init one."""
    from aiokafka.errors import TransactionalIdAuthorizationFailed

    async def init() -> None:
        producer = AIOKafkaProducer(
            bootstrap_servers=secure.bootstrap, transactional_id=f"{DEFAULTS.app_id}-score-{DEFAULTS.topic_transactions}-0",
            request_timeout_ms=10_000, **secure.opts("payments"),
        )  # fmt: skip
        try:
            async with asyncio.timeout(20):
                await producer.start()
        finally:
            await producer.stop()

    with pytest.raises(TransactionalIdAuthorizationFailed):
        asyncio.run(init())


def test_a_payment_client_cannot_read_feedback(secure: SecureBroker) -> None:
    with pytest.raises(TopicAuthorizationFailedError):
        asyncio.run(_fetch(secure.bootstrap, secure.opts("payments"), DEFAULTS.topic_feedback))


def test_the_analyst_writes_labels(secure: SecureBroker) -> None:
    before = asyncio.run(_end_offsets(secure, DEFAULTS.topic_labels))
    label = orjson.dumps({"transaction_id": "t-analyst-1", "label": "fraud", "source": "analyst"})
    asyncio.run(produce_one(secure.bootstrap, secure.opts("analyst"), DEFAULTS.topic_labels, label))
    assert sum(asyncio.run(_end_offsets(secure, DEFAULTS.topic_labels)).values()) == sum(before.values()) + 1


# --- a decision only the workers' key could sign ------------------------------------------


def test_the_load_generator_refuses_decisions_signed_with_a_wrong_key(secure: SecureBroker, tmp_path: Path) -> None:
    """Someone holding the scoring worker's Kafka credentials but not its signing key
    answers the load generator's transactions. Half get a genuinely signed decision;
    the other half forged ones (unsigned, an impostor's signature under the genuine
    key id, the genuine signature of other bytes). The load generator (as ``payments``)
    counts only the genuine ones as decided and the rest as unverified."""
    from pipeline.decision_signing import KEY_ID, DecisionSigner, DecisionVerifier, write_public_keys
    from tools.loadgen import LoadConfig, run_load

    genuine, impostor = DecisionSigner.generate(), DecisionSigner.generate()
    public = tmp_path / "decision-public-keys.json"
    write_public_keys(DecisionVerifier([genuine.public_key]), public)
    forgeries: list[Any] = [
        lambda value: [],
        lambda value: [(KEY_ID, genuine.key_id.encode()), impostor.headers(value)[1]],
        lambda value: genuine.headers(value + b" "),
    ]
    answered: dict[str, str] = {}

    async def forger(ready: asyncio.Event, stop: asyncio.Event) -> None:
        opts = secure.opts("scoring")
        consumer = AIOKafkaConsumer(bootstrap_servers=secure.bootstrap, group_id=None, enable_auto_commit=False,
                                    fetch_max_wait_ms=50, **opts)  # fmt: skip
        producer = AIOKafkaProducer(bootstrap_servers=secure.bootstrap, **opts)
        await consumer.start()
        await producer.start()
        try:
            tps = [TopicPartition(DEFAULTS.topic_transactions, p) for p in range(DEFAULTS.partitions)]
            consumer.assign(tps)
            await consumer.seek_to_end(*tps)
            for tp in tps:
                await consumer.position(tp)
            ready.set()
            while not stop.is_set():
                for records in (await consumer.getmany(timeout_ms=200)).values():
                    for r in records:
                        tx = orjson.loads(r.value)
                        value = orjson.dumps({"transaction_id": tx["transaction_id"], "action": "approve",
                                              "fraud_score": 0.01, "explanation": []})  # fmt: skip
                        n = len(answered)
                        forged = n % 2 == 1
                        headers = forgeries[(n // 2) % len(forgeries)](value) if forged else genuine.headers(value)
                        answered[tx["transaction_id"]] = "forged" if forged else "genuine"
                        await producer.send_and_wait(DEFAULTS.topic_decisions, value, key=r.key, headers=headers)
        finally:
            await producer.stop()
            await consumer.stop()

    async def run() -> dict[str, Any]:
        ready, stop = asyncio.Event(), asyncio.Event()
        task = asyncio.create_task(forger(ready, stop))
        await asyncio.wait_for(ready.wait(), 30)
        settings = kafka_secure.client_settings(secure.workdir, "payments", secure.bootstrap).model_copy(
            update={"decision_public_keys_file": public}
        )
        cfg = LoadConfig(rate=20, duration_s=3.0, drain_s=5.0, settings=settings, quiet=True,
                         data=tmp_path / "population.parquet")  # fmt: skip
        try:
            return await run_load(cfg)
        finally:
            stop.set()
            await task

    summary = asyncio.run(run())
    forged = sum(kind == "forged" for kind in answered.values())
    assert len(answered) == summary["sent"] > 0 and forged > 0
    assert summary["verified"] is True
    assert summary["unverified"] == forged
    assert summary["decided"] == summary["sent"] - forged
    assert summary["actions"] == {"approve": summary["sent"] - forged}


def test_the_gateway_refuses_decisions_signed_with_a_wrong_key(
    secure: SecureBroker, redis_url: str, sim_frame: pd.DataFrame, trained_registry: Path, tmp_path: Path
) -> None:
    """The same attacker against the REST gateway (as ``gateway``): a forged ``approve``
    carrying the request's transaction and correlation ids is no answer (504, counted
    in /healthz); one signed with the workers' key is the answer."""
    from pipeline.decision_signing import KEY_ID, DecisionSigner
    from tests.factories import decision_key_files, new_key, write_keys
    from tests.integration.test_gateway import GatewayProc, http

    genuine, impostor = DecisionSigner.from_file(decision_key_files()[0]), DecisionSigner.generate()
    api_key = new_key()
    env = {
        **worker_env(bootstrap=secure.bootstrap, redis_url=redis_url, topics=TOPICS, registry=trained_registry,
                     workdir=tmp_path, app_id=DEFAULTS.app_id, partitions=DEFAULTS.partitions),
        **secure.env("gateway"),
        "FRAUD_GATEWAY_KEYS_FILE": str(write_keys(tmp_path / "api.json", acme=api_key)),
        "FRAUD_GATEWAY_TIMEOUT_S": "5",
    }  # fmt: skip
    make = TxFactory(sim_frame, f"t-secure-forged-{uuid.uuid4().hex[:6]}")

    async def answer(sign: Any) -> Any:
        doc = make(currency="USD")
        opts = secure.opts("scoring")
        consumer = AIOKafkaConsumer(bootstrap_servers=secure.bootstrap, group_id=None,
                                    auto_offset_reset="earliest", **opts)  # fmt: skip
        producer = AIOKafkaProducer(bootstrap_servers=secure.bootstrap, **opts)
        await consumer.start()
        await producer.start()
        try:
            consumer.assign([TopicPartition(TOPICS.transactions, p) for p in range(DEFAULTS.partitions)])
            call = asyncio.ensure_future(asyncio.to_thread(
                http, "POST", f"{gateway.url}/v1/transactions", doc, api_key, timeout=30))  # fmt: skip
            correlation = None
            async with asyncio.timeout(30):
                while correlation is None:
                    for records in (await consumer.getmany(timeout_ms=500)).values():
                        for record in records:
                            if record.value and orjson.loads(record.value)["transaction_id"] == doc["transaction_id"]:
                                correlation = dict(record.headers)["correlation-id"].decode()
            value = orjson.dumps({"transaction_id": doc["transaction_id"], "user_id": doc["user_id"],
                                  "action": "approve", "score": 0.0, "reasons": [],
                                  "correlation_id": correlation, "cached": False})  # fmt: skip
            await producer.send_and_wait(TOPICS.decisions, value, key=doc["transaction_id"].encode(), headers=sign(value))
            return await call
        finally:
            await consumer.stop()
            await producer.stop()

    gateway = GatewayProc(env, tmp_path / "gateway.log")
    try:
        gateway.wait_ready(120)
        forgeries = [lambda value: [], lambda value: [(KEY_ID, genuine.key_id.encode()), impostor.headers(value)[1]]]
        for sign in forgeries:
            reply = asyncio.run(answer(sign))
            assert reply.status == 504, f"{reply.status} {reply.body!r}\n{gateway.log()}"
        reply = asyncio.run(answer(genuine.headers))
        assert reply.status == 200, f"{reply.status} {reply.body!r}\n{gateway.log()}"
        assert reply.json()["action"] == "approve"
        assert http("GET", f"{gateway.url}/healthz").json()["unverified_decisions"] == len(forgeries)
        assert "AuthorizationFailed" not in gateway.log_path.read_text(), gateway.log()
    finally:
        gateway.stop()


# --- no way in without credentials and the CA -----------------------------------------------


def test_a_client_without_credentials_is_refused(secure: SecureBroker) -> None:
    for opts in ({}, {"security_protocol": "SSL", "ssl_context": secure.opts("payments")["ssl_context"]}):
        with pytest.raises((KafkaError, TimeoutError, OSError)):
            asyncio.run(_connect(secure.bootstrap, opts))


def test_a_wrong_password_is_refused(secure: SecureBroker, caplog: pytest.LogCaptureFixture) -> None:
    opts = {**secure.opts("payments"), "sasl_plain_password": "not-the-password"}
    with caplog.at_level(logging.ERROR, logger="aiokafka"), pytest.raises((KafkaError, TimeoutError)):
        asyncio.run(_connect(secure.bootstrap, opts))
    assert "uthentication failed" in caplog.text, caplog.text


def test_a_client_not_trusting_the_ca_fails_tls(secure: SecureBroker, caplog: pytest.LogCaptureFixture) -> None:
    opts = {**secure.opts("payments"), "ssl_context": ssl.create_default_context()}  # system CAs only
    with caplog.at_level(logging.ERROR, logger="aiokafka"), pytest.raises((KafkaError, TimeoutError, OSError)):
        asyncio.run(_connect(secure.bootstrap, opts))
    assert "CERTIFICATE_VERIFY_FAILED" in caplog.text, caplog.text


def test_the_workdir_keeps_its_secrets_private_and_the_log_never_shows_them(secure: SecureBroker) -> None:
    log = (secure.workdir / "broker.log").read_text()
    for user in kafka_secure.USERS:
        path = kafka_secure.password_file(secure.workdir, user)
        assert path.stat().st_mode & 0o777 == 0o600
        assert path.read_text().strip() not in log
    assert (secure.workdir / "server.properties").stat().st_mode & 0o777 == 0o600
    assert (secure.workdir / "tls" / "broker.p12").stat().st_mode & 0o777 == 0o600
    assert not (secure.workdir / "tls" / "ca.key").exists()


# --- the deploy script grants the same table ----------------------------------------------


def test_the_deploy_script_grants_a_role_its_row_with_kafka_acls(secure: SecureBroker, tmp_path: Path) -> None:
    """``deploy/kafka/acls.sh`` with Kafka's own ACL tool (``kafka.admin.AclCommand``
    from the jars) as ``kafka-acls.sh``: a renamed analyst gets the analyst's row."""
    config = tmp_path / "admin.properties"
    password = kafka_secure.password_file(secure.workdir, kafka_secure.ADMIN).read_text().strip()
    config.write_text(
        "security.protocol=SASL_SSL\nsasl.mechanism=SCRAM-SHA-512\n"
        "sasl.jaas.config=org.apache.kafka.common.security.scram.ScramLoginModule required "
        f'username="admin" password="{password}";\n'
        f"ssl.truststore.type=PEM\nssl.truststore.location={secure.workdir / 'tls' / 'ca.pem'}\n"
    )
    config.chmod(0o600)
    tool = tmp_path / "kafka-acls.sh"
    # Kafka 4.0 moved the tool out of the broker jar (kafka-tools, deploy/kafka/pom.xml).
    main = "org.apache.kafka.tools.AclCommand" if int(lib_kafka_version().split(".")[0]) >= 4 else "kafka.admin.AclCommand"
    tool.write_text(
        "#!/bin/sh\nexec java -Xmx128m -XX:TieredStopAtLevel=1 "
        f"{write_log_config(tmp_path)} "
        f"-cp '{kafka_classpath()}' {main} \"$@\"\n"
    )
    tool.chmod(0o755)
    env = {**os.environ, "KAFKA_ACLS": str(tool), "PYTHON": sys.executable}
    script = KAFKA_HOME.parent / "deploy" / "kafka" / "acls.sh"
    done = subprocess.run([str(script), secure.bootstrap, str(config), "--user", "analyst=analyst-b"],
                          env=env, capture_output=True, text=True, timeout=240)  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    listed = subprocess.run(
        [str(tool), "--bootstrap-server", secure.bootstrap, "--command-config", str(config),
         "--list", "--principal", "User:analyst-b"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert listed.returncode == 0, listed.stderr
    granted, resource = set(), None
    for line in listed.stdout.splitlines():
        if m := re.search(r"resourceType=(\w+), name=([^,]+), patternType=(\w+)", line):
            resource = (m[1].lower().replace("_", "-"), m[2], m[3].lower())
        elif (m := re.search(r"principal=User:analyst-b, host=\*, operation=(\w+), permissionType=ALLOW", line)):
            assert resource is not None
            granted.add((*resource, m[1].replace("_", "").lower()))
    want = {(a.resource, a.name, a.pattern, a.operation.lower())
            for a in acls(DEFAULTS, {**kafka_acls.ROLES, "analyst": "analyst-b"}) if a.principal == "User:analyst-b"}  # fmt: skip
    assert granted == want
