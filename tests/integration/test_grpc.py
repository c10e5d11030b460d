"""The gateway's gRPC service against the real broker and Redis and a real worker, through grpcio.

``fraud-pipeline gateway`` serves REST and gRPC in one process, in front of a
``fraud-pipeline worker`` that accepts only signed transactions, so a decision
over gRPC also proves the gateway signs what it produces. A second gateway,
with its own topics and no worker, never gets a decision: the deadline test.

Every transaction here has a user of its own run (``u-…-<run>``): the gateway's
per-user buckets live in Redis, which other modules' gateways (and earlier runs,
with REDIS_URL set) share, so the population's users may have spent theirs.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import orjson
import pandas as pd
import pytest
import redis
from aiokafka import AIOKafkaConsumer, TopicPartition
from google.protobuf import descriptor_pool
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase
from grpc_status import rpc_status
from workers import REPO, Topics, TxFactory, Workers, worker_env

from app.contract import ACTIONS
from app.topics import partitions_of
from gateway.grpc_codec import decision_dict, transaction_message
from gateway.grpc_gen.fraud.v1 import fraud_pb2, fraud_pb2_grpc
from tests.factories import new_key, stop_process, write_keys
from tools import stack
from tools.materialize import materialize

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

PARTITIONS = 2
READY_TIMEOUT_S = 90.0
#: Generous: broker, Redis, worker, two gateways and the test share 2 cores.
DECISION_TIMEOUT_S = 30.0
#: Per-user bucket of the gateways under test: 5 transactions, then one per 20 s.
USER_BURST, USER_RATE = 5, 0.05
STREAM_N = 1000
#: Users of the stream: 4 transactions each, inside USER_BURST.
STREAM_USERS = 250


class GrpcGateway:
    """``fraud-pipeline gateway`` with gRPC on, as a subprocess signalled only by its own PID."""

    def __init__(self, env: dict[str, str], log_path: Path, *, grpc_port_flag: bool, ports: Sequence[int]) -> None:
        self.port, self.grpc_port = ports
        self.url = f"http://127.0.0.1:{self.port}"
        self.target = f"127.0.0.1:{self.grpc_port}"
        self.log_path = log_path
        argv = [sys.executable, "-m", "tools.cli", "gateway", "--port", str(self.port)]
        if grpc_port_flag:
            argv += ["--grpc-port", str(self.grpc_port)]
        else:  # the setting, from the environment
            env = {**env, "FRAUD_GATEWAY_GRPC_PORT": str(self.grpc_port)}
        with log_path.open("wb") as log:
            self.proc = subprocess.Popen(
                argv, cwd=REPO, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=True,
            )  # fmt: skip
        self.channel = grpc.insecure_channel(self.target)
        self.stub = fraud_pb2_grpc.FraudScoringStub(self.channel)

    def log(self, lines: int = 30) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> None:
        """Until the gRPC health service says SERVING (the gateway's Kafka clients are up)."""
        health = health_pb2_grpc.HealthStub(self.channel)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"gateway exited ({self.proc.returncode}):\n{self.log()}")
            try:
                reply = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=2)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass  # not listening yet
            time.sleep(0.2)
        raise AssertionError(f"gateway gRPC not SERVING after {timeout:.0f} s:\n{self.log()}")

    def stop(self) -> None:
        self.channel.close()
        stop_process(self.proc)


@dataclass
class Rig:
    bootstrap: str
    topics: Topics
    gateway: GrpcGateway
    idle_gateway: GrpcGateway
    """Its own topics and no worker: no transaction is ever decided."""
    api_key: str
    run: str
    factory: TxFactory
    workers: Workers

    @property
    def auth(self) -> tuple[tuple[str, str], ...]:
        return (("x-api-key", self.api_key),)

    def make_tx(self, user: str | None = None, **over: Any) -> dict[str, Any]:
        """A valid transaction of a population person, for a user of this run."""
        doc = self.factory(**over)
        doc["user_id"] = f"u-{user or doc['user_id']}-{self.run}"
        return doc


@pytest.fixture(scope="module")
def rig(
    kafka_bootstrap: str, redis_url: str, sim_frame: pd.DataFrame, trained_registry: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Rig]:  # fmt: skip
    workdir = tmp_path_factory.mktemp("grpc")
    client = redis.Redis.from_url(redis_url)
    try:
        materialize(sim_frame, client, progress=False)  # idempotent: no flush
    finally:
        client.close()
    topics, idle_topics = Topics.unique("grpc"), Topics.unique("grpcidle")
    asyncio.run(topics.create(kafka_bootstrap, PARTITIONS))
    asyncio.run(idle_topics.create(kafka_bootstrap, PARTITIONS))
    producers = write_keys(workdir / "producers.json", gateway=new_key())
    api_key, run = new_key(), uuid.uuid4().hex[:8]
    env = worker_env(
        bootstrap=kafka_bootstrap, redis_url=redis_url, topics=topics, registry=trained_registry,
        workdir=workdir, partitions=PARTITIONS, FRAUD_ALLOW_UNSIGNED="false", FRAUD_CLIENT_KEYS_FILE=str(producers),
    )  # fmt: skip
    gateway_env = {
        **env,
        # A client id of this run: its bucket (in a REDIS_URL that may outlive the run) starts full.
        "FRAUD_GATEWAY_KEYS_FILE": str(write_keys(workdir / "api.json", **{f"acme-{run}": api_key})),
        "FRAUD_GATEWAY_TIMEOUT_S": str(DECISION_TIMEOUT_S),
        "FRAUD_GATEWAY_RATE_PER_S": "10000",  # the client's bucket is not the subject: the stream's 1,000 pass
        "FRAUD_GATEWAY_BURST": "10000",
        "FRAUD_RATE_USER_BURST": str(USER_BURST),
        "FRAUD_RATE_USER_PER_S": str(USER_RATE),
    }
    workers = Workers(workdir, env)
    gateways: list[GrpcGateway] = []
    try:
        worker = workers.start()
        ports = stack.free_ports(4)  # two gateways: four different ports
        gateways.append(GrpcGateway(gateway_env, workdir / "gateway.log", grpc_port_flag=False, ports=ports[:2]))
        gateways.append(GrpcGateway({**gateway_env, **idle_topics.env()}, workdir / "gateway-idle.log",
                                    grpc_port_flag=True, ports=ports[2:]))  # fmt: skip
        for gateway in gateways:
            gateway.wait_ready()
        asyncio.run(worker.wait_for_log("Ready", READY_TIMEOUT_S))
        factory = TxFactory(sim_frame, f"t-grpc-{topics.transactions[-6:]}")
        yield Rig(kafka_bootstrap, topics, gateways[0], gateways[1], api_key, run, factory, workers)
    finally:
        for gateway in gateways:
            gateway.stop()
        workers.stop_all()


def error_info(err: grpc.RpcError) -> tuple[Any, error_details_pb2.ErrorInfo]:
    """The google.rpc.Status of a failed call and its ErrorInfo."""
    status = rpc_status.from_call(err)  # type: ignore[arg-type]
    assert status is not None, f"no status details: {err}"
    info = error_details_pb2.ErrorInfo()
    assert status.details[0].Unpack(info), status
    return status, info


def score(rig: Rig, doc: dict[str, Any], **kwargs: Any) -> fraud_pb2.Decision:
    try:
        return rig.gateway.stub.Score(transaction_message(doc), metadata=rig.auth, timeout=DECISION_TIMEOUT_S + 5,
                                      **kwargs)  # fmt: skip
    except grpc.RpcError as err:
        raise AssertionError(f"{err}\n{rig.gateway.log()}\n{rig.workers.logs()}") from None


def refused(call: Any, *args: Any, **kwargs: Any) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as caught:
        call(*args, **kwargs)
    return caught.value


async def decision_on_topic(bootstrap: str, topic: str, correlation_id: str, timeout: float) -> dict[str, Any]:
    """The decision the worker wrote for ``correlation_id`` (read from offset 0)."""
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, group_id=None, enable_auto_commit=False,
                                fetch_max_wait_ms=50, isolation_level="read_committed")  # fmt: skip
    await consumer.start()
    try:
        parts = [TopicPartition(topic, p) for p in sorted((await partitions_of(consumer, [topic]))[topic] or ())]
        consumer.assign(parts)
        await consumer.seek_to_beginning(*parts)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for records in (await consumer.getmany(timeout_ms=200)).values():
                for record in records:
                    if not record.value:
                        continue  # a worker's handover record (app/eos.py)
                    doc = orjson.loads(record.value)
                    if doc.get("correlation_id") == correlation_id:
                        return doc
        raise AssertionError(f"no decision with correlation id {correlation_id} on {topic}")
    finally:
        await consumer.stop()


# --- unary ---------------------------------------------------------------------------------


def test_grpc_score_returns_the_decision_with_every_field(rig: Rig) -> None:
    doc = rig.make_tx()
    decision = score(rig, doc)
    got = decision_dict(decision)
    assert (got["transaction_id"], got["user_id"]) == (doc["transaction_id"], doc["user_id"])
    assert got["action"] in ACTIONS and got["action"] != "reject", got
    assert got["model_version"] and got["rules_version"] and got["cached"] is False
    assert got["latency_ms"]["total"] > 0 and got["decided_at"] > 0 and got["correlation_id"]
    # Field for field what the worker wrote to `decisions` for this request (JSON null = unset).
    record = asyncio.run(decision_on_topic(rig.bootstrap, rig.topics.decisions, got["correlation_id"], 30.0))
    assert got == record

    again = decision_dict(score(rig, doc))  # the same transaction resent: the cached decision
    assert again["cached"] is True
    assert (again["action"], again["fraud_score"]) == (got["action"], got["fraud_score"])
    assert again["correlation_id"] != got["correlation_id"]

    # REST, served by the same process through the same core, answers the same transaction the same way.
    request = urllib.request.Request(f"{rig.gateway.url}/v1/transactions", data=orjson.dumps(doc), method="POST",
                                     headers={"X-API-Key": rig.api_key, "Content-Type": "application/json"})  # fmt: skip
    with urllib.request.urlopen(request, timeout=DECISION_TIMEOUT_S + 5) as response:
        rest = orjson.loads(response.read())
    assert rest["cached"] is True and (rest["action"], rest["fraud_score"]) == (got["action"], got["fraud_score"])


def test_grpc_refuses_missing_and_unknown_keys(rig: Rig) -> None:
    message = transaction_message(rig.make_tx())
    for metadata in ((), (("x-api-key", new_key()),), (("x-api-key", "not-a-key"),)):
        err = refused(rig.gateway.stub.Score, message, metadata=metadata, timeout=10)
        assert err.code() == grpc.StatusCode.UNAUTHENTICATED, err
        assert error_info(err)[1].reason == "unauthenticated"
    bearer = (("authorization", f"Bearer {rig.api_key}"),)
    assert rig.gateway.stub.Score(message, metadata=bearer, timeout=DECISION_TIMEOUT_S).transaction_id


@pytest.mark.parametrize(
    ("over", "code", "field"),
    [
        ({"drop": "user_id"}, "missing_field", "user_id"),
        ({"amount": 0.0}, "out_of_range", "amount"),
        ({"amount": float("nan")}, "out_of_range", "amount"),
        ({"currency": "XXX"}, "unknown_currency", "currency"),
        ({"timestamp": "31/01/2026"}, "bad_timestamp", "timestamp"),
        ({"timestamp": "2020-01-01T00:00:00Z"}, "timestamp_out_of_window", "timestamp"),
        ({"drop": "lon"}, "inconsistent", "lon"),
        ({"device_id": "d" * 70_000}, "too_large", None),
    ],
)
def test_grpc_rejects_an_invalid_transaction_with_its_code(rig: Rig, over: dict[str, Any], code: str,
                                                           field: str | None) -> None:  # fmt: skip
    """Every validation code a protobuf message can carry. (bad_json, not_an_object and
    wrong_type cannot happen: a message is an object of typed fields by construction.)"""
    doc = rig.make_tx()
    doc.pop(over.pop("drop", ""), None)
    doc.update(over)
    err = refused(rig.gateway.stub.Score, transaction_message(doc), metadata=rig.auth, timeout=10)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err
    status, info = error_info(err)
    assert (info.reason, info.metadata.get("field")) == (code, field), info
    assert info.metadata["transaction_id"] == doc["transaction_id"] and status.message


def test_grpc_rate_limits_a_user_burst_with_retry_info(rig: Rig) -> None:
    user = f"burst-{uuid.uuid4().hex[:6]}"
    for _ in range(USER_BURST):
        score(rig, rig.make_tx(user))
    err = refused(rig.gateway.stub.Score, transaction_message(rig.make_tx(user)), metadata=rig.auth, timeout=10)
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err
    status, info = error_info(err)
    assert (info.reason, info.metadata["field"]) == ("rate_limited", "user_id")
    retry = error_details_pb2.RetryInfo()
    assert status.details[1].Unpack(retry)
    assert 1.0 <= retry.retry_delay.ToTimedelta().total_seconds() <= 1 / USER_RATE
    score(rig, rig.make_tx())  # another user of the same API client is not held back


def test_grpc_honours_a_short_deadline(rig: Rig) -> None:
    """No worker reads the idle gateway's topics: the call ends at the caller's 2 s
    deadline (not the gateway's 30 s), with the gateway's own DEADLINE_EXCEEDED."""
    started = time.monotonic()
    err = refused(rig.idle_gateway.stub.Score, transaction_message(rig.make_tx()), metadata=rig.auth, timeout=2.0)
    waited = time.monotonic() - started
    assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED, err
    assert 1.5 <= waited < 5.0, waited
    status, info = error_info(err)
    assert info.reason == "decision_timeout" and info.metadata["correlation_id"]
    assert "resend" in status.message


# --- streaming -----------------------------------------------------------------------------


def test_grpc_stream_of_1000_transactions_gets_1000_matched_decisions(rig: Rig) -> None:
    docs = [rig.make_tx(f"s{i % STREAM_USERS}") for i in range(STREAM_N)]
    sent = {d["transaction_id"]: d for d in docs}
    started = time.monotonic()
    replies = list(rig.gateway.stub.ScoreStream((transaction_message(d) for d in docs), metadata=rig.auth,
                                                timeout=240))  # fmt: skip
    elapsed = time.monotonic() - started
    errors = [(r.transaction_id, r.error) for r in replies if r.WhichOneof("result") != "decision"]
    assert not errors, f"{len(errors)} without a decision, e.g. {errors[:3]}\n{rig.gateway.log()}"
    assert len(replies) == STREAM_N, len(replies)
    assert {r.transaction_id for r in replies} == set(sent)  # each once: 1,000 distinct ids
    for r in replies:
        assert r.decision.transaction_id == r.transaction_id
        assert r.decision.user_id == sent[r.transaction_id]["user_id"]
        assert docs[r.sequence]["transaction_id"] == r.transaction_id
        assert r.decision.action != fraud_pb2.ACTION_REJECT and not r.decision.cached
    print(f"stream: {STREAM_N} decisions in {elapsed:.1f} s ({STREAM_N / elapsed:.0f}/s)")


# --- health and reflection -----------------------------------------------------------------


def test_grpc_health_and_reflection_answer(rig: Rig) -> None:
    health = health_pb2_grpc.HealthStub(rig.gateway.channel)
    for service in ("", "fraud.v1.FraudScoring"):
        reply = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING, service
    err = refused(health.Check, health_pb2.HealthCheckRequest(service="no.such.Service"), timeout=5)
    assert err.code() == grpc.StatusCode.NOT_FOUND

    database = ProtoReflectionDescriptorDatabase(rig.gateway.channel)
    services = set(database.get_services())
    assert {"fraud.v1.FraudScoring", "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"} <= services
    pool = descriptor_pool.DescriptorPool(database)
    service = pool.FindServiceByName("fraud.v1.FraudScoring")
    methods = {m.name: (m.input_type.full_name, m.output_type.full_name) for m in service.methods}
    assert methods == {"Score": ("fraud.v1.Transaction", "fraud.v1.Decision"),
                       "ScoreStream": ("fraud.v1.Transaction", "fraud.v1.ScoreReply")}  # fmt: skip
    # What a client without the .proto learns is the contract itself, field for field.
    served = pool.FindMessageTypeByName("fraud.v1.Decision")
    assert [f.name for f in served.fields] == [f.name for f in fraud_pb2.Decision.DESCRIPTOR.fields]
