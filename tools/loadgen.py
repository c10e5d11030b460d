"""Open-loop load: Poisson arrivals at a fixed rate, latency to the decision.

Transactions come from :class:`tools.simulator.LiveTransactions` over the same
population the training data was simulated from (existing users, their devices
and merchants). Arrivals are scheduled on the clock, not on acknowledgements:
a closed loop would slow down with the system and hide its queueing.

Latency is measured from the moment a transaction is handed to the producer
to the moment its decision is read from ``decisions`` by this process's own
consumer (same clock at both ends). How late each send was against its Poisson
schedule is reported separately (``generator_lag_ms``): if the generator itself
falls behind, the offered load was lower than asked for.

For benchmarks (``bench/run.py``) a run can start with ``warmup_s`` seconds
whose transactions are sent but left out of the latency figures, and a
``sample`` callback whose readings (say, a worker's CPU time) are recorded with
the number of transactions still awaiting a decision in ``timeline``.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from app.errors import ConfigError
from app.librdkafka import client_config
from app.settings import Settings, get_settings
from pipeline.decision_signing import Unverified, headers_of, verifier_from_settings

__all__ = ["AFTER", "LoadConfig", "partitions_at_end", "percentiles", "run_load"]

#: The shortest sleep between two rounds of sends.
TICK_S = 0.001
#: How long the generator's producer holds sends to batch them in one request.
LINGER_MS = 5
#: A decision's time after the worker decided it (its latency less its own
#: ``latency_ms.total``): the wait for its transaction's commit, the commit,
#: and the ``read_committed`` fetch back. Reported beside the decision's stages.
AFTER = "after"
#: An explanation's word for a decision made without a model score (pipeline/scorer.py).
DEGRADED = "degraded: "


def _kafka() -> Any:
    import confluent_kafka

    return confluent_kafka


@dataclass(frozen=True, slots=True)
class _Send:
    """One transaction ready to produce (and its label, if it gets one)."""

    tx_id: str
    key: bytes
    value: bytes
    headers: list[tuple[str, bytes]]
    label: bytes | None


@dataclass(frozen=True)
class LoadConfig:
    rate: float = 200.0
    duration_s: float = 20.0
    data: Path = Path("data/transactions.parquet")
    fraud_rate: float = 0.02
    seed: int = 7
    report_every_s: float = 1.0
    drain_s: float = 10.0
    """After the last send, wait up to this long for outstanding decisions."""
    settings: Settings = field(default_factory=get_settings)
    quiet: bool = False
    warmup_s: float = 0.0
    """Transactions sent in the first ``warmup_s`` seconds get decisions but are
    left out of the latency percentiles, stage breakdown and achieved rate."""
    label_share: float = 0.0
    """Share of transactions also labelled on ``labels`` with the simulator's ground
    truth (fraud as a chargeback, legit as an analyst verdict): drives the feedback
    loop (live quality, ``train --from-feedback``) in demos."""
    sample: Callable[[], dict[str, float]] | None = None
    """Called at each report tick, at the end of the warm-up and when sending
    ends; what it returns is stored in that ``timeline`` entry."""
    verify_share: float = 1.0
    """Share of this run's decisions whose Ed25519 signature is checked (when
    public keys are configured): a check costs ~0.1 ms, as much as the rest of
    the generator's work on a decision, so benchmarks check a sample."""
    record_decisions: bool = False
    """Also return ``summary["decisions"]``: ``t`` (seconds since the load
    started, the timeline's clock) and ``latency_ms`` of every decision, warm-up
    included, in arrival order: latency percentiles over any time window."""
    prebuild: bool = False
    """Make and sign every transaction before the clock starts (each stamped
    with the time it will be sent): during the run the generator only sends
    and reads decisions, so its CPU is not the benchmark's. Holds the whole
    run in memory (~1 KB per transaction): for runs of minutes, not hours."""


#: How long a topic's partitions may lack a leader (just created, on a busy
#: machine) before reading their ends gives up.
LEADER_WAIT_S = 15.0


def partitions_at_end(consumer: Any, topic: str, wait_s: float = LEADER_WAIT_S) -> list[Any]:
    """Every partition of ``topic`` at its current end offset.

    NOTE: a topic a worker has just created may not have its leaders elected
    yet: the broker answers NOT_LEADER_FOR_PARTITION (seen on a loaded 2-core
    machine right after a worker's Ready). Retried until ``wait_s``.
    """
    kafka = _kafka()
    deadline = time.monotonic() + wait_s
    while True:
        try:
            meta = consumer.list_topics(topic, 10.0).topics[topic]
            out = []
            for p in sorted(meta.partitions):
                _, high = consumer.get_watermark_offsets(kafka.TopicPartition(topic, p), 10.0)
                out.append(kafka.TopicPartition(topic, p, high))
            return out
        except kafka.KafkaException as exc:
            error = exc.args[0]
            no_leader = error.code() in (
                kafka.KafkaError.NOT_LEADER_FOR_PARTITION, kafka.KafkaError.LEADER_NOT_AVAILABLE,
                kafka.KafkaError.UNKNOWN_TOPIC_OR_PART,
            )  # fmt: skip
            if not (no_leader or error.retriable()) or time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def percentiles(latencies_ms: list[float] | np.ndarray) -> dict[str, float | None]:
    if len(latencies_ms) == 0:
        return {"p50": None, "p95": None, "p99": None, "p99.9": None, "max": None}
    arr = np.asarray(latencies_ms)
    p50, p95, p99, p999 = np.percentile(arr, [50, 95, 99, 99.9])
    return {
        "p50": round(float(p50), 1),
        "p95": round(float(p95), 1),
        "p99": round(float(p99), 1),
        "p99.9": round(float(p999), 1),
        "max": round(float(arr.max()), 1),
    }


@lru_cache(maxsize=4)  # about a second to build; a benchmark runs many loads
def _population(data: Path) -> Any:
    from tools.simulator import SimulationConfig, build_population

    sidecar = data.with_suffix(".sim.json")
    meta = json.loads(sidecar.read_text()) if sidecar.is_file() else {}
    if meta.get("end"):
        meta["end"] = datetime.fromisoformat(meta["end"])
    return build_population(SimulationConfig(**meta))


def _signer(settings: Settings) -> Any:
    """Sign as the first configured producer client (``loadgen`` if present), or not at all."""
    from pipeline.auth import ClientKeys, sign

    secret = settings.client_keys.get_secret_value() if settings.client_keys else None
    keys = ClientKeys.load(settings.client_keys_file, secret)
    if not keys:
        return lambda value, now_s: []
    client = "loadgen" if "loadgen" in keys else next(iter(keys))
    key = keys[client]
    return lambda value, now_s: list(sign(value, client, key, int(now_s * 1000)).items())


async def run_load(cfg: LoadConfig) -> dict[str, Any]:
    load = _LoadRun(cfg)
    try:
        load.prepare()
        await load.follow_decisions()
        sent, send_s = await load.drive()
    finally:
        await load.close()
    summary = load.summarise(sent, send_s)
    if not cfg.quiet:
        _print_summary(cfg, summary)
    return summary


class _LoadRun:
    """One load run: its clients, what it sent when, and the decisions read back."""

    def __init__(self, cfg: LoadConfig) -> None:
        from tools.simulator import LiveTransactions

        self.cfg = cfg
        s = self.settings = cfg.settings
        if cfg.label_share and s.kafka_sasl_mechanism:
            # One process, one principal: the payment client may not write `labels`
            # (tools/kafka_acls.py), and one that may would defeat that rule.
            raise ConfigError(
                f"--labels writes `labels`, which the load generator's user "
                f"{s.kafka_sasl_username!r} may not on an authenticated broker (the analyst's right, "
                "SECURITY.md): run the load without --labels, or on the plaintext stack"
            )
        self.source = LiveTransactions(_population(cfg.data), seed=cfg.seed, fraud_rate=cfg.fraud_rate)
        self.signer = _signer(s)
        # Decisions count only when signed by a published key (FRAUD_DECISION_PUBLIC_KEYS_FILE);
        # without that file they are not checked (a pass-through bench worker signs nothing).
        self.decision_keys = verifier_from_settings(s) or None
        self.unverified = 0
        self.verified_count = 0
        # librdkafka on both sides: a send is ~2 us of C, not ~50 us of Python,
        # so the generator stays a small share of a core at thousands of TPS.
        base = client_config(s, "loadgen")
        # NOTE: a fetch is answered as soon as fetch.min.bytes are there: at 1 byte
        # a consumer of a busy topic sends fetch after fetch, and serving those
        # requests, not the bytes, was most of the broker's CPU. The same goes
        # for produce requests (linger). Both bounded by a few milliseconds here.
        # murmur2: Kafka's default partitioner (Java clients, aiokafka), which the
        # contract asks for: each user's records on their home partition (app/placement.py).
        self.producer = _kafka().Producer({**base, "linger.ms": LINGER_MS, "acks": "all", "partitioner": "murmur2_random"})
        self.consumer = _kafka().Consumer({
            **base, "group.id": f"payments-loadgen-{uuid.uuid4().hex[:8]}", "enable.auto.commit": False,
            "isolation.level": "read_committed", "fetch.min.bytes": s.fetch_min_bytes,
            "fetch.wait.max.ms": s.consumer_fetch_max_wait_ms,
        })  # fmt: skip
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="loadgen-consumer")
        self._verify_every = max(1, round(1 / cfg.verify_share)) if cfg.verify_share > 0 else 0
        self._seen = 0
        self.sent_at: dict[str, float] = {}
        self.measured_ids: set[str] = set()  # sent after the warm-up
        self.latencies: list[float] = []  # of measured transactions only
        self.gen_lag: list[float] = []  # ms each measured send ran behind its schedule
        self.stages: defaultdict[str, list[float]] = defaultdict(list)  # the decisions' own latency_ms
        self.window: list[float] = []
        self.actions: Counter[str] = Counter()
        self.flags: Counter[str] = Counter()
        #: Why decisions were degraded, as their explanations say ("degraded: <why>").
        self.degraded_why: Counter[str] = Counter()
        self.timeline: list[dict[str, Any]] = []
        self.marks: dict[str, float] = {}  # monotonic time of each timeline event
        self.received: list[float] = []  # monotonic arrival time of every matched decision
        self.received_ms: list[float] = []  # their latencies, when cfg.record_decisions
        self.done_sending = asyncio.Event()
        self.t_start = 0.0
        self._label_rng = np.random.default_rng(cfg.seed + 2)
        self._times: np.ndarray = np.zeros(0)
        self._prebuilt: list[_Send] | None = None
        self._start_epoch: float | None = None

    async def close(self) -> None:
        await self._call(self.producer.flush, 10.0)
        await self._call(self.consumer.close)
        self._thread.shutdown(wait=False)

    async def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._thread, fn, *args)

    async def follow_decisions(self) -> None:
        """Read every partition of ``decisions`` from its current end: only this run's decisions count."""
        s = self.settings

        def assign_at_end() -> None:
            self.consumer.assign(partitions_at_end(self.consumer, s.topic_decisions))

        await self._call(assign_at_end)

    async def drive(self) -> tuple[int, float]:
        """Send on schedule while reading decisions and reporting, then drain;
        returns the number sent and the seconds sending took."""
        self.t_start = time.monotonic()
        consumer_task = asyncio.create_task(self.consume())
        reporter = asyncio.create_task(self.report())
        sent = await self.produce()
        send_s = time.monotonic() - self.t_start
        try:
            await asyncio.wait_for(consumer_task, self.cfg.drain_s)
        except TimeoutError:
            pass
        reporter.cancel()
        self.snapshot("drained")
        return sent, send_s

    def snapshot(self, event: str | None = None) -> None:
        now = time.monotonic()
        entry: dict[str, Any] = {
            "t": round(now - self.t_start, 3),
            "in_flight": len(self.sent_at),
            "decided": len(self.received),
        }
        if event:
            entry["event"] = event
            self.marks[event] = now
        if self.cfg.sample is not None:
            entry.update(self.cfg.sample())
        self.timeline.append(entry)

    def schedule(self) -> np.ndarray:
        """Send times (seconds after the start): Poisson arrivals for ``duration_s``."""
        cfg = self.cfg
        rng = np.random.default_rng(cfg.seed + 1)
        gaps = rng.exponential(1.0 / cfg.rate, int(cfg.rate * cfg.duration_s * 1.2) + 64)
        times = np.cumsum(gaps) - gaps[0]  # the first send at the start
        while times[-1] < cfg.duration_s:
            more = rng.exponential(1.0 / cfg.rate, len(gaps))
            times = np.concatenate([times, times[-1] + np.cumsum(more)])
        within: np.ndarray = times[times < cfg.duration_s]
        return within

    def build(self, epoch_s: float) -> _Send:
        """The next transaction, made and signed at epoch seconds ``epoch_s``
        (and its label, for ``label_share`` of them)."""
        tx = self.source.next(epoch_s)
        value = orjson.dumps(tx)
        key = tx["user_id"].encode()
        headers = [("correlation-id", os.urandom(8).hex().encode()), *self.signer(value, epoch_s)]
        label = None
        if self.cfg.label_share and self._label_rng.random() < self.cfg.label_share:
            label = self.label_for(tx)
        return _Send(tx["transaction_id"], key, value, headers, label)

    def prepare(self) -> None:
        """With ``prebuild``: every send made and signed now, stamped with the
        time it will be sent (the clock starts when they are built)."""
        self._times = self.schedule()
        if not self.cfg.prebuild:
            return
        n = len(self._times)
        probe = time.perf_counter()
        for _ in range(min(n, 100)):  # what one costs, so the stamps can be set ahead
            self.build(time.time())
        per = (time.perf_counter() - probe) / min(n, 100) if n else 0.0
        self._start_epoch = time.time() + per * n * 1.25 + 0.1
        self._prebuilt = [self.build(self._start_epoch + float(at)) for at in self._times]

    async def produce(self) -> int:
        """Poisson arrivals for ``duration_s``; the first ``warmup_s`` are not measured."""
        cfg = self.cfg
        if self._start_epoch is not None and time.time() < self._start_epoch:
            await asyncio.sleep(self._start_epoch - time.time())  # the stamps' start
        times, prebuilt = self._times, self._prebuilt
        n = len(times)
        start = time.monotonic()
        wall_start = time.time()
        count = 0
        warm = cfg.warmup_s > 0
        if not warm:
            self.snapshot("measure_start")
        producer, topic, labels = self.producer, self.settings.topic_transactions, self.settings.topic_labels
        while count < n:
            delay = start + times[count] - time.monotonic()
            if delay > 0:
                # NOTE: one sleep per tick, then every send that is due: a sleep
                # per send cost more than the send itself at thousands of TPS.
                await asyncio.sleep(max(delay, TICK_S))
            now = time.monotonic()
            while count < n and start + times[count] <= now:
                at = float(times[count])
                if warm and at >= cfg.warmup_s:
                    warm = False
                    self.snapshot("measure_start")
                send = prebuilt[count] if prebuilt is not None else self.build(wall_start + (now - start))
                self.sent_at[send.tx_id] = now
                if not warm:
                    self.measured_ids.add(send.tx_id)
                    self.gen_lag.append((now - start - at) * 1000)
                self._produce(topic, send.value, send.key, send.headers)
                if send.label is not None:
                    self._produce(labels, send.label, send.tx_id.encode())
                count += 1
            producer.poll(0)  # delivery reports
        await self._call(producer.flush, 30.0)
        self.snapshot("send_end")
        self.done_sending.set()
        return count

    def _produce(self, topic: str, value: bytes, key: bytes, headers: list[tuple[str, bytes]] | None = None) -> None:
        while True:
            try:
                self.producer.produce(topic, value, key, headers=headers)
                return
            except BufferError:  # the local queue is full: deliveries drain it
                self.producer.poll(0.01)

    def label_for(self, tx: dict[str, Any]) -> bytes:
        """A label for ``tx`` with the simulator's ground truth, as a chargeback or an analyst would give it."""
        fraud = self.source.last_scenario != "legit"
        label = {"transaction_id": tx["transaction_id"], "label": "fraud" if fraud else "legit",
                 "source": "chargeback" if fraud else "analyst",
                 "labeled_at": datetime.now(UTC).isoformat(), "merchant_id": tx["merchant_id"]}  # fmt: skip
        return orjson.dumps(label)

    async def consume(self) -> None:
        """Match decisions to sends until sending is done and none is outstanding."""
        verify_every, keys = self._verify_every, self.decision_keys
        while True:
            messages = await self._call(self._next_decisions)
            now = time.monotonic()
            for msg in messages:
                if msg.error() is not None:
                    continue
                value = msg.value()
                if not value:
                    continue  # a worker's handover record (app/eos.py): no decision
                doc = orjson.loads(value)
                if keys is not None and verify_every and doc.get("transaction_id") in self.sent_at:
                    # Only ours are worth a signature check, and of those a sample.
                    self._seen += 1
                    if self._seen % verify_every == 0:
                        self.verified_count += 1
                        if isinstance(keys.verify(value, headers_of(msg.headers())), Unverified):
                            self.unverified += 1  # forged, or an unknown key: not a decision
                            continue
                self.collect(doc, now)
            if self.done_sending.is_set() and not self.sent_at:
                return

    def _next_decisions(self) -> list[Any]:
        """What has arrived, as soon as anything has (at most 50 ms).

        NOTE: librdkafka's ``consume(n, timeout)`` returns only when it has ``n``
        messages or the timeout passed: it would add up to the timeout to every
        latency measured. One ``poll`` waits for the first, then what is queued."""
        first = self.consumer.poll(0.05)
        if first is None:
            return []
        return [first, *self.consumer.consume(10_000, 0)]

    def collect(self, doc: dict[str, Any], now: float) -> None:
        tx_id = doc.get("transaction_id")
        started = self.sent_at.pop(tx_id, None) if isinstance(tx_id, str) else None
        if started is None:
            return
        self.received.append(now)
        ms = (now - started) * 1000
        self.window.append(ms)
        if self.cfg.record_decisions:
            self.received_ms.append(round(ms, 2))
        if tx_id in self.measured_ids:
            self.latencies.append(ms)
            stages = doc.get("latency_ms") or {}
            for stage, value in stages.items():
                self.stages[stage].append(value)
            if isinstance(stages.get("total"), (int, float)):
                self.stages[AFTER].append(ms - stages["total"])
        # A pass-through worker (bench) forwards transactions: no action.
        self.actions[doc.get("action", "none")] += 1
        self.flags["cached"] += bool(doc.get("cached"))
        if doc.get("degraded"):
            self.flags["degraded"] += 1
            words = doc.get("explanation") or ()
            why = next((w[len(DEGRADED) :] for w in words if isinstance(w, str) and w.startswith(DEGRADED)), "?")
            self.degraded_why[why] += 1

    async def report(self) -> None:
        """A timeline entry, and unless quiet a progress line, every ``report_every_s``."""
        cfg = self.cfg
        t0 = time.monotonic()
        last = 0
        while True:
            await asyncio.sleep(cfg.report_every_s)
            self.snapshot()
            p = percentiles(self.window)
            self.window.clear()
            done = len(self.received)
            if not cfg.quiet:
                print(
                    f"[{time.monotonic() - t0:5.1f}s] decided {done:>7,} "
                    f"({(done - last) / cfg.report_every_s:,.0f}/s)  in flight {len(self.sent_at):>5,}  "
                    f"p50 {p['p50']} ms  p99 {p['p99']} ms  "
                    + " ".join(f"{k}={v}" for k, v in sorted(self.actions.items())),
                    flush=True,
                )
            last = done

    def summarise(self, sent: int, send_s: float) -> dict[str, Any]:
        cfg, t_start = self.cfg, self.t_start
        # Throughput over the measured window: decisions that arrived in it, whenever
        # sent, so a backlog drained afterwards does not count.
        measure_from = self.marks.get("measure_start", t_start)
        measure_to = self.marks.get("send_end", t_start + send_s)
        in_window = sum(1 for t in self.received if measure_from <= t <= measure_to)
        window_s = measure_to - measure_from
        summary = {
            "offered_rate": cfg.rate,
            "duration_s": cfg.duration_s,
            "warmup_s": cfg.warmup_s,
            "sent": sent,
            "sent_rate": round(sent / send_s, 1) if send_s else 0.0,
            "decided": len(self.received),
            "measured": len(self.latencies),
            "lost": len(self.sent_at),
            "verified": self.decision_keys is not None,
            "unverified": self.unverified,
            "signatures_checked": self.verified_count,
            "achieved_rate": round(in_window / window_s, 1) if window_s > 0 else 0.0,
            "latency_ms": percentiles(self.latencies),
            "generator_lag_ms": percentiles(self.gen_lag),
            "stages_ms": {name: percentiles(values) for name, values in sorted(self.stages.items())},
            "actions": dict(self.actions),
            "cached": self.flags["cached"],
            "degraded": self.flags["degraded"],
            "degraded_why": dict(self.degraded_why),
            "timeline": self.timeline,
        }
        if cfg.record_decisions:
            summary["decisions"] = {"t": [round(t - t_start, 3) for t in self.received], "latency_ms": self.received_ms}
        return summary


def _print_summary(cfg: LoadConfig, summary: dict[str, Any]) -> None:
    lat = summary["latency_ms"]
    print(
        f"sent {summary['sent']:,} at {cfg.rate:,.0f}/s offered; decided {summary['decided']:,} "
        f"({summary['achieved_rate']:,.0f}/s), without decision {summary['lost']}; "
        f"unverified {summary['unverified']}{'' if summary['verified'] else ' (signatures not checked)'}; "
        f"latency p50 {lat['p50']} ms, p95 {lat['p95']} ms, p99 {lat['p99']} ms, max {lat['max']} ms; "
        f"actions {summary['actions']}; degraded {summary['degraded']}"
    )
