"""Why the two load shapes disagree: their differences taken apart, alternated in one run.

    python -m bench.shapes                          # 1,000 and 2,000 TPS, each cell once
    python -m bench.shapes --rates 1000 2000 --repeat 2

The inside shape (``bench/runner.py``'s own) and the outside shape
(:mod:`bench.outside`) differ in two halves, measured here as a 2 × 2 plus
the arrivals:

* the **worker**: ``bench`` (a :class:`bench.workers.Worker`: the bench's own
  topics and environment, a probe answered before load) or ``default``
  (``fraud-pipeline topics`` and ``fraud-pipeline worker --role score`` with
  default settings, Ready only);
* the **load**: ``inside`` (:func:`tools.loadgen.run_load` in this process:
  transactions built before the clock starts, Poisson, linger 5 ms, the
  latency clock in the sending process) or ``outside`` (a generator process
  building and signing at send time with librdkafka's defaults, a separate
  read_committed stamper process), constant or Poisson.

Each cell gets a fresh worker, measured at every rate in turn (as a client
measures one deployment), all with the same warm-up and length; the cells
rotate so that none always runs first. Written to
``bench/results/shapes-ab.json`` (machine info beside the numbers).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import time
from collections.abc import Sequence
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

__all__ = ["CELLS", "main", "summary_table"]

#: (worker, load, arrivals) of every cell.
CELLS = (
    ("bench", "inside", "poisson"),
    ("bench", "outside", "constant"),
    ("default", "inside", "poisson"),
    ("default", "outside", "constant"),
    ("default", "outside", "poisson"),
)


def cell_name(cell: Sequence[str]) -> str:
    worker, load, arrivals = cell
    return f"{worker} worker, {load} load ({arrivals})"


def summary_table(runs: Sequence[dict[str, Any]]) -> list[str]:
    """One line per cell and rate: the median of its repeats' p50 / p99, achieved
    rate and CPU ms per decision (worker / broker / Redis)."""
    import numpy as np

    lines = []
    keys = sorted({(r["cell"], r["offered_tps"]) for r in runs}, key=lambda k: (k[1], k[0]))
    for cell, rate in keys:
        mine = [r for r in runs if r["cell"] == cell and r["offered_tps"] == rate]

        def med(get: Any, mine: list[dict[str, Any]] = mine) -> float | None:
            values = [v for v in (get(r) for r in mine) if v is not None]
            return round(float(np.median(values)), 2) if values else None

        cpu = [med(lambda r, k=k: (r["cpu_ms_per_decision"] or {}).get(k)) for k in ("worker", "broker", "redis")]
        # Where the latency went: waiting to be taken, decided, and after (commit, read back).
        parts = [
            f"{name} {med(lambda r, s=stage: _stage(r, s, 'p50'))}/{med(lambda r, s=stage: _stage(r, s, 'p99'))}"
            for name, stage in (("taken", "queue_wait"), ("decided", "total"), ("after", "after"))
        ]
        lines.append(
            f"{rate:>7,.0f}  {cell:<42} n={len(mine)}  achieved {med(lambda r: r['achieved_tps'])}  "
            f"p50 {med(lambda r: r['p50_ms'])}  p99 {med(lambda r: r['p99_ms'])}  cpu ms/decision "
            + "/".join("-" if c is None else f"{c:.3f}" for c in cpu)
            + "  p50/p99 ms " + "  ".join(parts)
        )
    return lines


def _stage(run: dict[str, Any], stage: str, pct: str) -> float | None:
    value = ((run.get("stages") or {}).get(stage) or {}).get(pct)
    return None if value is None else float(value)


def main(argv: Sequence[str] | None = None) -> int:
    from bench.outside import OutsideError, OutsideSession
    from bench.plan import BATCHED, OUTSIDE, POPULATION, QUICK_PLAN, REPO, RESULTS_DIR, Phase
    from bench.procs import machine_info
    from bench.report import _row
    from bench.runner import VERIFY_SHARE, Bench
    from bench.verdicts import run_record
    from bench.workers import (
        SAMPLE_EVERY_S,
        OutsideWorkers,
        WorkerError,
        _cli,
        _sampler,
        prepare,
        services,
        settings_from_env,
    )
    from tools.loadgen import LoadConfig, run_load

    parser = argparse.ArgumentParser(prog="python -m bench.shapes", description=__doc__.splitlines()[0])
    parser.add_argument("--rates", type=float, nargs="+", default=[1000.0, 2000.0])
    parser.add_argument("--repeat", type=int, default=1)
    parser.add_argument("--warmup", type=float, default=5.0)
    parser.add_argument("--measure", type=float, default=8.0)
    parser.add_argument("--drain", type=float, default=5.0)
    parser.add_argument(
        "--cells", type=int, nargs="+", help="which of CELLS to run (0-based; default all): "
        + "; ".join(f"{i} {cell_name(c)}" for i, c in enumerate(CELLS)),
    )  # fmt: skip
    parser.add_argument("--out", type=Path, default=RESULTS_DIR / "shapes-ab.json")
    args = parser.parse_args(argv)

    # SIGTERM unwinds like Ctrl-C: the finally blocks stop every worker, the broker and Redis.
    def on_term(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    phase = Phase(args.warmup, args.measure, args.drain)
    started_at = datetime.now(UTC)
    started = time.monotonic()
    workdir = REPO / ".stack" / "bench" / ("shapes-" + started_at.strftime("%Y%m%dT%H%M%S"))
    machine = machine_info()
    runs: list[dict[str, Any]] = []
    errors: list[str] = []
    with services(workdir) as svc:
        prepared = prepare(svc)
        bench = Bench(QUICK_PLAN, svc, workdir, started)
        bench.deadline = float("inf")
        seed = 500
        for rep in range(args.repeat):
            cells = tuple(CELLS[i] for i in args.cells) if args.cells else CELLS
            order = cells[rep % len(cells) :] + cells[: rep % len(cells)]
            for cell in order:
                worker_kind, load, arrivals = cell
                variant = replace(
                    OUTSIDE if worker_kind == "default" else BATCHED, arrivals=arrivals
                )
                handle: Any = None
                try:
                    handle = bench._start(variant)
                    if isinstance(handle, OutsideWorkers):
                        env, pids = handle.session.env, []
                        settings = settings_from_env(env)
                    else:
                        env = {
                            **svc.env(),
                            **{f"FRAUD_TOPIC_{n.upper()}": t for n, t in handle.topics.items()},
                        }
                        pids, settings = handle.pids, handle.settings
                    for rate in args.rates:
                        seed += 1
                        if load == "outside":
                            session = OutsideSession(env, svc.pids, workdir, POPULATION, _cli(), 0)
                            session.extra_pids = pids or handle.session.worker_pids
                            summary, _, _ = session.run(
                                rate, arrivals=arrivals, warmup_s=phase.warmup_s, measure_s=phase.measure_s,
                                drain_s=phase.drain_s, seed=seed,
                            )  # fmt: skip
                            others: tuple[str, ...] = ("stamper", *svc.pids)
                        else:
                            worker_pids = pids or handle.session.worker_pids
                            cfg = LoadConfig(
                                rate=rate, duration_s=phase.load_s, warmup_s=phase.warmup_s, drain_s=phase.drain_s,
                                data=POPULATION, seed=seed, report_every_s=SAMPLE_EVERY_S,
                                quiet=True, verify_share=VERIFY_SHARE, settings=settings,
                                sample=_sampler(worker_pids, svc.pids), prebuild=True,
                            )  # fmt: skip
                            summary = asyncio.run(run_load(cfg))
                            others = tuple(svc.pids)
                        record = run_record(
                            variant, "ab", rate, summary, worker=handle.tag, other_pids=others
                        )
                        # The machine is shared: its load beside each run says how far to trust it.
                        record |= {"cell": cell_name(cell), "repeat": rep, "load": load,
                                   "load_avg_1m": round(os.getloadavg()[0], 2)}  # fmt: skip
                        record.pop("lag")
                        runs.append(record)
                        print(f"shapes: {cell_name(cell):<42} " + _row(record), flush=True)
                except (WorkerError, OutsideError) as exc:
                    errors.append(f"{cell_name(cell)}: {exc}")
                    print(f"shapes: {cell_name(cell)}: {exc}", file=sys.stderr, flush=True)
                finally:
                    bench._stop(handle)
    doc = {
        "schema": "fraud-pipeline-shapes/1",
        "started_at": started_at.isoformat(timespec="seconds"),
        "duration_s": round(time.monotonic() - started, 1),
        "machine": machine,
        "phase": {"warmup_s": phase.warmup_s, "measure_s": phase.measure_s, "drain_s": phase.drain_s},
        "prepared": prepared,
        "cells": [cell_name(CELLS[i]) for i in args.cells] if args.cells else [cell_name(c) for c in CELLS],
        "runs": runs,
        "summary": summary_table(runs),
        "errors": errors,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    print("\n".join(summary_table(runs)))
    print(f"results: {args.out}")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
