"""The resend index's costs: a partition's restore at an hour of peak, and the
worker's CPU with and without Redis's decision cache on the hot path.

    python -m bench.index                                  # both parts
    python -m bench.index restore --records 2250000        # one partition: 1 h of 5,000 TPS over 8 partitions
    python -m bench.index cpu --rates 1000 2000 --repeat 2 # alternated in one run

**restore**: a partition of ``decisions`` (the index's changelog) of
``--records`` new decisions (records of the size the worker writes, with
their index entry's header; transactions of 2,000 records), read back by
:class:`app.changelog.ChangelogRestore` into a fresh RocksDB store, in a
process of its own (its CPU and peak memory are its own), then once more by
a restarted store (what a worker that owned the partition before reads).
Disk: the changelog partition's log and the store.

**cpu**: a bench worker with the defaults (the index alone answers resends)
and one with ``FRAUD_DECISION_CACHE_REDIS=true`` (Redis looked up in the
batch's script and written after each commit), and with ``--base PATH`` the
worker of another checkout (the code before the index), alternated, each
fresh, under the bench's own load: CPU ms per decision of worker, broker and
Redis, and latency.

Written to ``bench/results/index.json`` and ``index.png`` (machine info beside
the numbers).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import subprocess
import sys
import time
import uuid
from collections.abc import Sequence
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

__all__ = ["main"]

#: An hour of 5,000 TPS over the default 8 partitions: one partition's changelog.
HOUR_AT_PEAK_PER_PARTITION = 5000 * 3600 // 8
TXN_RECORDS = 2000


def _decision(i: int) -> tuple[Any, bytes]:
    """A transaction and its decision record's bytes, as the scorer makes them."""
    import orjson

    from app.contract import Decision, Transaction

    tx = Transaction(f"t-{i:012d}-{uuid.UUID(int=i).hex[-8:]}", f"u-{i % 50_000:06d}", 10.0 + i % 997, f"m-{i % 5000:05d}",
                     1_796_000_000.0 + i / 5000)  # fmt: skip
    decision = Decision(
        transaction_id=tx.transaction_id, user_id=tx.user_id, fraud_score=0.0123, action="approve",
        explanation=["score 0.012 under the review threshold 0.5"], model_version="20261205T120000",
        rules_version="rules-3f2a", feature_age_s=41234.5, latency_ms={"total": 12.0}, correlation_id="c",
        decided_at=tx.timestamp + 0.02,
    )  # fmt: skip
    return tx, orjson.dumps(decision.to_dict())


def _du_mb(path: Path) -> float:
    total = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    return round(total / 2**20, 1)


def _write_changelog(bootstrap: str, topic: str, records: int) -> dict[str, Any]:
    from confluent_kafka import Producer

    from pipeline.resend_index import ResendIndex

    producer = Producer({"bootstrap.servers": bootstrap, "transactional.id": f"{topic}-writer", "acks": "all",
                         "enable.idempotence": True, "linger.ms": 5})  # fmt: skip
    producer.init_transactions(30.0)
    started = time.monotonic()
    value_bytes = 0
    for start in range(0, records, TXN_RECORDS):
        producer.begin_transaction()
        for i in range(start, min(records, start + TXN_RECORDS)):
            tx, value = _decision(i)
            key = tx.transaction_id.encode()
            value_bytes += len(key) + len(value)
            while True:
                try:
                    producer.produce(topic, value, key, 0, headers=[ResendIndex.entry_header(tx)])
                    break
                except BufferError:
                    producer.poll(0.01)
        producer.commit_transaction(60.0)
    return {"records": records, "write_s": round(time.monotonic() - started, 1),
            "record_bytes": round(value_bytes / max(1, records), 1)}  # fmt: skip


def _restore_child(bootstrap: str, topic: str, store: Path) -> dict[str, Any]:
    """In a process of its own: one restore of partition 0 into ``store``."""
    done = subprocess.run(
        [sys.executable, "-m", "bench.index", "_restore", bootstrap, topic, str(store)],
        capture_output=True, text=True, timeout=3600,
    )  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"restore exited {done.returncode}: {done.stderr[-1500:]}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def _restore_here(bootstrap: str, topic: str, store: Path) -> None:
    from app.changelog import ChangelogRestore
    from pipeline.resend_index import ResendIndex, RocksStore

    index = ResendIndex(RocksStore(store, 3600), 3600)
    restore = ChangelogRestore(topic, index, {"bootstrap.servers": bootstrap}, group_id=f"bench-{topic}", history_s=3600)
    entries: list[int] = []
    restore.on_restored = lambda _p, n, _t: entries.append(n)
    cpu0, t0 = time.process_time(), time.monotonic()
    restore({0})
    took, cpu = time.monotonic() - t0, time.process_time() - cpu0
    index.close()
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"seconds": round(took, 2), "cpu_s": round(cpu, 2), "entries": entries[0],
                      "peak_rss_mb": round(peak_mb, 1)}))  # fmt: skip


def restore_part(svc: Any, workdir: Path, records: int) -> dict[str, Any]:
    from aiokafka.admin import AIOKafkaAdminClient, NewTopic

    from app.settings import Settings
    from app.topics import topic_configs

    topic = f"bench-index-{uuid.uuid4().hex[:8]}"

    async def create() -> None:
        admin = AIOKafkaAdminClient(bootstrap_servers=svc.bootstrap)
        await admin.start()
        try:
            configs = {**topic_configs(Settings())[Settings().topic_decisions], "retention.ms": str(3600 * 1000 * 2)}
            await admin.create_topics([NewTopic(topic, 1, 1, topic_configs=configs)])
        finally:
            await admin.close()

    asyncio.run(create())
    written = _write_changelog(svc.bootstrap, topic, records)
    print(f"index: wrote {records:,} changelog records in {written['write_s']} s", flush=True)
    store = workdir / "store"
    first = _restore_child(svc.bootstrap, topic, store)
    print(f"index: restored in {first['seconds']} s ({first['entries']:,} entries)", flush=True)
    again = _restore_child(svc.bootstrap, topic, store)
    logs = [p for p in workdir.parent.rglob(f"{topic}-0") if p.is_dir()]  # the broker's, under the run's folder
    return {
        "records": records,
        "hour_at_peak_per_partition": HOUR_AT_PEAK_PER_PARTITION,
        **written,
        "restore": first,
        "restore_again": again,
        "store_mb": _du_mb(store),
        "changelog_partition_mb": _du_mb(logs[0]) if logs else None,
        "restore_records_per_s": round(first["entries"] / max(first["seconds"], 1e-9)),
    }


def cpu_part(
    svc: Any, workdir: Path, rates: Sequence[float], repeat: int, base: str | None = None
) -> list[dict[str, Any]]:
    from bench.plan import BATCHED, POPULATION, QUICK_PLAN, Phase
    from bench.report import _row
    from bench.runner import VERIFY_SHARE, Bench
    from bench.verdicts import run_record
    from bench.workers import SAMPLE_EVERY_S, Worker, _sampler
    from tools.loadgen import LoadConfig, run_load

    phase = Phase(5.0, 10.0, 5.0)
    variants: tuple[Any, ...] = (
        BATCHED, replace(BATCHED, name="batched-redis-cache", settings=(("FRAUD_DECISION_CACHE_REDIS", "true"),)),
    )  # fmt: skip
    if base:  # the code before the resend index, from another checkout
        variants += (replace(BATCHED, name="before-index", checkout=base),)
    bench = Bench(QUICK_PLAN, svc, workdir, time.monotonic())
    bench.deadline = float("inf")
    runs: list[dict[str, Any]] = []
    seed = 900
    for rep in range(repeat):
        for variant in variants[rep % len(variants) :] + variants[: rep % len(variants)]:
            handle = bench._start(variant)
            assert isinstance(handle, Worker)  # the inside shape: a bench worker
            try:
                for rate in rates:
                    seed += 1
                    cfg = LoadConfig(
                        rate=rate, duration_s=phase.load_s, warmup_s=phase.warmup_s, drain_s=phase.drain_s,
                        data=POPULATION, seed=seed, report_every_s=SAMPLE_EVERY_S, quiet=True,
                        verify_share=VERIFY_SHARE, settings=handle.settings,
                        sample=_sampler(handle.pids, svc.pids), prebuild=True,
                    )  # fmt: skip
                    summary = asyncio.run(run_load(cfg))
                    record = run_record(variant, "ab", rate, summary, worker=handle.tag, other_pids=tuple(svc.pids))
                    record |= {"repeat": rep, "load_avg_1m": round(os.getloadavg()[0], 2)}
                    record.pop("lag", None)
                    runs.append(record)
                    print(f"index: {variant.name:<20} " + _row(record), flush=True)
            finally:
                bench._stop(handle)
    return runs


def _plot(doc: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    r = doc.get("restore")
    if r:
        names = ["restore s", "restart s", "store MB", "changelog MB", "peak RSS MB"]
        values = [r["restore"]["seconds"], r["restore_again"]["seconds"], r["store_mb"],
                  r["changelog_partition_mb"] or 0, r["restore"]["peak_rss_mb"]]  # fmt: skip
        left.bar(names, values, color="#4c72b0")
        for x, v in enumerate(values):
            left.text(x, v, f"{v:,.1f}", ha="center", va="bottom", fontsize=8)
        left.set_title(f"one partition, {r['records']:,} entries", fontsize=10)
        left.tick_params(axis="x", labelsize=8)
    runs = doc.get("cpu", [])
    for name, color in (("batched", "#4c72b0"), ("batched-redis-cache", "#dd8452"), ("before-index", "#55a868")):
        mine = sorted((x for x in runs if x["variant"] == name and x["cpu_ms_per_decision"]),
                      key=lambda x: x["offered_tps"])  # fmt: skip
        if mine:
            right.plot([x["offered_tps"] for x in mine], [x["cpu_ms_per_decision"]["worker"] for x in mine],
                       "o", color=color, label=f"{name}: worker")  # fmt: skip
            right.plot([x["offered_tps"] for x in mine], [x["cpu_ms_per_decision"]["redis"] for x in mine],
                       "x", color=color, label=f"{name}: Redis")  # fmt: skip
    right.set_xlabel("offered TPS")
    right.set_ylabel("CPU ms per decision")
    right.legend(fontsize=8)
    right.set_title("with and without Redis's decision cache", fontsize=10)
    fig.suptitle(f"resend index, {doc['machine'].get('cpu_model')}, {doc['started_at']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: Sequence[str] | None = None) -> int:
    args_in = list(sys.argv[1:] if argv is None else argv)
    if args_in[:1] == ["_restore"]:
        _restore_here(args_in[1], args_in[2], Path(args_in[3]))
        return 0
    from bench.plan import REPO, RESULTS_DIR
    from bench.procs import machine_info
    from bench.workers import prepare, services

    parser = argparse.ArgumentParser(prog="python -m bench.index", description=__doc__.splitlines()[0])
    parser.add_argument("part", nargs="?", choices=("restore", "cpu", "both"), default="both")
    parser.add_argument("--records", type=int, default=HOUR_AT_PEAK_PER_PARTITION)
    parser.add_argument("--rates", type=float, nargs="+", default=[1000.0, 2000.0])
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--base", help="a checkout of the code before the resend index: its worker as a third variant")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "index.json")
    args = parser.parse_args(args_in)
    started_at = datetime.now(UTC)
    workdir = REPO / ".stack" / "bench" / ("index-" + started_at.strftime("%Y%m%dT%H%M%S"))
    workdir.mkdir(parents=True, exist_ok=True)
    doc: dict[str, Any] = {"schema": "fraud-pipeline-index/1", "started_at": started_at.isoformat(timespec="seconds"),
                           "machine": machine_info()}  # fmt: skip
    with services(workdir) as svc:
        if args.part in ("restore", "both"):
            doc["restore"] = restore_part(svc, workdir / "restore", args.records)
        if args.part in ("cpu", "both"):
            doc["prepared"] = prepare(svc)
            doc["cpu"] = cpu_part(svc, workdir, args.rates, args.repeat, args.base)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    _plot(doc, args.out.with_suffix(".png"))
    print(json.dumps({k: v for k, v in doc.items() if k != "cpu"}, indent=1))
    print(f"results: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
