"""REST vs gRPC through one gateway: ``python -m bench.transports`` (about 2 minutes).

Starts a broker and Redis (or uses ``KAFKA_BOOTSTRAP`` / ``REDIS_URL``), one
``fraud-pipeline gateway`` serving REST and gRPC, and a backend answering on
``decisions``; then, one after the other, through that one gateway:

    rest-seq       POST /v1/transactions, one client, closed loop
    rest-c4        the same, 4 concurrent clients
    grpc-seq       Score, one client, closed loop
    grpc-c4        Score, 4 concurrent clients
    grpc-stream-R  ScoreStream, one stream, open loop at R TPS (--rates, default 250 and 500)

For each: latency as the caller sees it (request sent to answer read; on the
stream, transaction written to its reply read) p50/p99, throughput, errors, and
the gateway process's CPU milliseconds per request (from /proc, over the
measured requests only; warm-up excluded).

The backend (``--backend``): ``echo`` (default) answers each transaction at
once with a decision-shaped record carrying its correlation id, so the figures
are the gateway's own (its validation, rate-limit round trip to Redis, signing,
produce, reply matching, and the transport); ``worker`` puts a real scoring
worker behind it instead (it needs ``make train``; on 2 cores it saturates below
500 TPS, docs/performance.md, so the stream's rate is then what it can take).

Results: ``bench/results/transports.json`` and ``transports.png``, with the machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import orjson

from bench.plan import RESULTS_DIR
from bench.procs import machine_info, proc_cpu_s
from bench.workers import decision_key_env, services
from tools.loadgen import percentiles

__all__ = ["SCENARIOS", "echo_decision", "main", "scenario_record"]

REPO = Path(__file__).resolve().parents[1]
SCENARIOS = ("rest-seq", "rest-c4", "grpc-seq", "grpc-c4", "grpc-stream")
"""Run in this order; ``grpc-stream`` once per offered rate (``grpc-stream-500``)."""
#: Neither bucket is the subject: the limiter still runs (its Redis round trip is
#: part of every request's cost), it never refuses.
NO_LIMITS = {
    "FRAUD_GATEWAY_RATE_PER_S": "1e9", "FRAUD_GATEWAY_BURST": "1e9",
    "FRAUD_RATE_USER_PER_S": "1e9", "FRAUD_RATE_USER_BURST": "1e9",
    "FRAUD_RATE_CLIENT_PER_S": "1e9", "FRAUD_RATE_CLIENT_BURST": "1e9",
}  # fmt: skip
GATEWAY_TIMEOUT_S = 10.0
READY_TIMEOUT_S = 90.0
#: Seconds the gateway is watched idle, to take its idle CPU out of the per-request figures.
IDLE_S = 5.0
USERS = 5000
CURRENCIES = ("USD", "EUR", "GBP")


# --- transactions ------------------------------------------------------------------------


class Transactions:
    """Valid transactions, each with a unique id, spread over ``USERS`` users."""

    def __init__(self, run: str) -> None:
        self.run = run
        self.n = 0

    def __call__(self) -> dict[str, Any]:
        self.n += 1
        n = self.n
        stamp = datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")
        return {
            "transaction_id": f"bt-{self.run}-{n:07d}", "user_id": f"bu-{n % USERS}", "amount": round(5 + (n * 7.31) % 180, 2),
            "currency": CURRENCIES[n % 3], "merchant_id": f"bm-{n % 400}", "merchant_category": "grocery",
            "device_id": f"bd-{n % USERS}", "lat": 48.85, "lon": 2.35, "country": "FR", "timestamp": stamp,
        }  # fmt: skip


def echo_decision(value: bytes, correlation: str | None) -> bytes:
    """What the echo backend writes for one transaction: a decision of every contract field."""
    tx = orjson.loads(value)
    return orjson.dumps({
        "transaction_id": tx.get("transaction_id"), "user_id": tx.get("user_id"), "fraud_score": 0.0,
        "action": "approve", "explanation": ["echo backend: not scored"], "model_version": None,
        "rules_version": "echo", "cached": False, "degraded": False, "feature_age_s": None,
        "latency_ms": {"total": 0.0}, "correlation_id": correlation, "decided_at": time.time(), "error": None,
        "provisional": False,
    })  # fmt: skip


async def run_echo(bootstrap: str, transactions: str, decisions: str) -> None:
    """The echo backend: every transaction answered at once (``python -m bench.transports echo``)."""
    from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

    consumer = AIOKafkaConsumer(
        transactions, bootstrap_servers=bootstrap, group_id=f"bench-echo-{uuid.uuid4().hex[:8]}",
        auto_offset_reset="earliest", fetch_max_wait_ms=5, enable_auto_commit=True,
    )  # fmt: skip
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, linger_ms=1, acks=1)
    await producer.start()
    await consumer.start()
    print("echo: ready", flush=True)
    try:
        while True:
            batches = await consumer.getmany(timeout_ms=200)
            sends = []
            for records in batches.values():
                for record in records:
                    headers = dict(record.headers or ())
                    corr = headers.get("correlation-id")
                    out = echo_decision(record.value, corr.decode() if corr else None)
                    sends.append(await producer.send(decisions, out, key=record.key))
            if sends:
                await asyncio.gather(*sends)
    finally:
        await consumer.stop()
        await producer.stop()


# --- the processes -----------------------------------------------------------------------


def _cli() -> list[str]:
    script = Path(sys.executable).parent / "fraud-pipeline"
    return [str(script)] if script.exists() else [sys.executable, "-m", "tools.cli"]


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen[bytes]
    log_path: Path

    def stop(self) -> None:
        if self.popen.poll() is None:
            os.kill(self.popen.pid, signal.SIGTERM)
            try:
                self.popen.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.kill(self.popen.pid, signal.SIGKILL)
                self.popen.wait(timeout=10)

    def tail(self, lines: int = 20) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])


@contextmanager
def started(name: str, argv: list[str], env: dict[str, str], workdir: Path) -> Iterator[Proc]:
    log_path = workdir / f"{name}.log"
    with log_path.open("wb") as log:
        popen = subprocess.Popen(argv, cwd=REPO, env=env, stdin=subprocess.DEVNULL, stdout=log,
                                 stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    proc = Proc(name, popen, log_path)
    try:
        yield proc
    finally:
        proc.stop()


# --- clients -------------------------------------------------------------------------------


@dataclass
class Sample:
    latencies_ms: list[float]
    errors: Counter[str]
    seconds: float
    offered_rate: float | None = None
    send_lateness_ms: list[float] | None = None


async def rest_load(url: str, key: str, make: Transactions, n: int, concurrency: int) -> Sample:
    import aiohttp

    latencies: list[float] = []
    errors: Counter[str] = Counter()
    remaining = iter(range(n))
    headers = {"X-API-Key": key, "Content-Type": "application/json"}

    async def client(session: aiohttp.ClientSession) -> None:
        for _ in remaining:  # shared: n requests in all
            body = orjson.dumps(make())
            start = time.perf_counter()
            async with session.post(f"{url}/v1/transactions", data=body, headers=headers) as response:
                await response.read()
            latencies.append((time.perf_counter() - start) * 1000)
            if response.status != 200:
                errors[str(response.status)] += 1

    started_at = time.perf_counter()
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency)) as session:
        await asyncio.gather(*(client(session) for _ in range(concurrency)))
    return Sample(latencies, errors, time.perf_counter() - started_at)


async def grpc_unary_load(target: str, key: str, make: Transactions, n: int, concurrency: int) -> Sample:
    import grpc

    from gateway.grpc_codec import transaction_message
    from gateway.grpc_gen.fraud.v1 import fraud_pb2_grpc

    latencies: list[float] = []
    errors: Counter[str] = Counter()
    remaining = iter(range(n))
    metadata = (("x-api-key", key),)

    async with grpc.aio.insecure_channel(target) as channel:
        stub = fraud_pb2_grpc.FraudScoringStub(channel)

        async def client() -> None:
            for _ in remaining:
                message = transaction_message(make())
                start = time.perf_counter()
                try:
                    await stub.Score(message, metadata=metadata, timeout=GATEWAY_TIMEOUT_S + 5)
                except grpc.aio.AioRpcError as err:
                    errors[err.code().name] += 1
                latencies.append((time.perf_counter() - start) * 1000)

        started_at = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(concurrency)))
    return Sample(latencies, errors, time.perf_counter() - started_at)


async def grpc_stream_load(target: str, key: str, make: Transactions, rate: float, seconds: float) -> Sample:
    """Open loop on one stream: transaction ``i`` is written at ``start + i / rate``."""
    import grpc

    from gateway.grpc_codec import transaction_message
    from gateway.grpc_gen.fraud.v1 import fraud_pb2_grpc

    sent_at: dict[str, float] = {}
    lateness: list[float] = []
    """How late each write was against its schedule (the generator's own lag)."""
    latencies: list[float] = []
    errors: Counter[str] = Counter()
    total = int(rate * seconds)
    docs = [make() for _ in range(total)]  # built up front: the schedule is not held up by it
    messages = [transaction_message(d) for d in docs]

    async def requests() -> AsyncIterator[Any]:
        start = time.perf_counter()
        for i, message in enumerate(messages):
            due = start + i / rate
            delay = due - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            now = time.perf_counter()
            sent_at[message.transaction_id] = now
            lateness.append((now - due) * 1000)
            yield message

    async with grpc.aio.insecure_channel(target) as channel:
        stub = fraud_pb2_grpc.FraudScoringStub(channel)
        started_at = time.perf_counter()
        call = stub.ScoreStream(requests(), metadata=(("x-api-key", key),), timeout=seconds + 60)
        async for reply in call:
            latencies.append((time.perf_counter() - sent_at[reply.transaction_id]) * 1000)
            if reply.WhichOneof("result") != "decision":
                errors[f"status-{reply.error.code}"] += 1
        elapsed = time.perf_counter() - started_at
    missing = total - len(latencies)
    if missing:
        errors["unanswered"] += missing
    return Sample(latencies, errors, elapsed, offered_rate=rate, send_lateness_ms=lateness)


# --- the run -------------------------------------------------------------------------------


def _thirds(values: list[float]) -> list[list[float]]:
    k = max(1, len(values) // 3)
    return [values[:k], values[k:2 * k], values[2 * k:]] if len(values) >= 3 else [values]


def scenario_record(name: str, sample: Sample, cpu_s: float | None, requests: int,
                    idle_cpu_per_s: float = 0.0) -> dict[str, Any]:  # fmt: skip
    """One scenario's figures: latency percentiles, rate, errors, gateway CPU per request.

    ``..._net`` leaves out what the gateway burns idle over the same seconds (its
    reply reader's fetch loop), which at low rates is most of the gross figure."""
    net = cpu_s - idle_cpu_per_s * sample.seconds if cpu_s is not None else None
    return {
        "scenario": name,
        "requests": requests,
        "answered": len(sample.latencies_ms),
        "seconds": round(sample.seconds, 2),
        "achieved_rps": round(len(sample.latencies_ms) / sample.seconds, 1) if sample.seconds else None,
        "offered_rps": sample.offered_rate,
        "latency_ms": percentiles(sample.latencies_ms),
        "errors": dict(sample.errors),
        "send_lateness_ms": percentiles(sample.send_lateness_ms) if sample.send_lateness_ms else None,
        "latency_ms_by_third": [percentiles(part)["p50"] for part in _thirds(sample.latencies_ms)],
        "gateway_cpu_ms_per_request": round(cpu_s * 1000 / requests, 3) if cpu_s is not None and requests else None,
        "gateway_cpu_ms_per_request_net": round(max(0.0, net) * 1000 / requests, 3) if net is not None and requests else None,
    }


def _wait_http(url: str, timeout: float, proc: Proc) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.popen.poll() is not None:
            raise RuntimeError(f"{proc.name} exited:\n{proc.tail()}")
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return
        except (OSError, urllib.error.HTTPError):
            pass
        time.sleep(0.3)
    raise RuntimeError(f"{proc.name} not ready after {timeout:.0f} s:\n{proc.tail()}")


def _cpu_of(pids: dict[str, int]) -> dict[str, float | None]:
    out: dict[str, float | None] = {name: proc_cpu_s(pid) for name, pid in pids.items()}
    times = os.times()
    out["client"] = times.user + times.system  # this process: the load generator
    return out


async def measure(args: argparse.Namespace, gateway_pid: int, url: str, target: str, key: str,
                  others: dict[str, int]) -> list[dict[str, Any]]:  # fmt: skip
    make = Transactions(uuid.uuid4().hex[:6])
    # Warm-up, left out of every figure: connections, the producer's metadata, the echo's group join.
    deadline = time.monotonic() + READY_TIMEOUT_S
    while True:
        warm = await rest_load(url, key, make, 1, 1)
        if not warm.errors:
            break
        if time.monotonic() > deadline:
            raise RuntimeError(f"no decision through the gateway after {READY_TIMEOUT_S:.0f} s: {warm.errors}")
    await rest_load(url, key, make, 100, 4)
    await grpc_unary_load(target, key, make, 100, 4)

    idle_before = proc_cpu_s(gateway_pid)
    await asyncio.sleep(IDLE_S)
    idle_after = proc_cpu_s(gateway_pid)
    idle = (idle_after - idle_before) / IDLE_S if idle_before is not None and idle_after is not None else 0.0
    print(f"gateway idle: {idle * 100:.1f} % of a core", flush=True)

    records = []
    names = [s for s in SCENARIOS if s != "grpc-stream"]
    names += [f"grpc-stream-{rate:g}" for rate in args.rates] if "grpc-stream" in SCENARIOS else []
    for name in names:
        before = proc_cpu_s(gateway_pid)
        others_before = _cpu_of(others)
        if name.startswith("rest"):
            concurrency = 4 if name.endswith("c4") else 1
            n = args.n * concurrency
            sample = await rest_load(url, key, make, n, concurrency)
        elif name.startswith("grpc-c") or name == "grpc-seq":
            concurrency = 4 if name.endswith("c4") else 1
            n = args.n * concurrency
            sample = await grpc_unary_load(target, key, make, n, concurrency)
        else:
            rate = float(name.rsplit("-", 1)[1])
            n = int(rate * args.seconds)
            sample = await grpc_stream_load(target, key, make, rate, args.seconds)
        after = proc_cpu_s(gateway_pid)
        others_after = _cpu_of(others)
        cpu = after - before if before is not None and after is not None else None
        record = scenario_record(name, sample, cpu, n, idle)
        record["gateway_idle_cpu_pct"] = round(idle * 100, 2)
        # Where the rest of the machine's CPU went meanwhile (% of one core): the gateway
        # shares the cores with these, and with whatever else runs on the machine.
        record["cpu_pct_of_a_core"] = {
            name: round((others_after[name] - b) / sample.seconds * 100, 1)  # type: ignore[operator]
            for name, b in others_before.items() if b is not None and others_after.get(name) is not None
        }
        record["cpu_pct_of_a_core"]["gateway"] = round(cpu / sample.seconds * 100, 1) if cpu is not None else None
        records.append(record)
        lat = record["latency_ms"]
        print(f"{name:12} n={n:6d} p50={lat['p50']} ms p99={lat['p99']} ms rps={record['achieved_rps']} "
              f"gateway cpu={record['gateway_cpu_ms_per_request']} ms/req "
              f"(net of idle {record['gateway_cpu_ms_per_request_net']}) errors={record['errors']} "
              f"cpu % of a core {record['cpu_pct_of_a_core']}", flush=True)  # fmt: skip
        await asyncio.sleep(1.0)  # let the reply reader and the broker settle between scenarios
    return records


def plot(doc: dict[str, Any], out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = doc["scenarios"]
    names = [r["scenario"] for r in rows]
    p50 = [r["latency_ms"]["p50"] or 0 for r in rows]
    p99 = [r["latency_ms"]["p99"] or 0 for r in rows]
    cpu = [r["gateway_cpu_ms_per_request_net"] or 0 for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.8))
    x = range(len(names))
    left.bar([i - 0.2 for i in x], p50, width=0.4, label="p50")
    left.bar([i + 0.2 for i in x], p99, width=0.4, label="p99")
    left.set_xticks(list(x), names, rotation=20)
    left.set_yscale("log")  # the stream at saturation is 10x the rest
    for i in x:
        left.annotate(f"{p50[i]:g}", (i - 0.2, p50[i]), ha="center", va="bottom", fontsize=7)
        left.annotate(f"{p99[i]:g}", (i + 0.2, p99[i]), ha="center", va="bottom", fontsize=7)
    left.set_ylabel("latency, ms (caller's clock, log scale)")
    left.set_title("Latency through one gateway")
    left.legend()
    right.bar(list(x), cpu, color="tab:green")
    right.set_xticks(list(x), names, rotation=20)
    right.set_ylabel("gateway CPU ms per request (net of idle)")
    right.set_title("Gateway process CPU per request, achieved rate on top")
    for i, r in enumerate(rows):
        right.annotate(f"{r['achieved_rps']:.0f}/s", (i, cpu[i]), ha="center", va="bottom", fontsize=8)
    m = doc["machine"]
    fig.suptitle(f"REST vs gRPC, backend={doc['backend']}, stream offered {'/'.join(f'{r:g}' for r in doc['stream_rates'])} TPS; "
                 f"{m['cores']} cores, {m['cpu_model']}", fontsize=9)  # fmt: skip
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def run_suite(args: argparse.Namespace) -> dict[str, Any]:
    from app.settings import Settings
    from app.topics import ensure_topics

    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%S")
    workdir = REPO / ".stack" / "bench-transports" / stamp
    workdir.mkdir(parents=True, exist_ok=True)
    machine = machine_info()
    with services(workdir) as svc:
        suffix = uuid.uuid4().hex[:8]
        topics = {f"FRAUD_TOPIC_{t.upper()}": f"bt-{t}-{suffix}"
                  for t in ("transactions", "decisions", "dlq", "feedback", "monitoring", "labels")}  # fmt: skip
        producer_key, api_key = secrets.token_hex(32), secrets.token_hex(32)
        env = {k: v for k, v in os.environ.items() if not k.startswith("FRAUD_")}
        env.update(
            KAFKA_BOOTSTRAP=svc.bootstrap, REDIS_URL=svc.redis_url, PYTHONUNBUFFERED="1",
            FRAUD_CLIENT_KEYS=f"gateway:{producer_key}", FRAUD_GATEWAY_KEYS=f"bench:{api_key}",
            FRAUD_GATEWAY_TIMEOUT_S=str(GATEWAY_TIMEOUT_S), FRAUD_PARTITIONS="4", **NO_LIMITS, **topics,
            **decision_key_env(secrets.token_hex(32)),
        )  # fmt: skip
        names: dict[str, Any] = {k[len("FRAUD_"):].lower(): v for k, v in topics.items()}  # fmt: skip
        settings = Settings(kafka_bootstrap=svc.bootstrap, partitions=4, **names)
        asyncio.run(ensure_topics(settings, wait_s=30.0))
        port, grpc_port, backend_web = _free_ports(3)
        if args.backend == "echo":
            backend_argv = [sys.executable, "-m", "bench.transports", "echo", "--bootstrap", svc.bootstrap,
                            "--transactions", settings.topic_transactions, "--decisions", settings.topic_decisions]
        else:
            backend_argv = [*_cli(), "worker", "--web-port", str(backend_web), "--loglevel", "warning"]
        with (
            started("backend", backend_argv, env, workdir) as backend,
            started("gateway", [*_cli(), "gateway", "--port", str(port), "--grpc-port", str(grpc_port)], env,
                    workdir) as gateway,
        ):  # fmt: skip
            _wait_http(f"http://127.0.0.1:{port}/healthz", READY_TIMEOUT_S, gateway)
            others = {**svc.pids, "backend": backend.popen.pid}
            scenarios = asyncio.run(measure(args, gateway.popen.pid, f"http://127.0.0.1:{port}",
                                            f"127.0.0.1:{grpc_port}", api_key, others))  # fmt: skip
    machine["load_avg_at_end"] = list(os.getloadavg())
    return {
        "schema": "fraud-pipeline-bench-transports/1",
        "at": stamp,
        "machine": machine,
        "backend": args.backend,
        "n_per_client": args.n,
        "stream_rates": args.rates,
        "stream_seconds": args.seconds,
        "note": "one gateway process serving REST and gRPC; broker, Redis, backend and this client share the machine",
        "scenarios": scenarios,
    }


def _free_ports(n: int) -> list[int]:
    from tools.stack import free_ports

    return free_ports(n)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.transports", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    sub = parser.add_subparsers(dest="command")
    echo = sub.add_parser("echo", help="(internal) the echo backend")
    echo.add_argument("--bootstrap", required=True)
    echo.add_argument("--transactions", required=True)
    echo.add_argument("--decisions", required=True)
    parser.add_argument("--backend", choices=["echo", "worker"], default="echo")
    parser.add_argument("--n", type=int, default=500, help="requests per client in the closed-loop scenarios")
    parser.add_argument("--rates", type=lambda v: [float(r) for r in v.split(",")], default=[250.0, 500.0],
                        help="the stream's offered rates, TPS, comma-separated (default 250,500)")  # fmt: skip
    parser.add_argument("--seconds", type=float, default=20.0, help="the stream's duration")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    args = parser.parse_args(argv)
    if args.command == "echo":
        asyncio.run(run_echo(args.bootstrap, args.transactions, args.decisions))
        return 0
    doc = run_suite(args)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "transports.json"
    path.write_text(json.dumps(doc, indent=2) + "\n")
    png = plot(doc, args.out / "transports.png")
    print(f"wrote {path.relative_to(REPO) if path.is_relative_to(REPO) else path} and {png.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
