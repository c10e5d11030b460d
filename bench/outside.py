"""The outside load shape: the pipeline measured as an independent client would measure it.

``bench/runner.py``'s own shape drives load from inside the harness: one process
sends on a Poisson schedule, reads the decisions back and holds the latency
clock, against a worker on topics the harness made with the bench's settings.
This shape has nothing of the harness in the data path:

* a **generator process** (``python -m bench.outside generate``): a librdkafka
  producer with librdkafka's defaults, transactions made and signed at send
  time (docs/contract.md) from the bench's population, at a constant rate or
  with Poisson arrivals; it writes each transaction's wall-clock send time;
* a **stamper process** (``python -m bench.outside stamp``): a separate
  ``read_committed`` consumer of ``decisions`` with librdkafka's defaults; it
  writes each decision's wall-clock arrival time;
* the **default topics** as ``fraud-pipeline topics`` creates them, and
  ``fraud-pipeline worker --role score`` with **default settings**: only the
  broker, Redis, the keys and the rate limits the bench raises are given.

Both processes stamp ``time.time()`` on the same machine, so a decision's
latency is its arrival stamp minus its send stamp; the harness joins the two
files after the run. It samples every process's CPU meanwhile (worker(s),
broker, Redis, generator, stamper), so a run gives the same record as the
inside shape's (:func:`summarise` returns a :func:`tools.loadgen.run_load`-
shaped summary).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from bench.procs import proc_cpu_s, proc_rss_mb

__all__ = [
    "ARRIVALS",
    "OutsideError",
    "OutsideSession",
    "agreement",
    "arrival_times",
    "first_seconds",
    "in_flight_at",
    "main",
    "stage_percentiles",
    "summarise",
]

ARRIVALS = ("constant", "poisson")
#: How often the harness samples CPU during a run (as the inside shape does).
SAMPLE_EVERY_S = 0.5
#: What a process gets to start (imports, the population, its client) before it is given up on.
PROCESS_READY_TIMEOUT_S = 60.0
READY_TIMEOUT_S = 90.0
STOP_TIMEOUT_S = 10.0
#: An explanation's word for a decision made without a model score (pipeline/scorer.py).
DEGRADED = "degraded: "


class OutsideError(RuntimeError):
    """A worker, the generator or the stamper did not start, answer or finish."""


# --- pure parts -------------------------------------------------------------------------


def arrival_times(rate: float, duration_s: float, arrivals: str, seed: int) -> np.ndarray:
    """Send times in seconds after the start, for ``duration_s``.

    ``constant``: evenly spaced, as a client that paces its sends does.
    ``poisson``: exponential gaps (independent shoppers), the first at 0.
    """
    if rate <= 0 or duration_s <= 0:
        return np.zeros(0)
    if arrivals == "constant":
        return np.arange(0.0, duration_s, 1.0 / rate)
    if arrivals != "poisson":
        raise ValueError(f"arrivals: {arrivals!r} is not one of {ARRIVALS}")
    rng = np.random.default_rng(seed)
    gaps = rng.exponential(1.0 / rate, int(rate * duration_s * 1.2) + 64)
    times = np.cumsum(gaps) - gaps[0]
    while times[-1] < duration_s:
        times = np.concatenate([times, times[-1] + np.cumsum(rng.exponential(1.0 / rate, len(gaps)))])
    out: np.ndarray = times[times < duration_s]
    return out


def _percentiles(values: Sequence[float] | np.ndarray) -> dict[str, float | None]:
    from tools.loadgen import percentiles

    return percentiles(np.asarray(values, dtype=float))


def in_flight_at(t: float, sent: np.ndarray, decided_at: np.ndarray) -> int:
    """Transactions sent by ``t`` and not decided by then (``decided_at``: their
    arrival times, NaN for none; both in the same order, ``sent`` sorted)."""
    n_sent = int(np.searchsorted(sent, t, side="right"))
    done = decided_at[:n_sent]
    return n_sent - int(np.count_nonzero(done <= t))


def summarise(
    sends: Mapping[str, Any], arrivals: Mapping[str, Sequence[Any]], samples: Sequence[Mapping[str, Any]], *,
    offered_tps: float, warmup_s: float, duration_s: float,
) -> dict[str, Any]:  # fmt: skip
    """A :func:`tools.loadgen.run_load`-shaped summary from the two processes' files.

    ``sends``: the generator's file (``start``, ``end``, ``ids``, ``t``, ``lag_ms``:
    wall-clock seconds). ``arrivals``: the stamper's (transaction id ->
    ``[t, degraded_why or None, cached, action, latency_ms]``). ``samples``: the harness's CPU
    readings, each with its wall-clock ``t`` (an ``event`` of ``measure_start``
    and ``send_end`` marks the window the CPU figures come from).

    A transaction is measured when it was sent after the warm-up; the achieved
    rate counts decisions that arrived in the measured window, whenever sent.
    """
    start, end = float(sends["start"]), float(sends["end"])
    ids: list[str] = list(sends["ids"])
    sent = np.asarray(sends["t"], dtype=float)
    got = [arrivals.get(tx_id) for tx_id in ids]
    decided_at = np.array([np.nan if a is None else float(a[0]) for a in got])
    measure_from = start + warmup_s
    measured = sent >= measure_from
    latency_ms = (decided_at - sent) * 1000.0
    ok = ~np.isnan(decided_at)
    in_window = int(np.count_nonzero(ok & (decided_at >= measure_from) & (decided_at <= end)))
    window_s = end - measure_from
    degraded_why: Counter[str] = Counter(a[1] for a in got if a is not None and a[1] is not None)
    actions: Counter[str] = Counter(str(a[3]) for a in got if a is not None)
    timeline = [
        {k: v for k, v in s.items() if k != "t"}
        | {
            "t": round(float(s["t"]) - start, 3),
            "in_flight": in_flight_at(float(s["t"]), sent, decided_at),
            "decided": int(np.count_nonzero(decided_at <= float(s["t"]))),
        }  # fmt: skip
        for s in samples
    ]
    lag = np.asarray(sends.get("lag_ms", []), dtype=float)
    return {
        "offered_rate": offered_tps,
        "duration_s": duration_s,
        "warmup_s": warmup_s,
        "sent": len(ids),
        "sent_rate": round(len(ids) / (end - start), 1) if end > start else 0.0,
        "decided": int(np.count_nonzero(ok)),
        "measured": int(np.count_nonzero(measured & ok)),
        "lost": int(np.count_nonzero(~ok)),
        "achieved_rate": round(in_window / window_s, 1) if window_s > 0 else 0.0,
        "latency_ms": _percentiles(latency_ms[measured & ok]),
        "generator_lag_ms": _percentiles(lag[measured] if len(lag) == len(ids) else lag),
        "stages_ms": stage_percentiles(
            [a for a, keep in zip(got, measured & ok) if keep and a is not None], latency_ms[measured & ok]
        ),
        "actions": dict(actions),
        "cached": sum(1 for a in got if a is not None and a[2]),
        "degraded": sum(degraded_why.values()),
        "degraded_why": dict(degraded_why),
        "timeline": timeline,
    }


def stage_percentiles(stamps: Sequence[Sequence[Any]], latency_ms: Sequence[float] | np.ndarray) -> dict[str, Any]:
    """Percentiles of each of the decisions' own stages (their ``latency_ms``,
    as the inside shape reports them) and ``after``: the latency less the
    worker's ``total``, i.e. the transaction's commit and the read back.
    ``stamps``: the stamper's entries of the measured decisions, in the order of ``latency_ms``."""
    from tools.loadgen import AFTER

    values: dict[str, list[float]] = {}
    for stamp, ms in zip(stamps, latency_ms):
        stages = _stages_of(stamp)
        for name, value in stages.items():
            if isinstance(value, (int, float)):
                values.setdefault(name, []).append(float(value))
        if isinstance(stages.get("total"), (int, float)):
            values.setdefault(AFTER, []).append(float(ms) - float(stages["total"]))
    return {name: _percentiles(v) for name, v in sorted(values.items())}


def first_seconds(
    sends: Mapping[str, Any], arrivals: Mapping[str, Sequence[Any]], ready: float, seconds: float
) -> dict[str, Any]:
    """Latency of the decisions that arrived in the first ``seconds`` after a
    worker reported Ready (wall clock ``ready``), and what was sent in that
    time but not decided by then."""
    sent = np.asarray(sends["t"], dtype=float)
    got = [arrivals.get(i) for i in sends["ids"]]
    decided_at = np.array([np.nan if a is None else float(a[0]) for a in got])
    until = ready + seconds
    arrived = ~np.isnan(decided_at) & (decided_at >= ready) & (decided_at <= until)
    sent_in = (sent >= ready) & (sent <= until)
    late = sent_in & ~(decided_at <= until)  # NaN compares False: undecided counts as late
    lat = (decided_at[arrived] - sent[arrived]) * 1000.0
    # The worker's clock of each decision, where the stamper had it (a record's
    # queue_wait: from its timestamp to its batch's start; total: to its decision).
    queue = np.array([_stage(a, "queue_wait") for a in got])[arrived]
    total = np.array([_stage(a, "total") for a in got])[arrived]
    at = decided_at[arrived]

    def by_second(values: np.ndarray) -> list[float | None]:
        return [_percentiles(values[(at >= ready + s) & (at < ready + s + 1) & ~np.isnan(values)])["p99"]
                for s in range(int(seconds))]  # fmt: skip

    return {
        "seconds": seconds,
        "decided": int(np.count_nonzero(arrived)),
        "sent": int(np.count_nonzero(sent_in)),
        "undecided_at_end": int(np.count_nonzero(late)),
        "latency_ms": _percentiles(lat),
        # Per second after Ready: where the start's cost sits.
        "p99_by_second": [
            _percentiles(lat[(decided_at[arrived] >= ready + s) & (decided_at[arrived] < ready + s + 1)])["p99"]
            for s in range(int(seconds))
        ],
        # Where the time went, per second: waiting to be taken (generator, broker,
        # fetch, queue), scored in the worker, and after its decision (its
        # transaction's commit and the read back).
        "p99_by_second_taken": by_second(queue),
        "p99_by_second_scored": by_second(total - queue),
        "p99_by_second_after": by_second(lat - total),
    }


def _stages_of(arrival: Sequence[Any] | None) -> Mapping[str, Any]:
    """A stamp's copy of its decision's ``latency_ms`` (empty where it has none)."""
    stages = arrival[4] if arrival is not None and len(arrival) > 4 else None
    return stages if isinstance(stages, Mapping) else {}


def _stage(arrival: Sequence[Any] | None, name: str) -> float:
    """A stamp's stage time (ms), NaN where it has none."""
    value = _stages_of(arrival).get(name)
    return float(value) if isinstance(value, (int, float)) else float("nan")


def _close(a: float | None, b: float | None, tolerance: float) -> bool | None:
    if a is None or b is None:
        return None
    hi = max(abs(a), abs(b))
    return hi == 0 or abs(a - b) <= tolerance * hi


def _max_agree(a: Mapping[str, Any], b: Mapping[str, Any], tolerance: float) -> bool | None:
    """Max rates compared; one found only as a lower bound (no rate failed)
    disagrees only when it is above the other beyond ``tolerance``."""
    ta, tb = a.get("max_tps"), b.get("max_tps")
    la, lb = bool(a.get("max_tps_lower_bound")), bool(b.get("max_tps_lower_bound"))
    if ta is None or tb is None or (la and lb):
        return None
    if la or lb:
        low, other = (ta, tb) if la else (tb, ta)
        return False if low > other * (1 + tolerance) else None
    return _close(ta, tb, tolerance)


def agreement(inside: Mapping[str, Any], outside: Mapping[str, Any], tolerance: float = 0.10) -> dict[str, Any]:
    """Whether two shapes' figures agree within ``tolerance`` (of the larger).

    Each side: ``max_tps`` (highest rate with p99 < 200 ms;
    ``max_tps_lower_bound`` when no rate failed), ``p99_ms`` and
    ``cpu_ms`` (per process, ms per decision) by offered rate. p99 and CPU are
    compared at every rate both passed; a figure missing on one side is not
    compared (``None``), and the shapes agree only if everything compared did.
    """
    checks: list[dict[str, Any]] = [{
        "what": "max TPS at p99 < 200 ms", "inside": inside.get("max_tps"), "outside": outside.get("max_tps"),
        "agree": _max_agree(inside, outside, tolerance),
    }]  # fmt: skip
    common = sorted(set(inside.get("p99_ms", {})) & set(outside.get("p99_ms", {})))
    for rate in common:
        a, b = inside["p99_ms"][rate], outside["p99_ms"][rate]
        checks.append({"what": f"p99 ms @ {rate:,.0f}", "inside": a, "outside": b, "agree": _close(a, b, tolerance)})
    for rate in sorted(set(inside.get("cpu_ms", {})) & set(outside.get("cpu_ms", {}))):
        for proc in ("worker", "broker", "redis"):
            a, b = inside["cpu_ms"][rate].get(proc), outside["cpu_ms"][rate].get(proc)
            checks.append({"what": f"{proc} CPU ms/decision @ {rate:,.0f}", "inside": a, "outside": b,
                           "agree": _close(a, b, tolerance)})  # fmt: skip
    compared = [c["agree"] for c in checks if c["agree"] is not None]
    return {"tolerance": tolerance, "agree": bool(compared) and all(compared), "checks": checks}


# --- the two processes ------------------------------------------------------------------


def _settings() -> Any:
    from app.settings import Settings

    return Settings()


def _write_json(path: Path, doc: Any) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc))
    tmp.replace(path)  # whole or absent: the harness never reads half a file


def generate(args: argparse.Namespace) -> int:
    """Send at ``--rate`` for ``--duration`` s once told ``go`` on stdin; write the send times."""
    import confluent_kafka
    import orjson

    from app.librdkafka import client_config
    from tools.loadgen import _population, _signer
    from tools.simulator import LiveTransactions

    s = _settings()
    source = LiveTransactions(_population(Path(args.data)), seed=args.seed, fraud_rate=0.02)
    sign = _signer(s)
    # librdkafka's defaults but acks=all (what an exactly-once pipeline's
    # client would ask) and Kafka's default partitioner, as docs/contract.md
    # asks of a librdkafka client: a client does not tune its producer to the bench.
    producer = confluent_kafka.Producer({**client_config(s, "loadgen"), "acks": "all", "partitioner": "murmur2_random"})
    times = arrival_times(args.rate, args.duration, args.arrivals, args.seed)
    topic = s.topic_transactions
    ids: list[str] = []
    stamps: list[float] = []
    lag_ms: list[float] = []
    print("ready", flush=True)
    if sys.stdin.readline().strip() != "go":
        return 1
    start_mono, start = time.monotonic(), time.time()
    print(f"start {start!r}", flush=True)
    i, n = 0, len(times)
    while i < n:
        delay = start_mono + times[i] - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        now_mono = time.monotonic()
        while i < n and start_mono + times[i] <= now_mono:
            now = time.time()
            tx = source.next(now)
            value = orjson.dumps(tx)
            headers = [("correlation-id", os.urandom(8).hex().encode()), *sign(value, now)]
            ids.append(tx["transaction_id"])
            stamps.append(time.time())
            lag_ms.append(round((time.monotonic() - start_mono - times[i]) * 1000.0, 3))
            while True:
                try:
                    producer.produce(topic, value, tx["user_id"].encode(), headers=headers)
                    break
                except BufferError:
                    producer.poll(0.01)
            i += 1
        producer.poll(0)
    producer.flush(30.0)
    end = time.time()
    _write_json(Path(args.out), {"start": start, "end": end, "ids": ids, "t": stamps, "lag_ms": lag_ms})
    # Alive until told: the harness reads this process's CPU time at the end of sending.
    print("done", flush=True)
    sys.stdin.readline()
    return 0


def _stdin_lines() -> queue.Queue[str | None]:
    lines: queue.Queue[str | None] = queue.Queue()

    def read() -> None:
        for line in sys.stdin:
            lines.put(line.strip())
        lines.put(None)

    threading.Thread(target=read, daemon=True, name="stdin").start()
    return lines


def stamp(args: argparse.Namespace) -> int:
    """Stamp every decision's arrival from the end of ``decisions`` on; on
    ``drain PATH SECONDS`` wait up to SECONDS for the decisions of the ids in
    PATH (a generator's file), then write the stamps and exit."""
    import confluent_kafka
    import orjson

    from app.librdkafka import client_config
    from tools.loadgen import partitions_at_end

    s = _settings()
    consumer = confluent_kafka.Consumer({
        **client_config(s, "loadgen"), "group.id": f"outside-stamper-{uuid.uuid4().hex[:8]}",
        "enable.auto.commit": False, "isolation.level": "read_committed",
    })  # fmt: skip
    consumer.assign(partitions_at_end(consumer, s.topic_decisions))
    control = _stdin_lines()
    seen: dict[str, list[Any]] = {}
    wanted: set[str] | None = None
    deadline = float("inf")
    print("assigned", flush=True)
    while True:
        first = consumer.poll(0.05)
        now = time.time()
        for msg in [first, *consumer.consume(10_000, 0)] if first is not None else []:
            value = msg.value()
            if msg.error() is not None or not value:
                continue  # an empty value: a worker's handover record (app/eos.py), no decision
            doc = orjson.loads(value)
            why = None
            if doc.get("degraded"):
                words = doc.get("explanation") or ()
                why = next((w[len(DEGRADED) :] for w in words if isinstance(w, str) and w.startswith(DEGRADED)), "?")
            # The worker's own clock of it (latency_ms): from the record's timestamp to
            # its batch's start (queue_wait) and to its decision (total); the rest is after.
            seen[doc.get("transaction_id")] = [
                now, why, bool(doc.get("cached")), doc.get("action", "none"), doc.get("latency_ms") or {},
            ]  # fmt: skip
            if wanted is not None:
                wanted.discard(doc.get("transaction_id"))
        with contextlib.suppress(queue.Empty):
            line = control.get_nowait()
            if line is None:
                break
            if line.startswith("drain "):
                _, path, seconds = line.split(" ", 2)
                wanted = set(json.loads(Path(path).read_text())["ids"]) - set(seen)
                deadline = time.monotonic() + float(seconds)
        if wanted is not None and (not wanted or time.monotonic() > deadline):
            break
    consumer.close()
    _write_json(Path(args.out), seen)
    return 0


# --- the harness's side -----------------------------------------------------------------


def _fraud_free_env() -> dict[str, str]:
    """The harness's environment without any FRAUD_ setting: defaults are what the worker gets."""
    return {k: v for k, v in os.environ.items() if not k.startswith("FRAUD_")}


def _read_line(proc: subprocess.Popen[str], expect: str, timeout_s: float) -> str:
    """The first stdout line of ``proc`` starting with ``expect`` (others are skipped)."""
    lines: queue.Queue[str | None] = queue.Queue()
    out = proc.stdout
    assert out is not None

    def read() -> None:
        while True:
            line = out.readline()
            lines.put(line or None)
            if not line or line.startswith(expect):
                return

    threading.Thread(target=read, daemon=True).start()
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            line = lines.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            raise OutsideError(f"no {expect!r} from {proc.args!r} in {timeout_s:.0f} s") from None
        if line is None:
            raise OutsideError(f"{proc.args!r} exited ({proc.wait()}) before {expect!r}")
        if line.startswith(expect):
            return line.strip()


def _stop(proc: subprocess.Popen[Any] | None) -> None:
    """SIGTERM, then SIGKILL: only the processes this module started, by their own handle."""
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=5)


@dataclass
class _Worker:
    proc: subprocess.Popen[bytes]
    log_path: Path
    started_at: float

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def wait_ready(self, timeout_s: float = READY_TIMEOUT_S) -> float:
        """Block until the worker logs "Ready"; return that moment (wall clock)."""
        deadline = time.monotonic() + timeout_s
        while b"Ready" not in self.log_path.read_bytes():
            if not self.alive():
                tail = self.log_path.read_text(errors="replace").splitlines()[-12:]
                raise OutsideError(f"worker exited ({self.proc.returncode}):\n" + "\n".join(tail))
            if time.monotonic() > deadline:
                raise OutsideError(f"worker not Ready after {timeout_s:.0f} s")
            time.sleep(0.02)
        return time.time()


class OutsideSession:
    """Default topics, ``workers`` default scoring workers, and runs of the two
    processes against them. The harness's services give the broker, Redis and
    keys (``env``); ``pids`` (broker, Redis) are sampled too."""

    def __init__(self, env: Mapping[str, str], pids: Mapping[str, int], workdir: Path, population: Path,
                 cli: Sequence[str], workers: int = 1) -> None:  # fmt: skip
        self.env = {**_fraud_free_env(), **env, "PYTHONUNBUFFERED": "1"}
        self.pids = dict(pids)
        self.workdir = workdir / "outside"
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.population = population
        self.cli = list(cli)
        self.count = workers
        self.workers: list[_Worker] = []
        self.extra_pids: list[int] = []
        """Worker processes started elsewhere whose CPU counts as the worker's (load on another's topics)."""
        self.ready_at: float | None = None
        """When the last worker reported Ready (wall clock)."""
        self._runs = 0

    # -- workers and topics --

    def topics(self) -> str:
        """``fraud-pipeline topics`` as a user runs it; its output (the partition counts)."""
        done = subprocess.run([*self.cli, "topics"], env=self.env, capture_output=True, text=True)
        if done.returncode != 0:
            raise OutsideError(f"fraud-pipeline topics exited {done.returncode}: {done.stderr.strip()[-500:]}")
        return done.stdout.strip()

    def start(self, *, wait: bool = True) -> None:
        from tools import stack

        for i in range(self.count):
            tag = f"{len(self.workers) + i}-{uuid.uuid4().hex[:6]}"
            log_path = self.workdir / f"worker-{tag}.log"
            # NOTE: the web port and data folder are per process on one host
            # (two workers could not share them), not tuning.
            env = {**self.env, "FRAUD_DATA_DIR": str(self.workdir / "faust" / tag)}
            argv = [*self.cli, "worker", "--role", "score", "--web-port", str(stack.free_port())]
            with log_path.open("wb") as out:
                proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=out,
                                        stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
            self.workers.append(_Worker(proc, log_path, time.monotonic()))
        if wait:
            self.wait_ready()

    def wait_ready(self) -> float:
        self.ready_at = max(w.wait_ready() for w in self.workers)
        return self.ready_at

    def stop(self) -> None:
        for worker in self.workers:
            _stop(worker.proc)
        self.workers = []

    def alive(self) -> bool:
        return bool(self.workers) and all(w.alive() for w in self.workers)

    @property
    def worker_pids(self) -> list[int]:
        return [w.pid for w in self.workers] + self.extra_pids

    # -- one run --

    def _spawn(self, *args: str) -> subprocess.Popen[str]:
        return subprocess.Popen([sys.executable, "-m", "bench.outside", *args], env=self.env,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                start_new_session=True)  # fmt: skip

    def run(
        self, rate: float, *, arrivals: str, warmup_s: float, measure_s: float, drain_s: float, seed: int,
        before_go: Callable[[], None] | None = None,
    ) -> tuple[dict[str, Any], Mapping[str, Any], Mapping[str, Sequence[Any]]]:  # fmt: skip
        """One run: the summary, and the two processes' files (sends, arrivals).
        ``before_go``: called once both processes are ready, just before sending
        starts (e.g. to start a fresh worker and wait for its Ready)."""
        self._runs += 1
        base = self.workdir / f"run-{self._runs}"
        sends_path, arrivals_path = base.with_suffix(".sends.json"), base.with_suffix(".arrivals.json")
        stamper = generator = None
        samples: list[dict[str, Any]] = []
        lock = threading.Lock()
        stop = threading.Event()

        def sample(event: str | None = None) -> None:
            pids = self.worker_pids
            cpu = [proc_cpu_s(p) for p in pids]
            rss = [proc_rss_mb(p) for p in pids]
            entry: dict[str, Any] = {
                "t": time.time(),
                "cpu_s": None if not cpu or None in cpu else sum(c for c in cpu if c is not None),
                "rss_mb": None if not rss or None in rss else max(r for r in rss if r is not None),
                "loadgen_cpu_s": proc_cpu_s(generator.pid) if generator else None,
                "stamper_cpu_s": proc_cpu_s(stamper.pid) if stamper else None,
            } | {f"{name}_cpu_s": proc_cpu_s(pid) for name, pid in self.pids.items()}
            if event:
                entry["event"] = event
            with lock:
                samples.append(entry)

        def sampler(measure_at: float) -> None:
            marked = False
            while True:
                if not marked and time.time() >= measure_at:
                    sample("measure_start")
                    marked = True
                else:
                    sample()
                wait = SAMPLE_EVERY_S if marked else min(SAMPLE_EVERY_S, measure_at - time.time())
                if stop.wait(max(0.0, wait)):
                    return

        thread = None
        try:
            stamper = self._spawn("stamp", "--out", str(arrivals_path))
            _read_line(stamper, "assigned", PROCESS_READY_TIMEOUT_S)
            generator = self._spawn("generate", "--rate", str(rate), "--duration", str(warmup_s + measure_s),
                                    "--arrivals", arrivals, "--seed", str(seed), "--data", str(self.population),
                                    "--out", str(sends_path))  # fmt: skip
            _read_line(generator, "ready", PROCESS_READY_TIMEOUT_S)
            if before_go is not None:
                before_go()
            assert generator.stdin is not None
            generator.stdin.write("go\n")
            generator.stdin.flush()
            start = float(_read_line(generator, "start ", 10.0).split()[1])
            thread = threading.Thread(target=sampler, args=(start + warmup_s,), daemon=True, name="sampler")
            thread.start()
            _read_line(generator, "done", warmup_s + measure_s + 60.0)
            sample("send_end")
            generator.stdin.write("bye\n")
            generator.stdin.flush()
            if generator.wait(timeout=10.0) != 0:
                raise OutsideError(f"the generator exited {generator.returncode}")
            assert stamper.stdin is not None
            stamper.stdin.write(f"drain {sends_path} {drain_s}\n")
            stamper.stdin.flush()
            stamper.wait(timeout=drain_s + 30.0)
            stop.set()
            thread.join()
            sample("drained")
        except subprocess.TimeoutExpired as exc:
            raise OutsideError(f"{exc.cmd!r} did not finish in {exc.timeout:.0f} s") from exc
        finally:
            stop.set()
            _stop(generator)
            _stop(stamper)
        sends = json.loads(sends_path.read_text())
        got = json.loads(arrivals_path.read_text())
        # NOTE: the window marks ride on samples taken by this process; the
        # figures take the generator's own start and end (its clock's).
        summary = summarise(sends, got, sorted(samples, key=lambda e: e["t"]), offered_tps=rate,
                            warmup_s=warmup_s, duration_s=warmup_s + measure_s)  # fmt: skip
        for path in (sends_path, arrivals_path):  # tens of MB over a bench: the summary holds what counts
            path.unlink(missing_ok=True)
        return summary, sends, got


@contextlib.contextmanager
def session(env: Mapping[str, str], pids: Mapping[str, int], workdir: Path, population: Path,
            cli: Sequence[str], workers: int = 1) -> Iterator[OutsideSession]:  # fmt: skip
    s = OutsideSession(env, pids, workdir, population, cli, workers)
    try:
        yield s
    finally:
        s.stop()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.outside", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="send at a rate once told 'go'; write the send times")
    g.add_argument("--rate", type=float, required=True)
    g.add_argument("--duration", type=float, required=True)
    g.add_argument("--arrivals", choices=ARRIVALS, default="constant")
    g.add_argument("--seed", type=int, default=7)
    g.add_argument("--data", required=True, help="the population's parquet")
    g.add_argument("--out", required=True)
    g.set_defaults(func=generate)
    st = sub.add_parser("stamp", help="stamp decisions' arrivals until told 'drain PATH SECONDS'")
    st.add_argument("--out", required=True)
    st.set_defaults(func=stamp)
    args = parser.parse_args(argv)
    # SIGTERM from the harness (a run cut short): exit without a traceback.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    func: Callable[[argparse.Namespace], int] = args.func
    return func(args)


if __name__ == "__main__":
    sys.exit(main())
