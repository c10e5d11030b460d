"""Worker CPU per transaction under a fixed load, for one setting changed at a time
(``python -m bench.knobs``).

The end-to-end benchmark answers "how fast"; this answers "what does each knob
cost": the batched pipeline at a rate it sustains, one worker per configuration,
the same broker and Redis, reporting the worker's CPU ms per decided transaction
(CPU time, which contention on a shared machine moves far less than latency)
along with p50/p99.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from bench.plan import BATCHED, POPULATION, QUICK_PLAN, REPO, Phase
from bench.runner import Bench
from bench.workers import Worker, prepare, services

#: name -> environment overrides (FRAUD_* settings)
KNOBS: dict[str, dict[str, str]] = {
    "baseline": {},
    "no_quality_agents": {"FRAUD_QUALITY_ENABLED": "false"},
    "role_score": {"FRAUD_WORKER_ROLE": "score"},
    "faust_sensors": {"FRAUD_FAUST_SENSORS": "true"},
    "linger_5ms": {"FRAUD_PRODUCER_LINGER_S": "0.005"},
    "linger_10ms": {"FRAUD_PRODUCER_LINGER_S": "0.010"},
    # Records held until the commit flushes them (Kafka Streams' producer
    # linger): one produce request per transaction instead of one per partition
    # whose linger ran out.
    "linger_100ms": {"FRAUD_PRODUCER_LINGER_S": "0.1"},
    # The scoring consumer's fetches: fewer, fuller ones for the broker to serve.
    "fetch_min_32k": {"FRAUD_FETCH_MIN_BYTES": "32768", "FRAUD_CONSUMER_FETCH_MAX_WAIT_MS": "10"},
    # An idle consumer's long poll: how often it asks when there is nothing to read.
    "fetch_wait_500ms": {"FRAUD_CONSUMER_FETCH_MAX_WAIT_MS": "500"},
    "switch_5ms": {"FRAUD_GIL_SWITCH_INTERVAL_S": "0.005"},
    # How long one transaction spans consecutive batches (app/eos.py): 0 is one per batch.
    "commit_0": {"FRAUD_COMMIT_INTERVAL_S": "0"},
    "commit_25ms": {"FRAUD_COMMIT_INTERVAL_S": "0.025"},
    "commit_50ms": {"FRAUD_COMMIT_INTERVAL_S": "0.05"},
    "commit_100ms": {"FRAUD_COMMIT_INTERVAL_S": "0.1"},
    # Compressed produce requests: fewer bytes for the broker to write, more CPU for the worker.
    "compression_none": {"FRAUD_PRODUCER_COMPRESSION": "none"},
    "compression_lz4": {"FRAUD_PRODUCER_COMPRESSION": "lz4"},
    "compression_zstd": {"FRAUD_PRODUCER_COMPRESSION": "zstd"},
    # A longer batch window: fewer, fuller batches at low and middle rates.
    "window_5ms": {"FRAUD_BATCH_WINDOW_S": "0.005"},
    "window_25ms": {"FRAUD_BATCH_WINDOW_S": "0.025"},
    # One batch per transaction: the window as long as the commit interval was.
    "window_25ms_commit_0": {"FRAUD_BATCH_WINDOW_S": "0.025", "FRAUD_COMMIT_INTERVAL_S": "0"},
    # A bigger take once a queue has formed (no window: at lower rates a take
    # returns what is queued, less than either): more work per commit cycle.
    "batch_128": {"FRAUD_BATCH_SIZE": "128"},
    "batch_256": {"FRAUD_BATCH_SIZE": "256"},
    "batch_256_window_20ms": {"FRAUD_BATCH_SIZE": "256", "FRAUD_BATCH_WINDOW_S": "0.02"},
    "batch_1024_window_20ms": {"FRAUD_BATCH_SIZE": "1024", "FRAUD_BATCH_WINDOW_S": "0.02"},
    # Kafka Streams' pacing: a 10 ms window and every transaction open its whole
    # interval, instead of committing as soon as the worker has caught up (agents/pace.py).
    "interval_only": {"FRAUD_BATCH_WINDOW_S": "0.01", "FRAUD_COMMIT_CAUGHT_UP": "false"},
    # The pause between a commit and the next transaction's first records
    # (app/eos.py: the coordinator refuses a new transaction's requests while
    # it writes the last one's markers, and librdkafka retries 20 ms later).
    "settle_0": {"FRAUD_COMMIT_SETTLE_S": "0"},
    "settle_3ms": {"FRAUD_COMMIT_SETTLE_S": "0.003"},
    "settle_6ms": {"FRAUD_COMMIT_SETTLE_S": "0.006"},
    # Scores from XGBoost instead of the compiled trees (models/compiled.py).
    "xgboost_trees": {"FRAUD_COMPILED_TREES": "false"},
    "compiled_trees": {"FRAUD_COMPILED_TREES": "true"},
    # Half the partitions: what a transaction pays per partition it writes
    # (librdkafka sends one produce request per partition; the coordinator a
    # marker to each).
    "partitions_4": {"FRAUD_PARTITIONS": "4"},
    # Two processes in one group (4 partitions each): the other core, shared
    # with the broker, Redis and the load generator.
    "workers_2": {},
    "workers_2_score": {"FRAUD_WORKER_ROLE": "score"},
    # The worker of another checkout (``--base``: the code before a change), with the same settings.
    "base": {},
    # Two of them, against ``workers_2``.
    "base_workers_2": {},
}
WORKERS = {"workers_2": 2, "workers_2_score": 2, "base_workers_2": 2}


def _relative(path: Path) -> str:
    """Results are committed: the data file as the repository names it, not this machine's path."""
    try:
        return str(path.resolve().relative_to(REPO))
    except ValueError:
        return path.name


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", type=float, default=150.0)
    parser.add_argument("--seconds", type=float, default=12.0)
    parser.add_argument("--warmup", type=float, default=3.0, help="seconds of load before the measured ones")
    parser.add_argument("--knobs", nargs="+", default=list(KNOBS))
    parser.add_argument("--out", type=Path, default=Path("bench/results/knobs.json"))
    parser.add_argument("--label", help="tag the rows (e.g. the code version in an A/B)")
    parser.add_argument("--append", action="store_true", help="add the rows to those already in --out")
    parser.add_argument("--base", help="another checkout of this project: the worker of the knob 'base'")
    parser.add_argument("--velocity-events", type=int, default=0,
                        help="give every user of the population this many velocity events in the last day "
                        "first: a long run's Redis state (25-32 a user after a million transactions)")
    args = parser.parse_args()
    phase = Phase(warmup_s=args.warmup, measure_s=args.seconds, drain_s=15.0)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench-knobs-") as tmp, services(Path(tmp)) as svc:
        prepare(svc)
        if args.velocity_events:
            seed_velocity(svc.redis_url, args.velocity_events)
        bench = Bench(QUICK_PLAN, svc, Path(tmp), time.monotonic())
        for name in args.knobs:
            saved = {k: os.environ.get(k) for k in KNOBS[name]}
            os.environ.update(KNOBS[name])
            variant = BATCHED
            if name.startswith("base"):
                if not args.base:
                    parser.error(f"the knob {name!r} needs --base CHECKOUT")
                variant = replace(variant, checkout=str(Path(args.base).resolve()))
            if "FRAUD_BATCH_WINDOW_S" in KNOBS[name]:  # the variant's own would win
                variant = replace(variant, batch_window_s=float(KNOBS[name]["FRAUD_BATCH_WINDOW_S"]))
            if "FRAUD_BATCH_SIZE" in KNOBS[name]:
                variant = replace(variant, batch_size=int(KNOBS[name]["FRAUD_BATCH_SIZE"]))
            worker = Worker(variant, svc, Path(tmp))
            extra: list[Worker] = []
            try:
                worker.wait_ready()
                for _ in range(WORKERS.get(name, 1) - 1):
                    extra.append(Worker(variant, svc, Path(tmp), join=worker))  # the same checkout and shape
                    extra[-1].wait_ready()
                    svc.pids[f"worker{len(extra) + 1}"] = extra[-1].pid  # sampled with the others
                run = bench._measure(worker, args.rate, phase, f"knob-{name}")
            finally:
                for w in (worker, *extra):
                    w.stop()
                for i in range(len(extra)):
                    svc.pids.pop(f"worker{i + 2}", None)
                for k, v in saved.items():
                    os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
            workers_cpu = (run.get("cpu_pct") or 0.0) + sum(
                v or 0.0 for k, v in run.get("other_cpu_pct", {}).items() if k.startswith("worker")
            )
            run["cpu_pct"] = workers_cpu
            cpu_ms_per_tx = (run["cpu_pct"] * 10.0 / run["achieved_tps"]) if run.get("cpu_pct") and run.get("achieved_tps") else None
            row = {**({"label": args.label} if args.label else {}), "knob": name, **KNOBS[name], "workers": WORKERS.get(name, 1), "offered_tps": args.rate, "achieved_tps": run["achieved_tps"],
                   "cpu_pct": run["cpu_pct"], "cpu_ms_per_tx": round(cpu_ms_per_tx, 3) if cpu_ms_per_tx else None,
                   "p50_ms": run["p50_ms"], "p99_ms": run["p99_ms"], "lost": run["lost"], "degraded": run.get("degraded"), "degraded_why": run.get("degraded_why"),
                   # records sent and not yet decided, at its highest: a backlog the window may not show
                   "lag_max": max((n for _, n in run.get("lag", [])), default=None), "warmup_s": args.warmup, "data": _relative(POPULATION),
                   # the rest of the machine: a setting can move cost to the broker
                   "broker_cpu_pct": run.get("other_cpu_pct", {}).get("broker"),
                   "redis_cpu_pct": run.get("other_cpu_pct", {}).get("redis"),
                   "loadgen_cpu_pct": run.get("other_cpu_pct", {}).get("loadgen")}  # fmt: skip
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.append and args.out.exists():
        rows = json.loads(args.out.read_text())["rows"] + rows
    from bench.procs import machine_info

    doc = {"machine": machine_info(), "setup": "broker, Redis, worker(s) and load generator co-located", "rows": rows}
    args.out.write_text(json.dumps(doc, indent=2))
    from bench.plots import knobs_plot

    print(knobs_plot(doc, args.out.with_suffix(".png")))


def seed_velocity(redis_url: str, events: int) -> None:
    """Every population user's velocity set as after a long run: ``events``
    events of the last 24 h (velocity_member's shape, as the worker adds them)."""
    import random

    import redis

    from app.redis_keys import velocity_key
    from pipeline.feature_store import VELOCITY_RETENTION_S
    from tools.loadgen import _population

    rng = random.Random(11)
    client = redis.Redis.from_url(redis_url)
    now = time.time()
    pipe = client.pipeline(transaction=False)
    for n, user in enumerate(_population(POPULATION).user_id):
        key = velocity_key(str(user))
        pipe.zadd(key, {f"seed-{n}-{e}|{rng.uniform(1, 300)!r}": now - rng.uniform(60, 86_000) for e in range(events)})
        pipe.expire(key, int(VELOCITY_RETENTION_S))
        if n % 2000 == 1999:
            pipe.execute()
    pipe.execute()
    client.close()


if __name__ == "__main__":
    main()
