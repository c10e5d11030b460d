"""The whole pipeline against the real broker and Redis: a worker subprocess
(`fraud-pipeline worker`) scoring transactions produced with aiokafka.

One worker serves the module; the Redis-outage test runs its own worker against
its own redis-server, which it stops and starts again on the same port. Topics
and the consumer group are unique to each worker, so everything on them is ours
and the output topics can be read from offset 0.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import random
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import pandas as pd
import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from workers import Topics, TxFactory  # tests/integration is on sys.path, as test_faults imports it

from tests.factories import materialize_into, partition_of, rules_doc
from tools import stack

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

REPO = Path(__file__).resolve().parents[2]
BLOCKED_DEVICE = "d-blocked-integration"
PARTITIONS = 4
DLQ_PARTITIONS = max(1, PARTITIONS // 2)  # as app.topics.topic_partitions
READY_TIMEOUT_S = 60.0
FIRST_DECISION_TIMEOUT_S = 45.0
DECISION_FIELDS = {
    "transaction_id", "user_id", "fraud_score", "action", "explanation", "model_version",
    "rules_version", "cached", "degraded", "feature_age_s", "latency_ms", "correlation_id",
    "decided_at", "error",
}  # fmt: skip
LATENCY_KEYS = {"queue_wait", "validate", "cache", "features", "model", "rules", "total"}


# --- transactions ------------------------------------------------------------------


@dataclass
class Msg:
    """One message to produce; ``correlation`` is unique and names its outcome."""

    key: bytes
    value: bytes
    correlation: str


def msg(doc: dict[str, Any] | bytes, correlation: str, key: bytes | None = None) -> Msg:
    if isinstance(doc, bytes):
        return Msg(key or b"unreadable", doc, correlation)
    user = doc.get("user_id")
    return Msg(key or (user.encode() if isinstance(user, str) else b"no-user"), orjson.dumps(doc), correlation)


# --- the broker side -----------------------------------------------------------------


@dataclass
class Outcomes:
    decisions: list[dict[str, Any]] = field(default_factory=list)
    dead_letters: list[dict[str, Any]] = field(default_factory=list)
    arrived: dict[str, float] = field(default_factory=dict)
    """Correlation id -> time.time() the first outcome for it was read."""

    def decisions_for(self, correlation: str) -> list[dict[str, Any]]:
        return [d for d in self.decisions if d.get("correlation_id") == correlation]

    def dead_letters_for(self, correlation: str) -> list[dict[str, Any]]:
        return [d for d in self.dead_letters if d["_correlation"] == correlation]

    def correlations(self) -> set[str]:
        return {d.get("correlation_id") for d in self.decisions} | {d["_correlation"] for d in self.dead_letters}


async def produce(bootstrap: str, topic: str, messages: list[Msg]) -> None:
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, linger_ms=5)
    await producer.start()
    try:
        pending = [
            await producer.send(topic, m.value, key=m.key, headers=[("correlation-id", m.correlation.encode())])
            for m in messages
        ]
        await asyncio.gather(*pending)
    finally:
        await producer.stop()


async def read_outcomes(
    bootstrap: str,
    topics: Topics,
    done: Callable[[Outcomes], bool],
    *,
    timeout: float,
    settle: float = 1.0,
) -> Outcomes:
    """Read ``decisions`` and the DLQ from offset 0 until ``done`` holds, then ``settle``
    seconds more (so duplicates would show). Raises on timeout with what was read."""
    consumer = AIOKafkaConsumer(
        bootstrap_servers=bootstrap,
        enable_auto_commit=False,
        auto_offset_reset="earliest",
        fetch_max_wait_ms=20,
        isolation_level="read_committed",
    )
    await consumer.start()
    out = Outcomes()
    try:
        parts = [TopicPartition(topics.decisions, p) for p in range(PARTITIONS)]
        parts += [TopicPartition(topics.dlq, p) for p in range(DLQ_PARTITIONS)]
        consumer.assign(parts)
        await consumer.seek_to_beginning(*parts)
        deadline = time.monotonic() + timeout
        settled_at: float | None = None
        while True:
            now = time.monotonic()
            if settled_at is None and done(out):
                settled_at = now + settle
            if settled_at is not None and now >= settled_at:
                return out
            if now >= deadline:
                raise AssertionError(
                    f"timed out after {timeout:.0f} s: read {len(out.decisions)} decisions "
                    f"and {len(out.dead_letters)} dead letters"
                )
            batches = await consumer.getmany(timeout_ms=100)
            seen_at = time.time()
            for tp, records in batches.items():
                for record in records:
                    if not record.value:
                        continue  # a worker's handover record on decisions (app/eos.py)
                    doc = orjson.loads(record.value)
                    if tp.topic == topics.decisions:
                        out.decisions.append(doc)
                        out.arrived.setdefault(doc.get("correlation_id"), seen_at)
                    else:
                        header = doc.get("headers", {}).get("correlation-id")
                        doc["_correlation"] = base64.b64decode(header).decode() if header else None
                        doc["_key"] = record.key
                        out.dead_letters.append(doc)
                        out.arrived.setdefault(doc["_correlation"], seen_at)
    finally:
        await consumer.stop()


def have_all(correlations: set[str]) -> Callable[[Outcomes], bool]:
    return lambda out: correlations <= out.correlations()


# --- the worker -------------------------------------------------------------------------


class Worker:
    """`fraud-pipeline worker` as a subprocess, stopped by its PID."""

    def __init__(self, env: dict[str, str], log_path: Path) -> None:
        self.log_path = log_path
        self.port = stack.free_port()
        with log_path.open("wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "tools.cli", "worker", "--web-port", str(self.port), "--loglevel", "info"],
                cwd=REPO,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log(self, lines: int = 40) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def wait_for_log(self, needle: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while needle not in self.log_path.read_text(errors="replace"):
            if not self.alive():
                raise AssertionError(f"worker exited ({self.proc.returncode}) before {needle!r}:\n{self.log()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"worker not {needle!r} after {timeout:.0f} s:\n{self.log()}")
            time.sleep(0.1)

    def stop(self) -> None:
        if not self.alive():
            return
        os.kill(self.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.kill(self.pid, signal.SIGKILL)
            self.proc.wait(timeout=5)


@dataclass
class Pipeline:
    bootstrap: str
    topics: Topics
    worker: Worker
    make_tx: TxFactory
    redis_url: str

    def run(self, messages: list[Msg], *, timeout: float = 30.0, settle: float = 1.0,
            done: Callable[[Outcomes], bool] | None = None) -> Outcomes:  # fmt: skip
        """Produce ``messages`` and read outcomes until every one has one (or ``done``)."""
        wanted = {m.correlation for m in messages}

        async def go() -> Outcomes:
            await produce(self.bootstrap, self.topics.transactions, messages)
            return await read_outcomes(
                self.bootstrap, self.topics, done or have_all(wanted), timeout=timeout, settle=settle
            )

        return asyncio.run(go())


RULES = rules_doc("rules-integration-1", blocked_device=BLOCKED_DEVICE)


def _rules_file(path: Path) -> Path:
    path.write_text(json.dumps(RULES))
    return path


def _worker_env(bootstrap: str, redis_url: str, topics: Topics, registry: Path, workdir: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FRAUD_")}
    env.update(
        KAFKA_BOOTSTRAP=bootstrap,
        REDIS_URL=redis_url,
        FRAUD_APP_ID=f"it-worker-{uuid.uuid4().hex[:10]}",
        FRAUD_REGISTRY_DIR=str(registry),
        FRAUD_RULES_PATH=str(_rules_file(workdir / "rules.json")),
        FRAUD_DATA_DIR=str(workdir / "faust"),
        FRAUD_PARTITIONS=str(PARTITIONS),
        # These tests are about scoring; producer authentication has its own tests.
        FRAUD_ALLOW_UNSIGNED="true",
        # NOTE: the worker, the broker, Redis and this test share 2 cores: under
        # that contention the 50 ms model budget is missed now and then (measured:
        # 4-7 % of decisions in a 1,000-message burst) and a decision that should
        # be full comes back degraded. The budget is the unit tests' subject
        # (tests/unit/pipeline/test_scorer.py); here it is generous so these are exact.
        FRAUD_MODEL_BUDGET_MS="2000",
        PYTHONUNBUFFERED="1",
        **topics.env(),
    )
    return env


def start_pipeline(
    bootstrap: str, redis_url: str, frame: pd.DataFrame, registry: Path, workdir: Path
) -> Pipeline:
    """Start a worker and return once a probe transaction got its decision."""
    workdir.mkdir(parents=True, exist_ok=True)
    topics = Topics.unique("it")
    worker = Worker(_worker_env(bootstrap, redis_url, topics, registry, workdir), workdir / "worker.log")
    pipeline = Pipeline(bootstrap, topics, worker, TxFactory(frame, f"t-{topics.transactions[-10:]}"), redis_url)
    try:
        worker.wait_for_log("Ready", READY_TIMEOUT_S)
        # The consumer group join takes a few seconds more: wait for a real decision.
        probe = msg(pipeline.make_tx(), "probe")
        pipeline.run([probe], timeout=FIRST_DECISION_TIMEOUT_S, settle=0.0)
    except BaseException:
        worker.stop()
        raise
    return pipeline


@pytest.fixture(scope="module")
def pipeline(
    kafka_bootstrap: str,
    redis_url: str,
    sim_frame: pd.DataFrame,
    trained_registry: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Pipeline]:
    materialize_into(sim_frame, redis_url, flush=True)
    running = start_pipeline(
        kafka_bootstrap, redis_url, sim_frame, trained_registry, tmp_path_factory.mktemp("pipeline")
    )
    try:
        yield running
    finally:
        running.worker.stop()


def check_full_decision(d: dict[str, Any], *, expect_degraded: bool = False) -> None:
    assert set(d) >= DECISION_FIELDS, sorted(DECISION_FIELDS - set(d))
    assert isinstance(d["transaction_id"], str) and d["transaction_id"]
    assert isinstance(d["user_id"], str) and d["user_id"]
    assert isinstance(d["fraud_score"], float) and 0.0 <= d["fraud_score"] <= 1.0
    assert d["action"] in ("approve", "review", "decline"), d["error"] or d
    assert isinstance(d["explanation"], list) and all(isinstance(w, str) and w for w in d["explanation"])
    assert d["rules_version"] == RULES["version"]
    assert d["cached"] is False
    assert d["degraded"] is expect_degraded
    if not expect_degraded:
        assert isinstance(d["model_version"], str) and d["model_version"]
        assert isinstance(d["feature_age_s"], float) and 0 <= d["feature_age_s"] < 2 * 86400
    assert set(d["latency_ms"]) == LATENCY_KEYS
    assert all(isinstance(v, (int, float)) and v >= 0 for v in d["latency_ms"].values())
    # Seconds, not milliseconds: the record timestamp is converted right.
    assert d["latency_ms"]["queue_wait"] < 30_000
    assert d["error"] is None


# --- the acceptance criteria -------------------------------------------------------------


def test_a_valid_transaction_gets_exactly_one_full_decision(pipeline: Pipeline) -> None:
    doc = pipeline.make_tx()
    out = pipeline.run([msg(doc, "corr-valid-1")], settle=1.5)

    [d] = out.decisions_for("corr-valid-1")
    check_full_decision(d)
    assert d["transaction_id"] == doc["transaction_id"]
    assert d["user_id"] == doc["user_id"]
    assert [x for x in out.decisions if x["transaction_id"] == doc["transaction_id"]] == [d]
    assert out.dead_letters_for("corr-valid-1") == []
    assert pipeline.worker.alive()


def test_a_thousand_mixed_transactions_get_exactly_one_outcome_each(pipeline: Pipeline) -> None:
    rng = random.Random(20261202)
    make = pipeline.make_tx
    valid = [make() for _ in range(760)]
    invalid_changes: list[dict[str, Any]] = [
        {"amount": -3}, {"amount": "12.00"}, {"currency": "XYZ"}, {"merchant_id": None},
        {"timestamp": "not a time"}, {"timestamp": "2020-01-01T00:00:00Z"},
        {"timestamp": "2026-01-01T00:00:00"}, {"lat": 95.0}, {"lon": None}, {"device_id": 17},
    ]  # fmt: skip
    invalid = []
    for i in range(100):
        doc = make(**invalid_changes[i % len(invalid_changes)])
        invalid.append({k: v for k, v in doc.items() if v is not None})
    unreadable: list[bytes] = []
    for i in range(40):
        unreadable.append(
            [
                b'{"transaction_id": "half',
                b"[1, 2, 3]",
                b"\xff\xfe\x00",
                orjson.dumps({k: v for k, v in make().items() if k != "transaction_id"}),
                orjson.dumps(make(transaction_id="x" * 200)),
                orjson.dumps(make(transaction_id=12345)),
                b"",
                b'{"transaction_id": NaN}',
            ][i % 8]
        )
    # Resends: same id and content as an earlier valid one, placed after it.
    resent = rng.sample(range(len(valid)), 100)

    entries: list[tuple[str, Msg, dict[str, Any] | None]] = []
    for i, doc in enumerate(valid):
        entries.append(("valid", msg(doc, f"m-valid-{i}"), doc))
    for i, doc in enumerate(invalid):
        entries.insert(rng.randrange(len(entries) + 1), ("invalid", msg(doc, f"m-invalid-{i}"), doc))
    for i, raw in enumerate(unreadable):
        entries.insert(rng.randrange(len(entries) + 1), ("unreadable", msg(raw, f"m-unreadable-{i}"), None))
    for j, i in enumerate(resent):
        doc = valid[i]
        at = next(n for n, e in enumerate(entries) if e[1].correlation == f"m-valid-{i}")
        entries.insert(rng.randrange(at + 1, len(entries) + 1), ("resend", msg(doc, f"m-resend-{j}"), doc))
    assert len(entries) == 1000
    started = time.monotonic()
    out = pipeline.run([e[1] for e in entries], timeout=60.0, settle=2.0)
    elapsed = time.monotonic() - started

    problems = []
    for kind, m, _doc in entries:
        ds, dl = out.decisions_for(m.correlation), out.dead_letters_for(m.correlation)
        if kind in ("valid", "resend"):
            if len(ds) != 1 or dl:
                problems.append(f"{kind} {m.correlation}: {len(ds)} decisions, {len(dl)} dead letters")
            elif ds[0]["action"] == "reject":
                problems.append(f"{kind} {m.correlation}: rejected: {ds[0]['error']}")
        elif kind == "invalid":
            if len(ds) != 1 or len(dl) != 1 or ds[0]["action"] != "reject":
                problems.append(f"invalid {m.correlation}: {[d['action'] for d in ds]}, {len(dl)} dead letters")
        elif ds or len(dl) != 1:
            problems.append(f"unreadable {m.correlation}: {len(ds)} decisions, {len(dl)} dead letters")
    assert not problems, f"{len(problems)} messages without exactly one outcome:\n" + "\n".join(problems[:20])

    # Resends get the decision the original got, marked cached; originals are not cached.
    differ = []
    for j, i in enumerate(resent):
        [first] = out.decisions_for(f"m-valid-{i}")
        [again] = out.decisions_for(f"m-resend-{j}")
        assert first["cached"] is False
        assert again["transaction_id"] == first["transaction_id"]
        if not (
            again["cached"] is True
            and (again["action"], again["fraud_score"], again["decided_at"])
            == (first["action"], first["fraud_score"], first["decided_at"])
        ):
            differ.append(
                f"{first['transaction_id']}: first {first['action']} {first['fraud_score']}, "
                f"resend {again['action']} {again['fraud_score']} cached={again['cached']}"
            )
    assert not differ, f"{len(differ)} of {len(resent)} resends not answered as before:\n" + "\n".join(differ)
    # Nothing else was cached or degraded, and every valid decision is complete.
    originals = [out.decisions_for(f"m-valid-{i}")[0] for i in set(range(len(valid))) - set(resent)]
    degraded = Counter(w for d in originals if d["degraded"] for w in d["explanation"] if w.startswith("degraded"))
    assert not degraded, f"degraded under a burst: {dict(degraded)}"
    for d in originals:
        check_full_decision(d)
    # Unreadable messages keep their bytes in the dead-letter record.
    for i, raw in enumerate(unreadable):
        [dl] = out.dead_letters_for(f"m-unreadable-{i}")
        assert base64.b64decode(dl["value_b64"]) == raw
        assert dl["error"]["code"] in ("bad_json", "not_an_object", "missing_field", "wrong_type", "out_of_range")
    assert elapsed < 45, f"1,000 transactions took {elapsed:.1f} s"
    assert pipeline.worker.alive()


def test_large_amount_is_reviewed_and_blocked_device_declined(pipeline: Pipeline) -> None:
    large = [pipeline.make_tx(amount=15000.0, currency="USD") for _ in range(3)]
    blocked = pipeline.make_tx(device_id=BLOCKED_DEVICE)
    out = pipeline.run([msg(doc, f"corr-large-{i}") for i, doc in enumerate(large)] + [msg(blocked, "corr-blocked")])

    for i in range(len(large)):
        [d] = out.decisions_for(f"corr-large-{i}")
        check_full_decision(d)
        # At least review; a decline-level score still declines, as the rules say,
        # and then the score's reason comes first and the rule reads as the floor.
        if d["fraud_score"] >= RULES["thresholds"]["decline"]:
            assert d["action"] == "decline", d
            assert d["explanation"][1] == "amount 15,000.00 USD over 10,000: at least review", d
        else:
            assert d["action"] == "review", d
            assert d["explanation"][0] == "amount 15,000.00 USD over 10,000: forced review", d
    [d] = out.decisions_for("corr-blocked")
    check_full_decision(d)
    assert d["action"] == "decline"
    assert d["explanation"][0] == f"blocked device {BLOCKED_DEVICE}"


def test_a_poison_message_in_a_batch_does_not_cost_the_rest(pipeline: Pipeline) -> None:
    # 32 users whose keys land on one partition: the messages arrive together and
    # share a batch. (Not one user: 31 payments at once would exceed the per-user
    # rate limit, burst 30, and be refused for that, which is not this test.)
    users = sorted({p["user_id"] for p in pipeline.make_tx.people})
    same = [u for u in users if partition_of(u.encode(), PARTITIONS) == 0][:32]
    assert len(same) == 32
    docs = [pipeline.make_tx(user_id=u) for u in same[:31]]
    poison = pipeline.make_tx(user_id=same[31], amount={"$gt": 0})
    messages = [msg(doc, f"corr-batch-{i}") for i, doc in enumerate(docs)]
    messages.insert(17, msg(poison, "corr-poison"))
    out = pipeline.run(messages)

    for i, doc in enumerate(docs):
        [d] = out.decisions_for(f"corr-batch-{i}")
        check_full_decision(d)
        assert d["transaction_id"] == doc["transaction_id"]
    [rejected] = out.decisions_for("corr-poison")
    assert rejected["action"] == "reject" and rejected["transaction_id"] == poison["transaction_id"]
    assert rejected["error"]["code"] == "wrong_type" and rejected["error"]["field"] == "amount"
    [dl] = out.dead_letters_for("corr-poison")
    assert dl["_key"] == poison["transaction_id"].encode()
    assert orjson.loads(base64.b64decode(dl["value_b64"])) == poison
    assert pipeline.worker.alive()


def test_redis_outage_degrades_and_recovers(
    kafka_bootstrap: str,
    sim_frame: pd.DataFrame,
    trained_registry: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    workdir = tmp_path_factory.mktemp("outage")
    port = stack.free_port()
    handles = [stack.start_redis(port=port, workdir=workdir / "redis-1")]
    url = handles[0].url
    pipeline: Pipeline | None = None
    try:
        materialize_into(sim_frame, url)
        pipeline = start_pipeline(kafka_bootstrap, url, sim_frame, trained_registry, workdir / "worker")

        # Before: full decisions.
        before = [pipeline.make_tx() for _ in range(5)]
        out = pipeline.run([msg(doc, f"before-{i}") for i, doc in enumerate(before)], settle=0.0)
        for i in range(len(before)):
            [d] = out.decisions_for(f"before-{i}")
            check_full_decision(d)

        # Redis goes away: decisions keep coming, degraded, decided by rules.
        handles[0].stop()
        during: list[Msg] = []
        for wave in range(4):
            docs = [pipeline.make_tx() for _ in range(4)]
            docs.append(pipeline.make_tx(amount=15000.0, currency="USD"))
            wave_msgs = [msg(doc, f"during-{wave}-{i}") for i, doc in enumerate(docs)]
            sent = time.time()
            out = pipeline.run(wave_msgs, timeout=30.0, settle=0.0)
            during += wave_msgs
            for m in wave_msgs:
                [d] = out.decisions_for(m.correlation)
                check_full_decision(d, expect_degraded=True)
                assert d["model_version"] is None
                assert any(w.startswith("degraded:") for w in d["explanation"])
                assert out.arrived[m.correlation] - sent < 5.0, (
                    f"a degraded decision took {out.arrived[m.correlation] - sent:.1f} s"
                )
            [large] = out.decisions_for(wave_msgs[-1].correlation)
            assert large["action"] == "review"
        assert pipeline.worker.alive(), pipeline.worker.log()

        # Redis is back (empty) on the same port; features are materialized again.
        handles.append(stack.start_redis(port=port, workdir=workdir / "redis-2"))
        materialize_into(sim_frame, url)
        deadline = time.monotonic() + 30.0
        recovered = None
        wave = 0
        why: set[str] = set()
        while recovered is None:
            if time.monotonic() > deadline:
                failures = [line for line in pipeline.worker.log(400).splitlines() if "feature store failed" in line]
                raise AssertionError(
                    f"no full decision within 30 s of Redis coming back; decisions said {sorted(why)}; "
                    f"the worker's last word: {failures[-1:] or pipeline.worker.log(10)}"
                )
            wave += 1
            docs = [pipeline.make_tx() for _ in range(3)]
            wave_msgs = [msg(doc, f"after-{wave}-{i}") for i, doc in enumerate(docs)]
            out = pipeline.run(wave_msgs, timeout=30.0, settle=0.0)
            got = [d for m in wave_msgs for d in out.decisions_for(m.correlation)]
            why |= {w for d in got for w in d["explanation"] if w.startswith("degraded")}
            full = [d for d in got if not d["degraded"]]
            if full:
                recovered = full[0]
            else:
                time.sleep(0.5)
        check_full_decision(recovered)
        # Every message of every phase had exactly one decision.
        everything = pipeline.run([], settle=1.0, done=lambda _: True)
        for m in during:
            assert len(everything.decisions_for(m.correlation)) == 1, m.correlation
        assert pipeline.worker.alive(), pipeline.worker.log()
    finally:
        if pipeline is not None:
            pipeline.worker.stop()
        for handle in handles:
            handle.stop()

