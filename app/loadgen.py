"""Open-loop load: Poisson arrivals at a fixed rate, latency to the decision.

Transactions come from :class:`app.simulator.LiveTransactions` over the same
population the training data was simulated from (existing users, their devices
and merchants). Arrivals are scheduled on the clock, not on acknowledgements:
a closed loop would slow down with the system and hide its queueing.

Latency is measured from the moment a transaction is handed to the producer
to the moment its decision is read from ``decisions`` by this process's own
consumer (same clock at both ends).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np
import orjson
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

from app.settings import Settings, get_settings
from app.topics import kafka_auth

__all__ = ["LoadConfig", "percentiles", "run_load"]


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


def percentiles(latencies_ms: list[float] | np.ndarray) -> dict[str, float | None]:
    if len(latencies_ms) == 0:
        return {"p50": None, "p95": None, "p99": None, "p99.9": None, "max": None}
    arr = np.asarray(latencies_ms)
    p50, p95, p99, p999 = np.percentile(arr, [50, 95, 99, 99.9])
    return {"p50": round(float(p50), 1), "p95": round(float(p95), 1), "p99": round(float(p99), 1),
            "p99.9": round(float(p999), 1), "max": round(float(arr.max()), 1)}


def _population(data: Path) -> Any:
    from app.simulator import SimulationConfig, build_population

    sidecar = data.with_suffix(".sim.json")
    meta = json.loads(sidecar.read_text()) if sidecar.is_file() else {}
    if meta.get("end"):
        meta["end"] = datetime.fromisoformat(meta["end"])
    return build_population(SimulationConfig(**meta))


async def run_load(cfg: LoadConfig) -> dict[str, Any]:
    from app.simulator import LiveTransactions

    s = cfg.settings
    source = LiveTransactions(_population(cfg.data), seed=cfg.seed, fraud_rate=cfg.fraud_rate)
    auth = kafka_auth(s)
    producer = AIOKafkaProducer(bootstrap_servers=s.kafka_bootstrap, linger_ms=2, **auth)
    consumer = AIOKafkaConsumer(
        bootstrap_servers=s.kafka_bootstrap, group_id=None, enable_auto_commit=False,
        fetch_max_wait_ms=20, **auth,
    )
    await producer.start()
    await consumer.start()
    sent_at: dict[str, float] = {}
    latencies: list[float] = []
    window: list[float] = []
    actions: Counter[str] = Counter()
    flags: Counter[str] = Counter()
    try:
        tps = [TopicPartition(s.topic_decisions, p) for p in range(s.partitions)]
        consumer.assign(tps)
        ends = await consumer.end_offsets(tps)
        for tp in tps:
            consumer.seek(tp, ends.get(tp, 0))

        done_sending = asyncio.Event()

        async def produce() -> int:
            rng = np.random.default_rng(cfg.seed + 1)
            start = time.monotonic()
            next_at = start
            count = 0
            while next_at - start < cfg.duration_s:
                delay = next_at - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
                tx = source.next(time.time())
                correlation = uuid.uuid4().hex[:16]
                sent_at[tx["transaction_id"]] = time.monotonic()
                await producer.send(
                    s.topic_transactions, orjson.dumps(tx), key=tx["user_id"].encode(),
                    headers=[("correlation-id", correlation.encode())],
                )
                count += 1
                next_at += float(rng.exponential(1.0 / cfg.rate))
            await producer.flush()
            done_sending.set()
            return count

        async def consume() -> None:
            while True:
                batches = await consumer.getmany(timeout_ms=100, max_records=5000)
                now = time.monotonic()
                for records in batches.values():
                    for record in records:
                        doc = orjson.loads(record.value)
                        started = sent_at.pop(doc["transaction_id"], None)
                        if started is None:
                            continue
                        ms = (now - started) * 1000
                        latencies.append(ms)
                        window.append(ms)
                        actions[doc["action"]] += 1
                        flags["cached"] += bool(doc.get("cached"))
                        flags["degraded"] += bool(doc.get("degraded"))
                if done_sending.is_set() and not sent_at:
                    return

        async def report() -> None:
            t0 = time.monotonic()
            last = 0
            while True:
                await asyncio.sleep(cfg.report_every_s)
                p = percentiles(window)
                window.clear()
                done = len(latencies)
                if not cfg.quiet:
                    print(
                        f"[{time.monotonic() - t0:5.1f}s] decided {done:>7,} "
                        f"({(done - last) / cfg.report_every_s:,.0f}/s)  in flight {len(sent_at):>5,}  "
                        f"p50 {p['p50']} ms  p99 {p['p99']} ms  "
                        + " ".join(f"{k}={v}" for k, v in sorted(actions.items())),
                        flush=True,
                    )
                last = done

        t_start = time.monotonic()
        consumer_task = asyncio.create_task(consume())
        reporter = asyncio.create_task(report())
        sent = await produce()
        send_s = time.monotonic() - t_start
        try:
            await asyncio.wait_for(consumer_task, cfg.drain_s)
        except asyncio.TimeoutError:
            pass
        reporter.cancel()
    finally:
        await producer.stop()
        await consumer.stop()
    summary = {
        "offered_rate": cfg.rate,
        "duration_s": cfg.duration_s,
        "sent": sent,
        "decided": len(latencies),
        "lost": len(sent_at),
        "achieved_rate": round(len(latencies) / send_s, 1) if send_s else 0.0,
        "latency_ms": percentiles(latencies),
        "actions": dict(actions),
        "cached": flags["cached"],
        "degraded": flags["degraded"],
    }
    if not cfg.quiet:
        lat = summary["latency_ms"]
        print(
            f"sent {sent:,} at {cfg.rate:,.0f}/s offered; decided {summary['decided']:,} "
            f"({summary['achieved_rate']:,.0f}/s), without decision {summary['lost']}; "
            f"latency p50 {lat['p50']} ms, p95 {lat['p95']} ms, p99 {lat['p99']} ms, max {lat['max']} ms; "
            f"actions {dict(actions)}; degraded {flags['degraded']}"
        )
    return summary
