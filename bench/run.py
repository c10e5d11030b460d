"""The benchmark: transport ceiling, Kafka Streams peer, unbatched and batched pipeline, one broker, one run.

    python -m bench.run            # full: about 18 minutes
    python -m bench.run --quick    # 1,000 TPS and one search probe, short runs, no sweep: about 3 minutes

Every variant gets its own worker subprocess on fresh topics, a probe transaction that must come back before load
starts, warm-up seconds left out of every figure, and open-loop Poisson load
from :func:`tools.loadgen.run_load`. Variants:

    ceiling      ``python -m bench.passthrough``: same faust settings and take
                 batching as ``batched``, forwards bytes instead of scoring
    streams      ``python -m bench.streams_peer``: the peer, a Kafka Streams
                 exactly_once_v2 pass-through (bench/streams/, ``make streams``)
                 at Kafka Streams' default 100 ms commit interval
    streams-25ms the same at 25 ms, the pipeline's own commit interval
    unbatched    ``fraud-pipeline worker`` with FRAUD_BATCH_SIZE=1
    batched      ``fraud-pipeline worker`` with the default settings (64 per batch, 10 ms window)
    sweep-S-MS   batch size S × window MS ms, at one rate (full mode only)

Before them, 20 s of the batched pipeline at 1,000 TPS warm the new broker
(nothing kept); after them, a fresh worker's first seconds:

    fresh            a fresh worker's first 5 s after it logs Ready, under
                     load at 1,500 TPS (outside shape; full mode only)

Then the legs (:class:`Leg`), each at its own rates with its own searches:

    outside          the batched pipeline as an independent client loads it
                     (bench/outside.py): a constant-rate generator process, a
                     read_committed stamper process, topics from
                     ``fraud-pipeline topics``, ``fraud-pipeline worker --role
                     score`` with default settings; 5 s of warm-up
    outside-poisson  the same with Poisson arrivals (full mode only)
    batched-x2       two batched workers in one group (full mode only)
    outside-x2       two workers under the outside shape, its knee from 4,000 TPS (full mode only)

and the report says whether ``batched`` and ``outside`` agree within 10 % on
the max rate, p99 and CPU per decision (``shapes`` in the results).

For each main variant it then searches the highest offered rate that
keeps p99 under 200 ms and under 50 ms (see :func:`next_probe`). A run passes a
threshold only if nothing was lost, at most 1 % of decisions were degraded
(the model missed its budget, so the rules alone decided) and the generator
kept its schedule (p99 of its sends' lateness under 100 ms). "Lag" is the number of transactions still awaiting
their decision, sampled every half second: end-to-end consumer lag.

Results go to ``bench/results/latest.json`` (plus a timestamped copy), PNGs
from :mod:`bench.plots` next to it, a table to stdout, and the figures README.md
and docs/performance.md quote into their generated blocks (:mod:`bench.figures`). Worker, broker and
Redis logs stay in ``.stack/bench/<timestamp>/``.
"""


from __future__ import annotations

import argparse
import logging
import signal
import sys
import time
from collections.abc import Sequence
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench import streams_peer
from bench.plan import BATCHED, FULL_PLAN, QUICK_PLAN, REPO, RESULTS_DIR, Variant, sweep_variants
from bench.procs import machine_info, python_loop_ms
from bench.report import SCHEMA, _plan_doc, _settings_doc, format_report, write_results
from bench.runner import Bench
from bench.verdicts import (
    cpu_by_rate,
    cpu_per_decision_by_variant,
    ratios,
    scaling_doc,
    shapes_doc,
    throughput_ratios,
    validate_results,
)  # fmt: skip
from bench.workers import prepare, services

__all__ = ["main"]

#: Seconds kept for a fresh worker's first seconds (a worker start, 5 s of load,
#: a drain of 10 s, a stop, with room for a slow start).
FRESH_RESERVE_S = 45.0

log = logging.getLogger("bench")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help="1,000 TPS and one search probe per variant, short runs, no sweep"
    )
    parser.add_argument("--rates", type=float, nargs="+", help="override the offered rates (TPS)")
    parser.add_argument("--sweep-rate", type=float, help="offered rate of the sweep runs (TPS)")
    parser.add_argument("--sweep-sizes", type=int, nargs="+", help="batch sizes of the sweep (default 8 16 32 64)")
    parser.add_argument("--sweep-windows-ms", type=int, nargs="+", help="batch windows of the sweep (default 5 10 20)")
    parser.add_argument("--no-sweep", action="store_true")
    parser.add_argument(
        "--only", nargs="+", metavar="NAME",
        help="measure only these of the main variants, the legs (outside, outside-poisson, batched-x2, outside-x2) and fresh; "
        "with --full-legs, the full plan's legs and fresh row in a quick run",
    )  # fmt: skip
    parser.add_argument("--full-legs", action="store_true", help="the full plan's legs and fresh row (with --quick)")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR, help="results folder")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    plan = QUICK_PLAN if args.quick else FULL_PLAN
    if args.rates:
        plan = replace(plan, rates=tuple(sorted(args.rates)))
    if args.sweep_rate:
        plan = replace(plan, sweep_rate=args.sweep_rate)
    if args.sweep_sizes or args.sweep_windows_ms:
        plan = replace(
            plan, sweep=sweep_variants(args.sweep_sizes or (8, 16, 32, 64), args.sweep_windows_ms or (5, 10, 20))
        )
    if args.no_sweep:
        plan = replace(plan, sweep=())
    if args.full_legs:
        plan = replace(plan, legs=FULL_PLAN.legs, fresh_rate=FULL_PLAN.fresh_rate, deadline_s=FULL_PLAN.deadline_s)
    main_variants: tuple[Variant, ...] = plan.variants
    if args.only:
        main_variants = tuple(v for v in plan.variants if v.name in args.only)
        plan = replace(
            plan, legs=tuple(leg for leg in plan.legs if leg.variant.name in args.only),
            fresh_rate=plan.fresh_rate if "fresh" in args.only else None,
        )  # fmt: skip

    # SIGTERM (make killed, CI timeout) unwinds like Ctrl-C, so every worker,
    # the broker and Redis are stopped by the finally blocks below.
    def on_term(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    started = time.monotonic()
    started_at = datetime.now(UTC)
    workdir = REPO / ".stack" / "bench" / started_at.strftime("%Y%m%dT%H%M%S")
    machine = machine_info()
    with services(workdir) as svc:
        prepared = prepare(svc)
        bench = Bench(plan, svc, workdir, started)
        legs_s = sum(leg.min_s for leg in plan.legs)
        bench.reserve_s = legs_s + (FRESH_RESERVE_S if plan.fresh_rate else 0.0)
        bench.warm_broker(BATCHED)
        for variant in main_variants:
            bench.main_variant(variant)
        # NOTE: the fresh worker before the legs: after them, their searches
        # had spent its time in the last two runs, and a goal went unmeasured.
        bench.reserve_s = legs_s
        bench.fresh()
        for leg in plan.legs:
            bench.reserve_s -= leg.min_s
            bench.main_variant(leg.variant, leg)
        bench.reserve_s = 0.0
        bench.sweep()
        settings = _settings_doc(svc)
    machine["python_loop_ms_at_end"] = python_loop_ms()
    doc: dict[str, Any] = {
        "schema": SCHEMA,
        "quick": plan.quick,
        "started_at": started_at.isoformat(timespec="seconds"),
        "duration_s": round(time.monotonic() - started, 1),
        "machine": machine,
        "settings": settings,
        "plan": _plan_doc(plan),
        "prepared": prepared,
        "runs": bench.runs,
        "max_sustainable": bench.max_sustainable,
        "ratios": ratios(bench.max_sustainable, 200.0),
        "ratios_p99_under_50ms": ratios(bench.max_sustainable, 50.0),
        "throughput_ratios": throughput_ratios(bench.runs),
        "cpu_ms_per_decision": cpu_per_decision_by_variant(bench.runs),
        "cpu_ms_per_decision_by_rate": cpu_by_rate(bench.runs),
        "against_peer": streams_peer.against_peer(bench.runs),
        "shapes": shapes_doc(bench.runs, bench.max_sustainable),
        "scaling": scaling_doc(bench.max_sustainable),
        "first_seconds": next((r["first_seconds"] for r in bench.runs if r.get("first_seconds")), None),
        "truncated": bench.truncated,
        "errors": bench.errors,
        "logs": str(workdir.relative_to(REPO)),  # relative: results are committed
    }
    for problem in validate_results(doc):
        log.warning("results: %s", problem)
    latest = write_results(doc, args.out)
    if args.out.resolve() == RESULTS_DIR:  # the committed results: the docs quote them (bench/figures.py)
        from bench.figures import update_docs

        for changed in update_docs(doc):
            print(f"docs:    {changed.relative_to(REPO)}")
    try:
        from bench.plots import plot_all

        pngs = plot_all(doc, args.out)
    except Exception:  # plots are a convenience: the numbers are already written
        log.exception("plotting failed")
        pngs = []
    print()
    print(format_report(doc))
    print(f"\nresults: {latest.relative_to(REPO) if latest.is_relative_to(REPO) else latest}")
    for png in pngs:
        print(f"plot:    {png.relative_to(REPO) if png.is_relative_to(REPO) else png}")
    return 1 if bench.errors else 0


if __name__ == "__main__":
    sys.exit(main())
