"""What a batch's Kafka transaction costs (``python -m bench.transactions``).

The scoring agent commits each batch as one transaction per input partition
(app/transactional.py). This measures that commit alone, against the local
broker it starts, for a batch of 32 transactions' records (32 decisions of
~700 bytes and 32 feedback records of ~1.5 KB, one monitoring record) spread
over 1, 4 and 8 input partitions, and beside it the same records produced
without a transaction (acks=all, idempotent, all deliveries awaited: what the
agent awaited before). Batches are committed back to back, after a pause of
``--gap-ms`` (a worker's batches are ~10-30 ms apart), ``--batches`` of each.
Prints one line per case and writes ``bench/results/transactions.json`` and
``transactions.png``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from aiokafka import AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

from app.transactional import PartitionBatch, TransactionalEmitter
from bench.run import machine_info
from tools import stack

PARTITIONS = 8
BATCH = 32


def _records(partitions: int, batch: int) -> dict[int, list[tuple[str, bytes | None, bytes]]]:
    out: dict[int, list[tuple[str, bytes | None, bytes]]] = {p: [] for p in range(partitions)}
    for i in range(batch):
        key = f"t-{i:06d}".encode()
        out[i % partitions] += [("decisions", key, b"d" * 700), ("feedback", key, b"f" * 1500)]
    out[0].append(("monitoring", None, b"m" * 600))
    return out


async def _transactional(
    bootstrap: str, partitions: int, n: int, gap_s: float, tag: str, linger_ms: int
) -> list[float]:
    emitter = TransactionalEmitter(
        app_id=f"bench-tx-{tag}", group_id=f"bench-tx-{tag}", topic="transactions",
        producer_options={"bootstrap_servers": bootstrap, "linger_ms": linger_ms, "retry_backoff_ms": 5},
    )  # fmt: skip
    await emitter.assign(range(partitions))
    records = _records(partitions, BATCH)
    times: list[float] = []
    cpu0 = time.process_time()
    try:
        for i in range(n):
            started = time.perf_counter()
            results = await emitter.commit({p: PartitionBatch(i + 1, r) for p, r in records.items()})
            times.append((time.perf_counter() - started) * 1000)
            assert all(r is None for r in results.values()), results
            await asyncio.sleep(gap_s)
    finally:
        await emitter.close()
    times.append((time.process_time() - cpu0) * 1000 / n)  # the last entry: client CPU ms per batch
    return times


async def _plain(bootstrap: str, n: int, gap_s: float) -> list[float]:
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, linger_ms=2, acks="all", enable_idempotence=True)
    await producer.start()
    records = [r for rs in _records(1, BATCH).values() for r in rs]
    times: list[float] = []
    cpu0 = time.process_time()
    try:
        for _ in range(n):
            started = time.perf_counter()
            futures = [await producer.send(topic, value, key=key) for topic, key, value in records]
            await asyncio.gather(*futures)
            times.append((time.perf_counter() - started) * 1000)
            await asyncio.sleep(gap_s)
    finally:
        await producer.stop()
    times.append((time.process_time() - cpu0) * 1000 / n)
    return times


def _summary(name: str, times: list[float]) -> dict[str, Any]:
    cpu_ms = times.pop()  # appended last by the runner
    a = np.array(times[5:])  # the first few include connection set-up
    return {"case": name, "batches": len(a), "p50_ms": round(float(np.percentile(a, 50)), 2),
            "p99_ms": round(float(np.percentile(a, 99)), 2), "mean_ms": round(float(a.mean()), 2),
            "client_cpu_ms_per_batch": round(cpu_ms, 2)}  # fmt: skip


async def run(bootstrap: str, n: int, gap_s: float, linger_ms: int) -> list[dict[str, Any]]:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        await admin.create_topics(
            [NewTopic(t, PARTITIONS, 1) for t in ("transactions", "decisions", "feedback")] + [NewTopic("monitoring", 1, 1)]
        )
    finally:
        await admin.close()
    rows = [_summary("plain produce (no transaction), awaited", await _plain(bootstrap, n, gap_s))]
    for partitions in (1, 4, 8):
        times = await _transactional(bootstrap, partitions, n, gap_s, str(partitions), linger_ms)
        rows.append(_summary(f"transactional, {partitions} input partition(s)", times))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, default=300)
    parser.add_argument("--gap-ms", type=float, default=10.0)
    parser.add_argument("--linger-ms", type=int, default=2, help="the transactional producers' linger")
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-tx-") as tmp:
        broker = stack.start_broker(workdir=Path(tmp))
        try:
            rows = asyncio.run(run(broker.url, args.batches, args.gap_ms / 1000, args.linger_ms))
        finally:
            broker.stop()
    doc = {"machine": machine_info(), "batch": BATCH, "gap_ms": args.gap_ms, "linger_ms": args.linger_ms, "rows": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "transactions.json").write_text(json.dumps(doc, indent=1))
    for row in rows:
        print(f"{row['case']:<45} p50 {row['p50_ms']:6.2f} ms  p99 {row['p99_ms']:6.2f} ms  "
              f"mean {row['mean_ms']:6.2f} ms  client CPU {row['client_cpu_ms_per_batch']:5.2f} ms/batch")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3.5))
    names = [r["case"] for r in rows]
    ax.barh(names, [r["p50_ms"] for r in rows], label="p50")
    ax.barh(names, [r["p99_ms"] - r["p50_ms"] for r in rows], left=[r["p50_ms"] for r in rows], alpha=0.4, label="p99")
    ax.set_xlabel(f"ms per batch of {BATCH} (decisions + feedback + monitoring), local Kafka, 2 cores")
    ax.invert_yaxis()
    ax.legend()
    fig.tight_layout()
    fig.savefig(args.out / "transactions.png", dpi=100)


if __name__ == "__main__":
    main()
