"""Worker memory under steady load: RSS over minutes (``python -m bench.memory``).

One batched worker at a rate it sustains, for ``--minutes``; the worker's RSS is
sampled twice a second. A worker whose state is bounded (TTLs in Redis, LRU/TTL
caches, bounded partition books) holds a flat RSS after warm-up; a leak shows
as a slope. Writes ``bench/results/memory.json`` and ``memory.png``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from bench.plan import BATCHED, DATA, Phase
from bench.procs import machine_info
from bench.workers import SAMPLE_EVERY_S, Worker, _sampler, prepare, services
from tools.loadgen import LoadConfig, run_load


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", type=float, default=100.0)
    parser.add_argument("--minutes", type=float, default=5.0)
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    args = parser.parse_args()
    phase = Phase(warmup_s=10.0, measure_s=args.minutes * 60, drain_s=15.0)
    with tempfile.TemporaryDirectory(prefix="bench-memory-") as tmp, services(Path(tmp)) as svc:
        prepare(svc)
        worker = Worker(BATCHED, svc, Path(tmp))
        try:
            worker.wait_ready()
            cfg = LoadConfig(
                rate=args.rate, duration_s=phase.load_s, warmup_s=phase.warmup_s, drain_s=phase.drain_s,
                data=DATA, seed=7, report_every_s=SAMPLE_EVERY_S, quiet=True,
                settings=worker.settings, sample=_sampler([worker.pid], svc.pids),
            )  # fmt: skip
            summary = asyncio.run(run_load(cfg))
        finally:
            worker.stop()
    lat = summary["latency_ms"]
    run = {"achieved_tps": summary["achieved_rate"], "p50_ms": lat["p50"], "p99_ms": lat["p99"], "lost": summary["lost"]}
    # (seconds, RSS MB, transactions sent and not yet decided): a backlog is
    # held in faust's buffers, so RSS that steps up with it is not a leak.
    samples = [
        (e["t"], e["rss_mb"], e.get("in_flight")) for e in summary.get("timeline", []) if e.get("rss_mb") is not None
    ]
    t = np.array([s[0] for s in samples])
    rss = np.array([s[1] for s in samples])
    steady = t >= phase.warmup_s + 30  # after warm-up and the first half-minute
    slope = float(np.polyfit(t[steady] / 60, rss[steady], 1)[0]) if steady.sum() > 2 else None
    # While the system keeps up (under a second of arrivals in flight): a
    # backlog is held in faust's buffers, so RSS that grows with it is not the
    # worker's state growing.
    backlog_at = next((s[0] for s in samples if s[0] >= phase.warmup_s and (s[2] or 0) > args.rate), None)
    kept_up = steady & (t < backlog_at) if backlog_at is not None else steady
    slope_kept_up = float(np.polyfit(t[kept_up] / 60, rss[kept_up], 1)[0]) if kept_up.sum() > 2 else None
    doc: dict[str, Any] = {
        "machine": machine_info(),
        "rate": args.rate,
        "minutes": args.minutes,
        "achieved_tps": run["achieved_tps"],
        "p50_ms": run["p50_ms"],
        "p99_ms": run["p99_ms"],
        "lost": run["lost"],
        "rss_mb_first_steady": round(float(rss[steady][0]), 1) if steady.any() else None,
        "rss_mb_last": round(float(rss[-1]), 1) if len(rss) else None,
        "rss_mb_max": round(float(rss.max()), 1) if len(rss) else None,
        "rss_slope_mb_per_min": round(slope, 3) if slope is not None else None,
        "backlog_from_s": backlog_at,
        "rss_slope_kept_up_mb_per_min": round(slope_kept_up, 3) if slope_kept_up is not None else None,
        "per_minute": per_minute(summary.get("timeline", [])),
        "samples": samples,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "memory.json").write_text(json.dumps(doc, indent=1))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    ax.plot(t / 60, rss, lw=1, label="worker RSS")
    ax.set_xlabel("minutes")
    ax.set_ylabel("worker RSS (MB)")
    backlog = ax.twinx()
    backlog.plot(t / 60, [s[2] or 0 for s in samples], lw=0.8, color="tab:red", alpha=0.6, label="in flight")
    backlog.set_ylabel("transactions in flight (sent, not decided)", color="tab:red")
    if backlog_at is not None:
        ax.axvline(backlog_at / 60, color="gray", ls=":", lw=1)
    ax.set_title(
        f"batched worker at {args.rate:g} TPS offered (2 cores): RSS {doc['rss_slope_kept_up_mb_per_min']} MB/min "
        f"while it keeps up, {doc['rss_slope_mb_per_min']} overall",
        fontsize=9,
    )
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(args.out / "memory.png", dpi=100)
    print(json.dumps({k: v for k, v in doc.items() if k not in ("samples", "per_minute")}))
    for row in doc["per_minute"]:
        print(json.dumps(row))


def per_minute(timeline: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per minute of load: decisions per second, the worker's and the broker's
    CPU ms per decision, transactions in flight and RSS at the minute's end —
    which process slows when a long run backs up."""
    rows: list[dict[str, Any]] = []
    prev: dict[str, Any] | None = None
    for e in timeline:
        if prev is None:
            prev = e
            continue
        if e["t"] - prev["t"] < 60 and e is not timeline[-1]:
            continue
        span, decided = e["t"] - prev["t"], e.get("decided", 0) - prev.get("decided", 0)

        def ms_per_decision(key: str, a: dict[str, Any] = prev, b: dict[str, Any] = e, n: int = decided) -> float | None:
            if b.get(key) is None or a.get(key) is None or n <= 0:
                return None
            ms: float = round(1000 * (b[key] - a[key]) / n, 3)
            return ms

        rows.append({
            "minute": round(e["t"] / 60, 2),
            "decided_per_s": round(decided / span, 1) if span > 0 else None,
            "worker_cpu_ms_per_decision": ms_per_decision("cpu_s"),
            "broker_cpu_ms_per_decision": ms_per_decision("broker_cpu_s"),
            "loadgen_cpu_ms_per_decision": ms_per_decision("loadgen_cpu_s"),
            "in_flight": e.get("in_flight"),
            "rss_mb": e.get("rss_mb"),
        })  # fmt: skip
        prev = e
    return rows


if __name__ == "__main__":
    main()
