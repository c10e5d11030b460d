"""Helpers for tests that drive real `fraud-pipeline worker` processes.

Used by ``test_faults.py``: worker subprocesses started and stopped by PID,
paced producers of signed or unsigned messages, and a background collector
that reads ``decisions`` and the dead-letter topic from offset 0 and indexes
them by transaction id and by correlation id, so a test can count outcomes
per message (decided, dead-lettered, duplicated, lost).

Everything here is bounded in time: every wait has a deadline and raises an
``AssertionError`` that says what it saw.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson
import pandas as pd
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

from app.settings import Settings
from app.topics import ensure_topics, topic_partitions
from pipeline.resend_index import CONTENT_HASH
from tests.factories import decision_key_env, iso, rules_doc
from tools import stack

REPO = Path(__file__).resolve().parents[2]

#: Rules for the worker under test: the defaults, with a blocked device.
RULES = rules_doc("rules-faults-1", blocked_device="d-blocked-faults")

__all__ = ["RULES", "iso"]  # re-exported: the tests import them from here

# --- transactions --------------------------------------------------------------------


class TxFactory:
    """Valid transactions for the simulated population, each with distinct content
    (id, amount and millisecond timestamp), so the decision cache never matches
    two of them by accident."""

    def __init__(self, frame: pd.DataFrame, prefix: str) -> None:
        last = frame.sort_values("timestamp").drop_duplicates("user_id", keep="last")
        self.people = [
            {
                "user_id": r.user_id,
                "merchant_id": r.merchant_id,
                "merchant_category": r.merchant_category,
                "device_id": r.device_id,
                "lat": float(r.lat),
                "lon": float(r.lon),
                "country": r.country,
                "currency": r.currency,
            }
            for r in last.itertuples()
        ]
        self.prefix = prefix
        self.seq = 0

    def __call__(self, **over: Any) -> dict[str, Any]:
        self.seq += 1
        person = self.people[self.seq % len(self.people)]
        doc: dict[str, Any] = {
            "transaction_id": f"{self.prefix}-{self.seq:06d}",
            **person,
            "amount": round(5 + (self.seq * 7.31) % 180, 2),
            "timestamp": iso(time.time() - 0.5 - (self.seq % 1000) * 0.001),
        }
        doc.update(over)
        return doc


@dataclass
class Msg:
    """One message to produce. ``correlation`` is unique per message and names its outcome."""

    key: bytes | None
    value: bytes
    correlation: str
    headers: list[tuple[str, bytes]] = field(default_factory=list)
    transaction_id: str | None = None
    sent_at: float = 0.0
    """time.time() when it was enqueued (set by :func:`send_paced`)."""
    partition: int | None = None
    offset: int | None = None
    """Where the broker put it (set by :func:`send_paced` once delivered)."""

    def all_headers(self) -> list[tuple[str, bytes]]:
        return [("correlation-id", self.correlation.encode()), *self.headers]


def tx_msg(doc: dict[str, Any], correlation: str | None = None, headers: Sequence[tuple[str, bytes]] = ()) -> Msg:
    txid = doc.get("transaction_id")
    user = doc.get("user_id")
    return Msg(
        key=user.encode() if isinstance(user, str) else None,
        value=orjson.dumps(doc),
        correlation=correlation or f"c-{txid}",
        headers=list(headers),
        transaction_id=txid if isinstance(txid, str) else None,
    )


# --- topics ------------------------------------------------------------------------------


@dataclass
class Topics:
    transactions: str
    decisions: str
    dlq: str
    feedback: str
    monitoring: str
    labels: str

    @classmethod
    def unique(cls, tag: str = "ft") -> Topics:
        suffix = uuid.uuid4().hex[:10]
        return cls(*(f"{tag}-{name}-{suffix}" for name in ("tx", "dec", "dlq", "fb", "mon", "lab")))

    def env(self) -> dict[str, str]:
        return {
            "FRAUD_TOPIC_TRANSACTIONS": self.transactions,
            "FRAUD_TOPIC_DECISIONS": self.decisions,
            "FRAUD_TOPIC_DLQ": self.dlq,
            "FRAUD_TOPIC_FEEDBACK": self.feedback,
            "FRAUD_TOPIC_MONITORING": self.monitoring,
            "FRAUD_TOPIC_LABELS": self.labels,
        }

    def settings(self, bootstrap: str, partitions: int) -> Settings:
        return Settings(
            kafka_bootstrap=bootstrap,
            partitions=partitions,
            topic_transactions=self.transactions,
            topic_decisions=self.decisions,
            topic_dlq=self.dlq,
            topic_feedback=self.feedback,
            topic_monitoring=self.monitoring,
            topic_labels=self.labels,
        )

    async def create(self, bootstrap: str, partitions: int) -> dict[str, int]:
        """Create the topics up front, with their partition counts (nothing is auto-created)."""
        return await ensure_topics(self.settings(bootstrap, partitions), wait_s=20.0)

    def partition_counts(self, partitions: int) -> dict[str, int]:
        return topic_partitions(self.settings("unused:0", partitions))


# --- workers -------------------------------------------------------------------------------


def worker_env(
    *,
    bootstrap: str,
    redis_url: str,
    topics: Topics,
    registry: Path,
    workdir: Path,
    app_id: str | None = None,
    partitions: int = 8,
    **extra: str,
) -> dict[str, str]:
    """The environment of a worker under test: nothing ``FRAUD_*`` leaks in from the caller."""
    workdir.mkdir(parents=True, exist_ok=True)
    rules = workdir / "rules.json"
    rules.write_text(json.dumps(RULES))
    env = {k: v for k, v in os.environ.items() if not k.startswith("FRAUD_")}
    env.update(
        KAFKA_BOOTSTRAP=bootstrap,
        REDIS_URL=redis_url,
        FRAUD_APP_ID=app_id or f"ft-worker-{uuid.uuid4().hex[:10]}",
        FRAUD_REGISTRY_DIR=str(registry),
        FRAUD_RULES_PATH=str(rules),
        FRAUD_PARTITIONS=str(partitions),
        FRAUD_ALLOW_UNSIGNED="true",
        # NOTE: worker, broker, Redis, load and collector share 2 cores: the 50 ms
        # model budget and Redis timeout are missed now and then, which degrades
        # a batch. Functional tests assert full decisions, so they get generous
        # ones; the fault tests drop these (test_faults.py, _defaults_only).
        FRAUD_MODEL_BUDGET_MS="2000",
        FRAUD_REDIS_TIMEOUT_S="0.5",
        # Rate limits are not the subject: a 300-user population at 150+ TPS would
        # otherwise see rate_limited rejects that are not cached.
        FRAUD_RATE_USER_PER_S="1000",
        FRAUD_RATE_USER_BURST="1000",
        PYTHONUNBUFFERED="1",
        **decision_key_env(),  # workers sign decisions; gateways and collectors verify them
        **topics.env(),
    )
    env.update(extra)
    return env


class WorkerProc:
    """`fraud-pipeline worker` as a subprocess, signalled only by its own PID."""

    def __init__(self, env: dict[str, str], log_path: Path, *, broker_wait: float | None = None) -> None:
        self.log_path = log_path
        self.env = env
        self.broker_wait = broker_wait
        self.relaunched = False
        self._launch()
        self.terminated = False

    def _launch(self) -> None:
        self.port = stack.free_port()
        argv = [sys.executable, "-m", "tools.cli", "worker", "--web-port", str(self.port), "--loglevel", "info"]
        if self.broker_wait is not None:
            argv += ["--broker-wait", str(self.broker_wait)]
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(
                argv,
                cwd=REPO,
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.started = time.monotonic()

    def _port_taken(self) -> bool:
        """Whether the worker exited because its web port was taken. NOTE: the
        port is free when drawn, but the worker binds it seconds later, and a
        test running in parallel can draw and bind it meanwhile (seen once in
        CI: a worker of the zombie test). Such a worker is started again, once,
        on another port (:meth:`wait_for_log`)."""
        return not self.alive() and not self.relaunched and "address already in use" in self.text()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def log(self, lines: int = 40) -> str:
        return "\n".join(self.text().splitlines()[-lines:])

    async def wait_for_log(self, needle: str, timeout: float) -> float:
        """Seconds until ``needle`` appeared in the log."""
        start = time.monotonic()
        while needle not in self.text():
            if self._port_taken():
                self.relaunched = True
                self._launch()
                continue
            if not self.alive():
                raise AssertionError(
                    f"worker {self.pid} exited ({self.proc.returncode}) before {needle!r}:\n{self.log()}"
                )
            if time.monotonic() - start > timeout:
                raise AssertionError(f"worker {self.pid} not {needle!r} after {timeout:.0f} s:\n{self.log()}")
            await asyncio.sleep(0.1)
        return time.monotonic() - start

    def kill9(self) -> None:
        """SIGKILL by PID: no shutdown, no commit, no flush."""
        if self.alive():
            os.kill(self.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)

    def terminate(self) -> None:
        """SIGTERM by PID (a graceful stop), once; does not wait."""
        if self.alive() and not self.terminated:
            os.kill(self.pid, signal.SIGTERM)
            self.terminated = True

    def stop(self, timeout: float = 15.0) -> None:
        """SIGTERM (unless sent already), wait up to ``timeout`` s, then SIGKILL.
        A no-op if it has exited."""
        if not self.alive():
            return
        self.terminate()
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            if self.alive():
                os.kill(self.pid, signal.SIGKILL)
            self.proc.wait(timeout=10)

    async def stop_async(self, timeout: float = 15.0) -> None:
        await asyncio.to_thread(self.stop, timeout)


class Workers:
    """Every worker a test starts; :meth:`stop_all` (in a ``finally``) stops each by PID."""

    def __init__(self, workdir: Path, base_env: dict[str, str]) -> None:
        self.workdir = workdir
        self.base_env = base_env
        self.started: list[WorkerProc] = []

    def start(self, *, broker_wait: float | None = None, **env: str) -> WorkerProc:
        n = len(self.started) + 1
        merged = {**self.base_env, "FRAUD_DATA_DIR": str(self.workdir / f"faust-{n}"), **env}
        worker = WorkerProc(merged, self.workdir / f"worker-{n}.log", broker_wait=broker_wait)
        self.started.append(worker)
        return worker

    def stop_all(self) -> None:
        """SIGTERM every live worker at once, then wait for each (SIGKILL after 15 s)."""
        for worker in self.started:
            worker.terminate()
        for worker in self.started:
            try:
                worker.stop()
            except Exception:  # keep stopping the others
                if worker.alive():
                    os.kill(worker.pid, signal.SIGKILL)

    def none_alive(self) -> bool:
        return not any(w.alive() for w in self.started)

    def logs(self, lines: int = 30) -> str:
        return "\n".join(f"--- worker {w.pid} ({w.log_path.name}) ---\n{w.log(lines)}" for w in self.started)


# --- producing -----------------------------------------------------------------------------------


def make_producer(bootstrap: str, **options: Any) -> AIOKafkaProducer:
    return AIOKafkaProducer(bootstrap_servers=bootstrap, linger_ms=5, **options)


async def produce_one(bootstrap: str, opts: dict[str, Any], topic: str, value: bytes) -> None:
    """One record, acknowledged, by a client with ``opts`` (credentials, TLS); raises what the broker refused."""
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, request_timeout_ms=10_000, **opts)
    await producer.start()
    try:
        async with asyncio.timeout(20):
            await producer.send_and_wait(topic, value, key=b"k")
    finally:
        await producer.stop()


async def commit_offset(bootstrap: str, opts: dict[str, Any], group: str, topic: str, offset: int) -> None:
    """Commit ``offset`` for partition 0 of ``topic`` in ``group``, as the client ``opts`` names."""
    from aiokafka.structs import OffsetAndMetadata

    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, group_id=group, enable_auto_commit=False, **opts)
    await consumer.start()
    try:
        tp = TopicPartition(topic, 0)
        consumer.assign([tp])
        await consumer.commit({tp: OffsetAndMetadata(offset, "")})
    finally:
        await consumer.stop()


async def send_all(producer: AIOKafkaProducer, topic: str, messages: Iterable[Msg]) -> list[Any]:
    """Enqueue every message, then await every delivery; returns the record metadata
    (or the exception, for a message the producer or broker refused)."""
    futures = []
    for m in messages:
        try:
            futures.append(await producer.send(topic, m.value, key=m.key, headers=m.all_headers()))
        except Exception as exc:  # refused by the client before it left (e.g. too large)
            fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
            fut.set_exception(exc)
            futures.append(fut)
    return await asyncio.gather(*futures, return_exceptions=True)


async def send_paced(
    producer: AIOKafkaProducer,
    topic: str,
    make: Callable[[int], Msg],
    *,
    rate: float,
    duration: float,
    sent: list[Msg],
) -> None:
    """Open-loop load: message ``i`` goes out at ``start + i / rate`` until ``duration``.

    Appends each message to ``sent`` as it is enqueued (so a test sees what went
    out even if it is cancelled), then awaits every delivery.
    """
    start = time.monotonic()
    futures = []
    i = 0
    while True:
        now = time.monotonic()
        if now - start >= duration:
            break
        due = int((now - start) * rate) + 1
        while i < due:
            m = make(i)
            m.sent_at = time.time()
            futures.append(await producer.send(topic, m.value, key=m.key, headers=m.all_headers()))
            sent.append(m)
            i += 1
        await asyncio.sleep(0.01)
    results = await asyncio.gather(*futures, return_exceptions=True)
    for m, r in zip(sent[len(sent) - len(results) :], results):
        if not isinstance(r, BaseException):
            m.partition, m.offset = r.partition, r.offset
    failed = [r for r in results if isinstance(r, BaseException)]
    assert not failed, f"{len(failed)} of {len(results)} load messages not delivered to the broker: {failed[:3]}"


# --- collecting outcomes ------------------------------------------------------------------------


class Collector:
    """Reads ``decisions`` and the DLQ from offset 0, in the background, and indexes them.

    ``options``: the reader's connection options (TLS, SASL) on a secure broker."""

    def __init__(self, bootstrap: str, topics: Topics, partitions: int, **options: Any) -> None:
        self.bootstrap = bootstrap
        self.topics = topics
        self.options = options
        counts = topics.partition_counts(partitions)
        self.parts = [TopicPartition(topics.decisions, p) for p in range(counts[topics.decisions])]
        self.parts += [TopicPartition(topics.dlq, p) for p in range(counts[topics.dlq])]
        self.decisions: list[dict[str, Any]] = []
        self.dead_letters: list[dict[str, Any]] = []
        self.by_tx: dict[str, list[dict[str, Any]]] = defaultdict(list)
        self.by_corr: dict[str, list[dict[str, Any]]] = defaultdict(list)
        self.dlq_by_corr: dict[str, list[dict[str, Any]]] = defaultdict(list)
        self._consumer: AIOKafkaConsumer | None = None
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> Collector:
        self._consumer = AIOKafkaConsumer(
            bootstrap_servers=self.bootstrap,
            enable_auto_commit=False,
            auto_offset_reset="earliest",
            fetch_max_wait_ms=20,
            isolation_level="read_committed",  # what a consumer of decisions must use
            max_partition_fetch_bytes=8 * 1024 * 1024,
            **self.options,
        )
        await self._consumer.start()
        self._consumer.assign(self.parts)
        await self._consumer.seek_to_beginning(*self.parts)
        self._task = asyncio.create_task(self._run())
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):
                pass
        if self._consumer is not None:
            await self._consumer.stop()

    async def _run(self) -> None:
        assert self._consumer is not None
        while True:
            batches = await self._consumer.getmany(timeout_ms=100)
            seen_at = time.time()
            for tp, records in batches.items():
                for record in records:
                    if not record.value:
                        continue  # a worker's handover record (app/eos.py): no decision
                    doc = orjson.loads(record.value)
                    doc["_seen_at"] = seen_at
                    if tp.topic == self.topics.decisions:
                        self.decisions.append(doc)
                        self.by_tx[doc["transaction_id"]].append(doc)
                        if doc.get("correlation_id") is not None:
                            self.by_corr[doc["correlation_id"]].append(doc)
                    else:
                        header = (doc.get("headers") or {}).get("correlation-id")
                        corr = base64.b64decode(header).decode("utf-8", "replace") if header else None
                        doc["_correlation"] = corr
                        doc["_key"] = record.key
                        self.dead_letters.append(doc)
                        if corr is not None:
                            self.dlq_by_corr[corr].append(doc)

    def has_outcome(self, m: Msg) -> bool:
        return bool(self.by_corr.get(m.correlation) or self.dlq_by_corr.get(m.correlation))

    async def wait_for(self, done: Callable[[], bool], timeout: float, what: str = "outcomes") -> float:
        """Seconds until ``done()``; raises with the counts read so far on timeout."""
        start = time.monotonic()
        while not done():
            if self._task is not None and self._task.done():
                self._task.result()  # the reader died: say why
            if time.monotonic() - start > timeout:
                raise AssertionError(
                    f"timed out after {timeout:.0f} s waiting for {what}: read {len(self.decisions)} decisions "
                    f"and {len(self.dead_letters)} dead letters"
                )
            await asyncio.sleep(0.05)
        return time.monotonic() - start

    async def wait_read_to_end(self, timeout: float) -> None:
        """Wait until everything committed to ``decisions`` and the DLQ by now has
        been read: the reader's position reaches each partition's end (the last
        stable offset, past any transaction marker)."""
        assert self._consumer is not None
        ends = await self._consumer.end_offsets(self.parts)
        deadline = time.monotonic() + timeout
        while True:
            behind = {tp: (await self._consumer.position(tp), end) for tp, end in ends.items()}
            behind = {tp: pe for tp, pe in behind.items() if pe[0] < pe[1]}
            if not behind:
                return
            if self._task is not None and self._task.done():
                self._task.result()  # the reader died: say why
            if time.monotonic() > deadline:
                raise AssertionError(f"the reader did not reach the end in {timeout:.0f} s (position, end): {behind}")
            await asyncio.sleep(0.05)

    async def wait_all(
        self,
        messages: Sequence[Msg],
        timeout: float,
        settle: float = 2.0,
        abort: Callable[[], bool] | None = None,
    ) -> float:
        """Wait until every message has an outcome (or ``timeout``, or ``abort()``
        holds for 3 s, e.g. no worker is alive), then ``settle`` seconds more so
        late duplicates show. Does not raise on timeout: the caller counts what is
        lost. Returns the seconds waited before settling."""
        start = time.monotonic()
        aborting: float | None = None
        while time.monotonic() - start < timeout:
            if all(self.has_outcome(m) for m in messages):
                break
            if abort is not None and abort():
                aborting = aborting or time.monotonic()
                if time.monotonic() - aborting > 3.0:
                    break
            if self._task is not None and self._task.done():
                self._task.result()
            await asyncio.sleep(0.1)
        waited = time.monotonic() - start
        await asyncio.sleep(settle)
        return waited


# --- counting -------------------------------------------------------------------------------------


class LostMessages(AssertionError):
    """Messages with neither a decision nor a dead letter (a test can xfail on exactly this)."""


@dataclass
class Tally:
    sent: int = 0
    decided: int = 0
    dead_lettered: int = 0
    duplicated: int = 0
    lost: int = 0
    lost_ids: list[str] = field(default_factory=list)
    lost_at: list[tuple[int | None, int | None]] = field(default_factory=list)
    """(partition, offset) of each lost message, when known."""
    mismatched: list[str] = field(default_factory=list)
    """Duplicates that disagree in action, fraud_score or model_version."""

    def line(self, name: str, **extra: Any) -> str:
        words = [f"FAULT {name}", f"sent={self.sent}", f"decided={self.decided}",
                 f"dead_lettered={self.dead_lettered}", f"duplicated={self.duplicated}",
                 f"disagreeing={len(self.mismatched)}", f"lost={self.lost}"]  # fmt: skip
        words += [f"{k}={v}" for k, v in extra.items()]
        return " ".join(words)


def tally(collector: Collector, messages: Sequence[Msg], *, by: str = "correlation") -> Tally:
    """Per message: decided (>= 1 decision), dead-lettered (>= 1 DLQ record),
    duplicated (> 1 decision), lost (neither).

    ``by="transaction"`` finds decisions by transaction id (load tests: every
    message has a unique one); ``"correlation"`` by the correlation-id header.
    """
    t = Tally(sent=len(messages))
    for m in messages:
        if by == "transaction":
            assert m.transaction_id is not None
            ds = collector.by_tx.get(m.transaction_id, [])
        else:
            ds = collector.by_corr.get(m.correlation, [])
        dl = collector.dlq_by_corr.get(m.correlation, [])
        t.decided += bool(ds)
        t.dead_lettered += bool(dl)
        if len(ds) > 1:
            t.duplicated += 1
            firsts = {(d["action"], d["fraud_score"], d["model_version"]) for d in ds}
            if len(firsts) > 1:
                t.mismatched.append(f"{m.transaction_id or m.correlation}: {sorted(firsts, key=str)}")
        if not ds and not dl:
            t.lost += 1
            t.lost_ids.append(m.transaction_id or m.correlation)
            t.lost_at.append((m.partition, m.offset))
    return t


async def committed_offsets(bootstrap: str, group: str, topic: str, partitions: int) -> dict[int, int | None]:
    """The consumer group's committed offset per partition of ``topic`` (diagnostics)."""
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, group_id=group, enable_auto_commit=False)
    await consumer.start()
    try:
        return {p: await consumer.committed(TopicPartition(topic, p)) for p in range(partitions)}
    finally:
        await consumer.stop()


def lost_detail(t: Tally, committed: dict[int, int | None] | None = None) -> str:
    by_partition: dict[int | None, list[int | None]] = defaultdict(list)
    for partition, offset in t.lost_at:
        by_partition[partition].append(offset)
    parts = [
        f"p{p}: offsets {sorted(o for o in offs if o is not None)[:12]}"
        for p, offs in sorted(by_partition.items(), key=str)
    ]
    text = f"lost {t.lost}: " + "; ".join(parts) + f"; ids {t.lost_ids[:6]}"
    if committed is not None:
        text += f"; group committed {committed}"
    return text


def duplicate_detail(collector: Collector, t: Tally, messages: Sequence[Msg], limit: int = 8) -> str:
    """Where the doubled transactions were and how their decisions differ (for a
    failure's message): the input partition and offset, and per decision when it
    was decided and read. One ``decided_at`` shared by both: the second is the
    first one answered again (a resend of a decided record); two: scored twice."""
    if not t.duplicated:
        return ""
    rows, partitions = [], Counter()
    same = 0
    for m in messages:
        ds = collector.by_tx.get(m.transaction_id or "", []) or collector.by_corr.get(m.correlation, [])
        if len(ds) < 2:
            continue
        partitions[m.partition] += 1
        same += len({d.get("decided_at") for d in ds}) == 1
        if len(rows) < limit:
            times = ", ".join(f"decided {float(d['decided_at']):.3f} read {d['_seen_at']:.3f}" for d in ds)
            rows.append(f"p{m.partition}@{m.offset} {m.transaction_id}: {times}")
    return (
        f"duplicated {t.duplicated} (input partitions {dict(sorted(partitions.items(), key=str))}; "
        f"{same} with one decided_at): " + "; ".join(rows)
    )


async def rescan(bootstrap: str, collector: Collector, ids: list[str]) -> str:
    """Whether ``ids`` are on the decision and dead-letter topics, read again
    from offset 0 by a fresh consumer: tells a worker that never produced them
    from a collector that missed them (for a failure's message)."""
    consumer = AIOKafkaConsumer(
        bootstrap_servers=bootstrap,
        enable_auto_commit=False,
        fetch_max_wait_ms=20,
        isolation_level="read_committed",
        **collector.options,
    )
    await consumer.start()
    wanted, found = set(ids), Counter()
    try:
        consumer.assign(collector.parts)
        await consumer.seek_to_beginning(*collector.parts)
        deadline = time.monotonic() + 10.0
        while time.monotonic() < deadline:
            batches = await consumer.getmany(timeout_ms=200)
            if not batches:
                positions = {tp: await consumer.position(tp) for tp in collector.parts}
                if all((consumer.last_stable_offset(tp) or 0) <= positions[tp] for tp in collector.parts):
                    break
            for tp, records in batches.items():
                for record in records:
                    if any(i.encode() in record.value for i in wanted):
                        found[tp.topic] += 1
    finally:
        await consumer.stop()
    return f"rescan of the output topics for {len(wanted)} lost ids: found {dict(found) or 'none'}"


async def read_index(bootstrap: str, topic: str, **options: Any) -> dict[str, dict[str, Any]]:
    """The resend index's changelog (``decisions``) as a new owner restores it
    (read_committed, to its end): per transaction id, the decision of its
    first entry (a new decision: its content hash header)."""
    from confluent_kafka import Consumer, KafkaError, TopicPartition

    def read() -> dict[str, dict[str, Any]]:
        consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"index-reader-{uuid.uuid4().hex[:6]}",
                             "enable.auto.commit": False, "isolation.level": "read_committed",
                             "enable.partition.eof": True, **options})  # fmt: skip
        try:
            parts = consumer.list_topics(topic, 10.0).topics[topic].partitions
            consumer.assign([TopicPartition(topic, p, 0) for p in parts])
            pending, out = set(parts), {}
            deadline = time.monotonic() + 30.0
            while pending and time.monotonic() < deadline:
                for msg in consumer.consume(1000, 0.5):
                    if msg.error() is not None:
                        if msg.error().code() == KafkaError._PARTITION_EOF:
                            pending.discard(msg.partition())
                        continue
                    if CONTENT_HASH not in dict(msg.headers() or []):
                        continue  # a cached answer or a rejection: not an entry
                    decision = orjson.loads(msg.value())
                    out.setdefault(decision["transaction_id"], decision)
            return out
        finally:
            consumer.close()

    return await asyncio.to_thread(read)


def report(line: str) -> None:
    """Print one FAULT line (pytest -s shows it) and append it to $FRAUD_FAULT_REPORT if set."""
    print(line, flush=True)
    path = os.environ.get("FRAUD_FAULT_REPORT")
    if path:
        with open(path, "a", encoding="utf-8") as out:
            out.write(line + "\n")


async def end_offsets(bootstrap: str, topic: str, partitions: int) -> dict[int, int]:
    """The end offset of each partition of ``topic``."""
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap)
    await consumer.start()
    try:
        ends = await consumer.end_offsets([TopicPartition(topic, p) for p in range(partitions)])
        return {tp.partition: offset for tp, offset in ends.items()}
    finally:
        await consumer.stop()


async def read_to_end(
    bootstrap: str, topic: str, partitions: int, on_records: Callable[[TopicPartition, list[Any]], None], **options: Any
) -> None:
    """Every record of ``topic``, from its start to the end it has now, handed to
    ``on_records`` a fetch at a time (``options``: the consumer's, such as its
    isolation level)."""
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False, fetch_max_wait_ms=50, **options)
    await consumer.start()
    try:
        parts = [TopicPartition(topic, p) for p in range(partitions)]
        consumer.assign(parts)
        await consumer.seek_to_beginning(*parts)
        ends = await consumer.end_offsets(parts)
        remaining = {tp for tp in parts if ends[tp]}
        while remaining:
            for tp, records in (await consumer.getmany(timeout_ms=200)).items():
                on_records(tp, records)
            remaining = {tp for tp in remaining if await consumer.position(tp) < ends[tp]}
    finally:
        await consumer.stop()


async def read_shares(
    bootstrap: str, topic: str, partitions: int, history: dict[str, list[dict[str, Any]]] | None = None
) -> dict[tuple[str, int], dict[str, Any]]:
    """The merchant tally as its topic holds it (agents/tally.py): the last value
    of each share, by ``(merchant, labels partition)``; every value of each
    merchant's shares appended to ``history`` when given."""
    shares: dict[tuple[str, int], dict[str, Any]] = {}

    def keep(_: TopicPartition, records: list[Any]) -> None:
        for r in records:
            doc = orjson.loads(r.value)
            merchant, part = orjson.loads(r.key)
            shares[(merchant, part)] = doc
            if history is not None:
                history.setdefault(merchant, []).append(
                    {"labels_partition": part, "partition": r.partition, "offset": r.offset, **doc})

    await read_to_end(bootstrap, topic, partitions, keep)
    return shares


def tally_by_merchant(shares: dict[tuple[str, int], dict[str, Any]]) -> dict[str, tuple[int, int]]:
    """(fraud, legit) per merchant: the sum of its shares, as every worker's copy holds it."""
    sums: dict[str, tuple[int, int]] = {}
    for (merchant, _), doc in shares.items():
        fraud, legit = sums.get(merchant, (0, 0))
        sums[merchant] = (fraud + int(doc["fraud"]), legit + int(doc["legit"]))
    return sums
