"""Training at scale: time and peak memory per stage (``python -m bench.training --rows 10000000``).

Runs what ``fraud-pipeline train`` runs, in this process, on simulated data of
about ``--rows`` transactions (60 days; users sized to give that many rows),
and records per stage: wall seconds, CPU seconds, and the peak resident memory
(RSS sampled every 50 ms from ``/proc/self/status``, plus the kernel's
high-water mark). Stages: load (read the Parquet file), prepare, features,
validate <member> (prequential fits), fit <member> (refit on the training
window), fit baseline, evaluate, report, register. Simulating the data is not
part of training: it is timed separately and the file is cached (``--data``).

Writes ``bench/results/training-<rows>.json`` and ``.png`` with the machine
(cores, CPU model, load average before and after) beside the numbers.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench.procs import machine_info

__all__ = ["StageMeter", "main", "plot"]

#: Rows per user over 60 days in the simulator (measured: 588,130 rows from 5,000 users).
ROWS_PER_USER_60D = 117.6


class StageMeter:
    """Times named stages and samples this process's RSS while each runs."""

    def __init__(self, every_s: float = 0.05) -> None:
        self.stages: list[dict[str, Any]] = []
        self._every = every_s
        self._peak = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._stop.wait(self._every):
            self._peak = max(self._peak, rss_mb())

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        self._peak = rss_mb()
        wall, cpu = time.perf_counter(), time.process_time()
        try:
            yield
        finally:
            self._peak = max(self._peak, rss_mb())
            self.stages.append({
                "stage": name, "wall_s": round(time.perf_counter() - wall, 2),
                "cpu_s": round(time.process_time() - cpu, 2), "peak_rss_mb": round(self._peak, 1),
            })  # fmt: skip
            print(f"{name:<22} {self.stages[-1]['wall_s']:>8.1f} s wall {self.stages[-1]['cpu_s']:>8.1f} s cpu "
                  f"{self._peak:>9.0f} MiB peak RSS", flush=True)  # fmt: skip

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


def rss_mb() -> float:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return 0.0


def high_water_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # kB on Linux


def simulate_file(rows: int, path: Path, seed: int) -> dict[str, Any]:
    """Simulate ~``rows`` transactions to ``path`` unless it exists (not part of training)."""
    from tools.simulator import SimulationConfig, simulate, write_parquet

    if path.exists():
        return {"cached": str(path)}
    users = max(200, int(round(rows / ROWS_PER_USER_60D)))
    end = datetime.now(UTC).replace(hour=0, minute=0, second=0, microsecond=0)
    started = time.perf_counter()
    frame = simulate(SimulationConfig(n_users=users, n_merchants=2 * users, days=60, seed=seed, end=end), progress=False)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_parquet(frame, path)
    return {"users": users, "rows": len(frame), "wall_s": round(time.perf_counter() - started, 1),
            "high_water_rss_mb": round(high_water_mb(), 1)}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=10_000_000)
    parser.add_argument("--data", type=Path, help="transactions to train on (default: simulated, cached in the temp dir)")
    parser.add_argument("--search", choices=("light", "full"), default="light")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    args = parser.parse_args()

    from models.training import TrainConfig, format_metrics, train
    from pipeline.datafile import read_transactions

    data = args.data or Path(tempfile.gettempdir()) / f"fraud-bench-{args.rows}.parquet"
    simulated = simulate_file(args.rows, data, args.seed) if args.data is None else {"given": data.name}  # the name only: results are committed
    machine = machine_info()
    meter = StageMeter()
    started = time.perf_counter()
    with meter("load"):
        raw = [read_transactions(data).frame]
    rows = len(raw[0])
    with tempfile.TemporaryDirectory(prefix="bench-training-") as registry:
        # As the CLI does: train gets the only reference to the raw frame, and frees it once prepared.
        result = train(raw.pop(), Path(registry), TrainConfig(threads=args.threads, search=args.search),
                       progress=False, stage=meter)  # fmt: skip
    total = time.perf_counter() - started
    meter.close()
    print(format_metrics(result.metrics, result.window))
    doc = {
        "rows": rows,
        "search": args.search,
        "threads": args.threads,
        "total_wall_s": round(total, 1),
        "high_water_rss_mb": round(high_water_mb(), 1),
        "stages": meter.stages,
        "simulate": simulated,
        "window": {k: result.window.get(k) for k in ("train", "test", "train_rows", "test_rows", "evaluated_rows")},
        "metrics": result.metrics,
        "machine": {**machine, "load_avg_at_end": list(os.getloadavg())},
        "at": datetime.now(UTC).isoformat(timespec="seconds"),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / f"training-{rows}"
    stem.with_suffix(".json").write_text(json.dumps(doc, indent=2) + "\n")
    plot(doc, stem.with_suffix(".png"))
    print(f"total {total:.1f} s, high-water RSS {doc['high_water_rss_mb']:.0f} MiB; "
          f"wrote {stem.with_suffix('.json')} and {stem.with_suffix('.png')}")  # fmt: skip


def plot(doc: dict[str, Any], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    stages = doc["stages"]
    names = [s["stage"] for s in stages]
    fig, (time_ax, mem_ax) = plt.subplots(1, 2, figsize=(12, 0.35 * len(names) + 2), sharey=True)
    y = range(len(names))
    time_ax.barh(y, [s["wall_s"] for s in stages], label="wall")
    time_ax.barh(y, [s["cpu_s"] for s in stages], height=0.35, label="cpu")
    time_ax.set(yticks=list(y), yticklabels=names, xlabel="seconds", title=f"time per stage (total {doc['total_wall_s']} s)")
    time_ax.invert_yaxis()
    time_ax.legend(fontsize=8)
    mem_ax.barh(y, [s["peak_rss_mb"] / 1024 for s in stages], color="tab:red")
    mem_ax.set(xlabel="GiB", title=f"peak RSS per stage (high water {doc['high_water_rss_mb'] / 1024:.1f} GiB)")
    m = doc["machine"]
    fig.suptitle(f"fraud-pipeline train, {doc['rows']:,} rows, search {doc['search']}: {m['cores']} cores, "
                 f"{m['cpu_model']}, load {m['load_avg_at_start'][0]:.1f} at start", fontsize=9)  # fmt: skip
    for ax in (time_ax, mem_ax):
        ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


if __name__ == "__main__":
    main()
