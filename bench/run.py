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

Then the legs (:class:`Leg`), each at its own rates with its own searches:

    outside          the batched pipeline as an independent client loads it
                     (bench/outside.py): a constant-rate generator process, a
                     read_committed stamper process, topics from
                     ``fraud-pipeline topics``, ``fraud-pipeline worker --role
                     score`` with default settings; 5 s of warm-up
    outside-poisson  the same with Poisson arrivals (full mode only)
    batched-x2       two batched workers in one group (full mode only)
    fresh            a fresh worker's first 5 s after it logs Ready, under
                     load at 1,500 TPS (outside shape; full mode only)

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
import asyncio
import contextlib
import json
import logging
import os
import platform
import secrets
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench import streams_peer
from bench.criteria import GENERATOR_LAG_LIMIT_MS, THRESHOLDS_MS, generator_kept_up
from bench.outside import OutsideError
from bench.procs import parse_stat_cpu_s, parse_status_rss_mb, proc_cpu_s, proc_rss_mb

__all__ = [
    "FULL_PLAN",
    "QUICK_PLAN",
    "Leg",
    "OutsideWorkers",
    "Plan",
    "Variant",
    "bracket",
    "cpu_pct_between",
    "format_report",
    "generator_kept_up",
    "main",
    "next_probe",
    "parse_stat_cpu_s",
    "parse_status_rss_mb",
    "passes",
    "ratios",
    "run_record",
    "saturated_tps",
    "scaling_doc",
    "shape_figures",
    "shapes_doc",
    "sustainable",
    "validate_results",
]

log = logging.getLogger("bench")

REPO = Path(__file__).resolve().parents[1]
RESULTS_DIR = REPO / "bench" / "results"
DATA = REPO / "data" / "transactions.parquet"
SCHEMA = "fraud-pipeline-bench/1"

MAX_DEGRADED_FRACTION = 0.01
#: Share of decisions whose Ed25519 signature the generator checks: each check
#: costs it about what the rest of a decision does, and the generator shares
#: the cores it measures (tools/loadgen.py).
VERIFY_SHARE = 0.02
#: A worker that never prints "Ready" or never answers the probe is given up on.
READY_TIMEOUT_S = 90.0
PROBE_TIMEOUT_S = 45.0
STOP_TIMEOUT_S = 10.0
SAMPLE_EVERY_S = 0.5
#: The client id the load generator signs as (tools.loadgen prefers "loadgen").
BENCH_CLIENT = "loadgen"
#: NOTE: the simulated population is 2,000 users, so at 5,000 TPS every user
#: would be over the per-user limit (2/s), which traffic spread over a real
#: card base is not: answers would be "rate_limited" rejects, not scores. The
#: limiter still runs (its Redis round trip is part of the cost); it never bites.
BENCH_RATE_LIMITS = {
    "FRAUD_RATE_USER_PER_S": "1e9",
    "FRAUD_RATE_USER_BURST": "1e9",
    "FRAUD_RATE_CLIENT_PER_S": "1e9",
    "FRAUD_RATE_CLIENT_BURST": "1e9",
}
#: The same small population ``make simulate`` builds.
SIMULATE_ARGS = ("--users", "2000", "--merchants", "4000", "--days", "45")
#: The population the load comes from, materialized into Redis (the model is
#: trained on DATA). NOTE: sized for the rates measured: with make simulate's
#: 2,000 users, 2,000 TPS is every user paying once a second, and each
#: decision's velocity window held the card's last hundreds of payments: the
#: bench measured a card-testing attack on every card, not traffic. With 50,000
#: users, 2,000 TPS is each paying every 25 s: still far above real cards, so
#: a busy card reaches the velocity cap (pipeline/feature_defs.py) in minutes.
POPULATION = REPO / "data" / "bench-population.parquet"
POPULATION_ARGS = ("--users", "50000", "--merchants", "20000", "--days", "20")


def threshold_key(threshold_ms: float) -> str:
    return f"p99_under_{threshold_ms:g}ms"


# --- the plan -------------------------------------------------------------------------


@dataclass(frozen=True)
class Variant:
    """One worker configuration."""

    name: str
    kind: str
    """``bare`` (bench/bare.py), ``faust`` (bench/passthrough.py), ``streams`` (the Kafka
    Streams peer, bench/streams_peer.py) or ``pipeline`` (the worker)."""
    batch_size: int
    batch_window_s: float
    commit_interval_s: float | None = None
    """The pipeline's FRAUD_COMMIT_INTERVAL_S, or Kafka Streams' commit.interval.ms
    for ``streams`` (None: the default, each its own)."""
    workers: int = 1
    """Processes in one consumer group on the variant's topics (scaling by partitions)."""
    shape: str = "inside"
    """How load reaches it: ``inside`` (:func:`tools.loadgen.run_load` in the
    harness, the worker on the bench's topics and settings) or ``outside``
    (:mod:`bench.outside`: generator and stamper processes, default topics,
    ``fraud-pipeline worker`` with default settings; only ``kind`` pipeline)."""
    arrivals: str = "poisson"
    """``poisson`` or ``constant`` (the outside shape's generator offers both)."""

    @property
    def passthrough(self) -> bool:
        return self.kind != "pipeline"

    def env(self) -> dict[str, str]:
        env = {"FRAUD_BATCH_SIZE": str(self.batch_size), "FRAUD_BATCH_WINDOW_S": str(self.batch_window_s)}
        if self.commit_interval_s is not None and self.kind == "pipeline":
            env["FRAUD_COMMIT_INTERVAL_S"] = str(self.commit_interval_s)
        if self.passthrough:  # forwards transactions unsigned: nothing to verify
            env["FRAUD_DECISION_PUBLIC_KEYS"] = ""
        return env


def _default(name: str) -> Any:
    from app.settings import Settings

    return Settings.model_fields[name].default


#: What a worker ships with: the batched variant measures the defaults.
DEFAULT_BATCH = (_default("batch_size"), _default("batch_window_s"))
# The pass-throughs take batches as ``batched`` does, so scoring (and, against
# ``bare``, faust's stream) is the only difference.
BARE = Variant("bare", kind="bare", batch_size=DEFAULT_BATCH[0], batch_window_s=DEFAULT_BATCH[1])
CEILING = Variant("ceiling", kind="faust", batch_size=DEFAULT_BATCH[0], batch_window_s=DEFAULT_BATCH[1])
# Unbatched: one record per batch and per transaction, as a worker without micro-batches would.
UNBATCHED = Variant("unbatched", kind="pipeline", batch_size=1, batch_window_s=DEFAULT_BATCH[1], commit_interval_s=0.0)
BATCHED = Variant("batched", kind="pipeline", batch_size=DEFAULT_BATCH[0], batch_window_s=DEFAULT_BATCH[1])
# The peer: Kafka Streams exactly_once_v2 at its default commit interval and at a short one
# (the batch fields are only recorded: Kafka Streams processes what each poll returns).
STREAMS = Variant("streams", kind="streams", batch_size=DEFAULT_BATCH[0], batch_window_s=DEFAULT_BATCH[1])
STREAMS_25MS = replace(STREAMS, name="streams-25ms", commit_interval_s=0.025)
MAIN_VARIANTS = (BARE, CEILING, STREAMS, STREAMS_25MS, UNBATCHED, BATCHED)
#: Two processes of the batched pipeline in one group: 8 partitions split 4 / 4.
BATCHED_X2 = replace(BATCHED, name="batched-x2", workers=2)
#: The batched pipeline as an independent client loads it (bench/outside.py):
#: a constant-rate generator process and a read_committed stamper process.
OUTSIDE = replace(BATCHED, name="outside", shape="outside", arrivals="constant")
OUTSIDE_POISSON = replace(OUTSIDE, name="outside-poisson", arrivals="poisson")


def sweep_variants(sizes: Sequence[int], windows_ms: Sequence[int]) -> tuple[Variant, ...]:
    return tuple(
        Variant(f"sweep-{size}-{ms}", kind="pipeline", batch_size=size, batch_window_s=ms / 1000)
        for size in sizes
        for ms in windows_ms
    )


@dataclass(frozen=True)
class Phase:
    """How long one measured run lasts."""

    warmup_s: float
    measure_s: float
    drain_s: float
    """After sending, how long to wait for outstanding decisions. Past it the
    rest count as lost and the worker (backlogged) is replaced."""

    @property
    def load_s(self) -> float:
        return self.warmup_s + self.measure_s


@dataclass(frozen=True)
class Leg:
    """A variant measured after the main ones, at its own rates and phases."""

    variant: Variant
    rates: tuple[float, ...]
    main: Phase
    search: Phase
    search_steps: tuple[int, ...]

    @property
    def min_s(self) -> float:
        """What its main rates take at least, one worker start included (a guess: 10 s)."""
        return 10.0 + len(self.rates) * (self.main.load_s + self.main.drain_s)


@dataclass(frozen=True)
class Plan:
    quick: bool
    rates: tuple[float, ...]
    main: Phase
    search: Phase
    search_steps: tuple[int, ...]
    """Probe runs per threshold of THRESHOLDS_MS, on top of the main rates."""
    search_floor_tps: float
    search_cap_tps: float
    sweep: tuple[Variant, ...]
    sweep_rate: float
    sweep_phase: Phase
    deadline_s: float
    """Searches stop probing when the rest of the plan would not fit before this."""
    variants: tuple[Variant, ...] = MAIN_VARIANTS
    """Measured at every rate and searched, in this order."""
    legs: tuple[Leg, ...] = ()
    """Measured after the main variants, before the first seconds and the sweep."""
    fresh_rate: float | None = None
    """A fresh worker's first ``fresh_s`` seconds after Ready under load at this rate (outside shape)."""
    fresh_s: float = 5.0


FULL_PLAN = Plan(
    quick=False,
    rates=(100.0, 500.0, 1000.0, 2000.0, 4000.0),
    # NOTE: 4 s of warm-up: a worker is replaced after a run it could not keep
    # up with (see _spent), and a fresh one answered its first seconds late
    # (a pass-through's p99 229 ms at 250 TPS with 1 s of warm-up, p50 31 ms).
    main=Phase(warmup_s=4.0, measure_s=8.0, drain_s=5.0),
    search=Phase(warmup_s=4.0, measure_s=4.0, drain_s=2.0),
    search_steps=(3, 2),
    search_floor_tps=10.0,
    search_cap_tps=40000.0,
    sweep=sweep_variants((64, 256, 1024), (5, 20)),
    # NOTE: near the default's knee (32 / 10 ms sustains ~600-700 TPS here), not
    # at 2,500 where every cell saturated and only throughput told them apart
    # (bench-20261202T230320.json): here small batches still saturate, and the
    # cells that keep up show what size and window cost in latency.
    sweep_rate=1500.0,
    # NOTE: 4 s of warm-up, as above: with 1 s, a fresh worker's first seconds
    # at 1,500 TPS (commits slow, a backlog of up to 1,431 records worked off
    # within ~2.5 s) fell in the window of most cells: the defaults' p99 356
    # and 427 ms with 1 s against 83 and 82 ms with 4 s (knobs-start-1500*.json).
    sweep_phase=Phase(warmup_s=4.0, measure_s=4.0, drain_s=3.0),
    # NOTE: ~10.5 minutes for the main variants and the sweep, ~5 for the
    # Kafka Streams peer's two variants (five rates, a JVM start, the
    # searches), ~4 for the outside shape, two workers and a fresh worker;
    # the sweep gets what is left (its cells are cut first).
    deadline_s=1170.0,
    legs=(
        # The outside shape warms up 5 s, as the independent client did.
        Leg(OUTSIDE, (500.0, 1000.0, 2000.0), Phase(5.0, 8.0, 5.0), Phase(5.0, 4.0, 2.0), (2, 0)),
        Leg(OUTSIDE_POISSON, (1000.0, 2000.0), Phase(5.0, 8.0, 5.0), Phase(5.0, 4.0, 2.0), (0, 0)),
        Leg(BATCHED_X2, (1000.0, 2000.0, 4000.0), Phase(4.0, 8.0, 5.0), Phase(4.0, 4.0, 2.0), (2, 0)),
    ),
    fresh_rate=1500.0,
)
QUICK_PLAN = Plan(
    quick=True,
    # One main rate and one search probe per variant: ~1.5 minutes, most of it
    # starting workers (6.4 s each, a fresh one after every run that fell behind).
    rates=(1000.0,),
    main=Phase(warmup_s=1.0, measure_s=4.0, drain_s=4.0),
    search=Phase(warmup_s=1.0, measure_s=3.0, drain_s=2.0),
    search_steps=(1, 0),
    search_floor_tps=10.0,
    search_cap_tps=40000.0,
    sweep=(),
    sweep_rate=2500.0,
    sweep_phase=Phase(warmup_s=1.0, measure_s=3.0, drain_s=2.0),
    deadline_s=230.0,
    # One Kafka Streams variant: the one at the pipeline's own commit interval.
    variants=(BARE, CEILING, STREAMS_25MS, UNBATCHED, BATCHED),
    # The outside shape at the main rate: whether the two shapes agree, roughly.
    legs=(Leg(OUTSIDE, (1000.0,), Phase(3.0, 4.0, 4.0), Phase(3.0, 3.0, 2.0), (0, 0)),),
)


# --- pure parts: readings, pass/fail, the search, the results document ------------------


def cpu_pct_between(timeline: Sequence[Mapping[str, Any]], key: str) -> float | None:
    """CPU % (100 = one core) of the ``key`` CPU-seconds readings over the measured
    window: from the ``measure_start`` entry to the ``send_end`` entry."""
    marks = {e.get("event"): e for e in timeline if e.get("event") in ("measure_start", "send_end")}
    start, end = marks.get("measure_start"), marks.get("send_end")
    if start is None or end is None or start.get(key) is None or end.get(key) is None:
        return None
    span = end["t"] - start["t"]
    if span <= 0:
        return None
    share: float = round(100.0 * (end[key] - start[key]) / span, 1)
    return share


def _measured_entries(timeline: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    t0 = next((e["t"] for e in timeline if e.get("event") == "measure_start"), None)
    t1 = next((e["t"] for e in timeline if e.get("event") == "send_end"), None)
    if t0 is None or t1 is None:
        return list(timeline)
    return [e for e in timeline if t0 <= e["t"] <= t1]


def run_record(
    variant: Variant, phase: str, offered_tps: float, summary: Mapping[str, Any], *, worker: str,
    other_pids: Sequence[str] = (),
) -> dict[str, Any]:  # fmt: skip
    """One entry of ``runs`` from a :func:`tools.loadgen.run_load` summary (with bench sampling)."""
    lat = summary["latency_ms"]
    timeline = summary.get("timeline", [])
    rss = [e["rss_mb"] for e in _measured_entries(timeline) if e.get("rss_mb") is not None]
    return {
        "variant": variant.name,
        "phase": phase,
        "worker": worker,
        "shape": variant.shape,
        "arrivals": variant.arrivals,
        "workers": variant.workers,
        "batch_size": variant.batch_size,
        "batch_window_ms": round(variant.batch_window_s * 1000, 3),
        "offered_tps": offered_tps,
        "sent_tps": summary["sent_rate"],
        "achieved_tps": summary["achieved_rate"],
        "p50_ms": lat["p50"],
        "p95_ms": lat["p95"],
        "p99_ms": lat["p99"],
        "p999_ms": lat["p99.9"],
        "max_ms": lat["max"],
        "warmup_s": summary["warmup_s"],
        "measure_s": round(summary["duration_s"] - summary["warmup_s"], 3),
        "sent": summary["sent"],
        "measured": summary["measured"],
        "decided": summary["decided"],
        "lost": summary["lost"],
        "degraded": summary["degraded"],
        "degraded_why": summary.get("degraded_why", {}),
        "cached": summary["cached"],
        "cpu_pct": cpu_pct_between(timeline, "cpu_s"),
        "rss_mb": round(max(rss), 1) if rss else None,
        "other_cpu_pct": {name: cpu_pct_between(timeline, f"{name}_cpu_s") for name in ("loadgen", *other_pids)},
        "generator_lag_p99_ms": summary["generator_lag_ms"]["p99"],
        "actions": dict(summary.get("actions", {})),
        "stages": {stage: {"p50": p["p50"], "p99": p["p99"]} for stage, p in summary.get("stages_ms", {}).items()},
        "lag": [[e["t"], e["in_flight"]] for e in timeline],
    } | {"cpu_ms_per_decision": _cpu_ms_per_decision(timeline, summary["achieved_rate"], other_pids)}


def _cpu_ms_per_decision(
    timeline: Sequence[Mapping[str, Any]], achieved_tps: float | None, other_pids: Sequence[str]
) -> dict[str, float | None]:
    """Process CPU milliseconds per decision over the measured window, for the
    worker and each sampled service (broker, Redis): what a decision costs."""

    def per(key: str) -> float | None:
        pct = cpu_pct_between(timeline, key)
        if pct is None or not achieved_tps:
            return None
        return round(pct / 100.0 * 1000.0 / achieved_tps, 3)

    return {"worker": per("cpu_s")} | {name: per(f"{name}_cpu_s") for name in ("loadgen", *other_pids)}


def cpu_per_decision_by_variant(runs: Sequence[Mapping[str, Any]], threshold_ms: float = 200.0) -> dict[str, Any]:
    """Per variant, the CPU per decision of its lowest passing offered rate
    (below saturation, so fixed costs are shared as in normal operation) with
    the rate it was measured at."""
    out: dict[str, Any] = {}
    for run in sorted(runs, key=lambda r: r["offered_tps"]):
        if run["variant"] in out or not passes(run, threshold_ms) or not run.get("cpu_ms_per_decision"):
            continue
        out[run["variant"]] = {"offered_tps": run["offered_tps"], **run["cpu_ms_per_decision"]}
    return out


def passes(run: Mapping[str, Any], threshold_ms: float) -> bool:
    """Whether a run sustained its offered rate with p99 under ``threshold_ms``."""
    p99 = run.get("p99_ms")
    if run.get("error") or p99 is None or run["lost"] > 0:
        return False
    if run["degraded"] > MAX_DEGRADED_FRACTION * max(run["decided"], 1):
        return False
    if not generator_kept_up(run):
        return False  # the load generator, not the worker, shaped this run
    return bool(p99 < threshold_ms)


def saturated(run: Mapping[str, Any]) -> bool:
    """Delivered under 90 % of its offered rate: the worker could not keep up."""
    achieved = run.get("achieved_tps")
    return achieved is not None and achieved < 0.9 * run["offered_tps"]


def needs_repeat(run: Mapping[str, Any], runs: Sequence[Mapping[str, Any]], threshold_ms: float) -> bool:
    """A failure worth measuring again on a fresh worker: it kept up with its
    rate (a p99 spike, not saturation), and its rate has been measured once.

    One spike at a low rate must not decide the search: two full runs of the
    same commit an hour apart once reported 750 and 50 TPS, the latter from one
    probe's 223 ms p99 at 100 TPS while 195 and 290 TPS passed right after.
    """
    if passes(run, threshold_ms) or saturated(run) or run.get("error"):
        return False
    return sum(1 for r in runs if r["offered_tps"] == run["offered_tps"]) == 1


def verdicts(runs: Sequence[Mapping[str, Any]], threshold_ms: float) -> dict[float, bool]:
    """Per offered rate, whether it passed: a rate measured twice (a failure
    repeated on a fresh worker) passes when the repeat did, so a failure counts
    only when it reproduces."""
    by_rate: dict[float, list[bool]] = {}
    for run in runs:
        by_rate.setdefault(run["offered_tps"], []).append(passes(run, threshold_ms))
    return {rate: results[-1] for rate, results in by_rate.items()}


def bracket(outcomes: Mapping[float, bool]) -> tuple[float, float | None]:
    """``(lo, hi)``: the lowest failing rate and the highest passing rate below it.

    Noise can make a higher rate pass after a lower one failed; the lowest
    failure bounds the answer, so such a pass is not believed.
    """
    fails = [rate for rate, ok in outcomes.items() if not ok]
    hi = min(fails) if fails else None
    lo = max((rate for rate, ok in outcomes.items() if ok and (hi is None or rate < hi)), default=0.0)
    return lo, hi


def next_probe(
    outcomes: Mapping[float, bool], *, floor: float, cap: float, rel_resolution: float = 0.1,
    step: float = 50.0, saturated_tps: float | None = None,
) -> float | None:  # fmt: skip
    """The next offered rate to try in the search for the highest passing rate, or None.

    Doubles the highest pass while nothing failed (up to ``cap``), then bisects
    between the highest pass and the lowest failure (from 0 if nothing passed,
    not below ``floor``) until they are within ``rel_resolution`` of the
    failure. Rates are rounded to ``step`` (to a tenth of it below ``10 * step``,
    so a variant that sustains only tens of TPS still gets a figure); a rate
    already tried ends the search.

    ``saturated_tps``: the most a saturated failing run delivered. No higher
    rate can pass, so the bisection's upper end is the lower of it and the
    lowest failure: a variant that saturates at 80 TPS is searched between 0
    and 80, not between 0 and the 1,000 TPS it failed at.
    """
    lo, hi = bracket(outcomes)
    if hi is None:
        if lo <= 0:
            return floor
        if lo >= cap:
            return None
        return min(cap, _round(lo * 2, step))
    if hi <= floor:
        return None  # even the floor fails
    top = min(hi, saturated_tps) if saturated_tps else hi
    if top - lo <= max(_step(top, step), rel_resolution * top):
        return None
    mid = max(floor, _round((lo + top) / 2, step))
    if mid in outcomes or not lo < mid < hi:
        return None
    return mid


def saturated_tps(runs: Sequence[Mapping[str, Any]], threshold_ms: float) -> float | None:
    """The most that a failing run, saturated (delivering under 90 % of its
    offered rate), delivered: an upper bound on the sustainable rate."""
    delivered = [
        run["achieved_tps"]
        for run in runs
        if not passes(run, threshold_ms) and run.get("achieved_tps") and run["achieved_tps"] < 0.9 * run["offered_tps"]
    ]
    return max(delivered, default=None)


def _step(rate: float, step: float) -> float:
    return step if rate >= 10 * step else step / 10


def _round(rate: float, step: float) -> float:
    fine = _step(rate, step)
    return float(max(fine, round(rate / fine) * fine))


def sustainable(runs: Sequence[Mapping[str, Any]], threshold_ms: float) -> dict[str, Any]:
    """The highest offered rate that passed ``threshold_ms`` (see :func:`bracket`).

    ``lower_bound`` is true when no tried rate failed: the answer is at least ``tps``.
    """
    outcomes = verdicts(runs, threshold_ms)
    if not outcomes:
        return {"tps": None, "bracket": [None, None], "lower_bound": False, "probes": []}
    lo, hi = bracket(outcomes)
    return {
        "tps": lo,
        "bracket": [lo, hi],
        "lower_bound": hi is None,
        # Every run, repeats included, in the order measured per rate.
        "probes": [
            [run["offered_tps"], run.get("p99_ms"), passes(run, threshold_ms)]
            for run in sorted(runs, key=lambda r: r["offered_tps"])
        ],
        "repeated": sorted(
            {r["offered_tps"] for r in runs if sum(x["offered_tps"] == r["offered_tps"] for x in runs) > 1}
        ),
    }


def ratios(
    max_sustainable: Mapping[str, Mapping[str, Mapping[str, Any]]], threshold_ms: float = 200.0
) -> dict[str, Any]:
    """Batched max sustainable TPS over unbatched's and over the ceiling's."""
    key = threshold_key(threshold_ms)

    def tps(variant: str) -> float | None:
        entry = max_sustainable.get(variant, {}).get(key)
        return None if entry is None else entry["tps"]

    def ratio(a: float | None, b: float | None) -> float | None:
        return None if a is None or not b else round(a / b, 3)

    batched = tps("batched")
    return {
        "threshold_ms": threshold_ms,
        "batched_over_unbatched": ratio(batched, tps("unbatched")),
        "batched_over_ceiling": ratio(batched, tps("ceiling")),
        "batched_over_bare": ratio(batched, tps("bare")),
    }


def throughput_ratios(runs: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The highest achieved TPS of each main variant (at any offered rate: its
    saturation throughput), and batched's over unbatched's and the ceiling's.
    Defined even when a variant sustains no rate under the latency threshold."""
    best: dict[str, float] = {}
    for run in runs:
        if run.get("variant") in ("bare", "ceiling", "unbatched", "batched") and run.get("achieved_tps"):
            best[run["variant"]] = max(best.get(run["variant"], 0.0), float(run["achieved_tps"]))

    def ratio(a: str, b: str) -> float | None:
        return round(best[a] / best[b], 3) if best.get(a) and best.get(b) else None

    return {
        "max_achieved_tps": {k: round(v, 1) for k, v in sorted(best.items())},
        "batched_over_unbatched": ratio("batched", "unbatched"),
        "batched_over_ceiling": ratio("batched", "ceiling"),
        "batched_over_bare": ratio("batched", "bare"),
    }


def cpu_by_rate(runs: Sequence[Mapping[str, Any]], threshold_ms: float = 200.0) -> dict[str, list[dict[str, Any]]]:
    """Per variant, the CPU ms per decision of every process at every offered
    rate it was measured at (the first run of each rate), whether that rate
    passed, and which is the knee (the highest passing rate)."""
    out: dict[str, list[dict[str, Any]]] = {}
    for run in sorted(runs, key=lambda r: r["offered_tps"]):
        rows = out.setdefault(run["variant"], [])
        if not run.get("cpu_ms_per_decision") or any(r["offered_tps"] == run["offered_tps"] for r in rows):
            continue
        rows.append({
            "offered_tps": run["offered_tps"], "achieved_tps": run["achieved_tps"], "p99_ms": run["p99_ms"],
            "passes": passes(run, threshold_ms), "knee": False, **run["cpu_ms_per_decision"],
        })  # fmt: skip
    for rows in out.values():
        passing = [r for r in rows if r["passes"]]
        if passing:
            passing[-1]["knee"] = True
    return out


def shape_figures(
    runs: Sequence[Mapping[str, Any]], max_sustainable: Mapping[str, Any], variant: str
) -> dict[str, Any]:
    """What the shapes are compared on, for one variant: its max rate at p99 <
    200 ms, and p99 and CPU ms per decision at each rate it passed."""
    rows = [r for r in cpu_by_rate(runs).get(variant, []) if r["passes"]]
    entry = max_sustainable.get(variant, {}).get(threshold_key(200.0)) or {}
    return {
        "max_tps": entry.get("tps"),
        "max_tps_lower_bound": entry.get("lower_bound"),
        "p99_ms": {r["offered_tps"]: r["p99_ms"] for r in rows},
        "cpu_ms": {
            r["offered_tps"]: {k: r.get(k) for k in ("worker", "broker", "redis", "loadgen", "stamper")} for r in rows
        },  # fmt: skip
    }


#: The inside shape's variant each outside variant is compared with.
SHAPE_PAIRS = (("batched", "outside"), ("batched", "outside-poisson"))


def shapes_doc(runs: Sequence[Mapping[str, Any]], max_sustainable: Mapping[str, Any]) -> dict[str, Any]:
    """Per pair of :data:`SHAPE_PAIRS` measured in this run: both sides' figures
    and whether they agree within 10 % (:func:`bench.outside.agreement`)."""
    from bench.outside import agreement

    out: dict[str, Any] = {}
    for inside, outside in SHAPE_PAIRS:
        if inside in max_sustainable and outside in max_sustainable:
            a = shape_figures(runs, max_sustainable, inside)
            b = shape_figures(runs, max_sustainable, outside)
            out[f"{inside} vs {outside}"] = {"inside": a, "outside": b, **agreement(a, b)}
    return out


def scaling_doc(max_sustainable: Mapping[str, Any]) -> dict[str, Any] | None:
    """The batched pipeline's knee with one worker and with two (same group)."""
    if "batched-x2" not in max_sustainable:
        return None
    key = threshold_key(200.0)
    one = (max_sustainable.get("batched", {}).get(key) or {}).get("tps")
    two = (max_sustainable["batched-x2"].get(key) or {}).get("tps")
    return {"workers_1_tps": one, "workers_2_tps": two, "ratio": round(two / one, 3) if one and two else None}


_RUN_FIELDS: dict[str, tuple[type, ...]] = {
    "variant": (str,),
    "offered_tps": (int, float),
    "achieved_tps": (int, float),
    "p50_ms": (int, float, type(None)),
    "p95_ms": (int, float, type(None)),
    "p99_ms": (int, float, type(None)),
    "p999_ms": (int, float, type(None)),
    "lost": (int,),
    "degraded": (int,),
    "cpu_pct": (int, float, type(None)),
    "rss_mb": (int, float, type(None)),
    "lag": (list,),
}


def validate_results(doc: Mapping[str, Any]) -> list[str]:
    """What is wrong with a results document (empty when it has the agreed shape)."""
    problems: list[str] = []
    for key in ("schema", "machine", "settings", "runs", "max_sustainable", "ratios"):
        if key not in doc:
            problems.append(f"missing {key!r}")
    machine = doc.get("machine", {})
    for key in ("cores", "cpu_model", "python"):
        if key not in machine:
            problems.append(f"machine: missing {key!r}")
    for i, run in enumerate(doc.get("runs", [])):
        for key, types in _RUN_FIELDS.items():
            if key not in run:
                problems.append(f"runs[{i}]: missing {key!r}")
            elif not isinstance(run[key], types) or isinstance(run[key], bool):
                problems.append(f"runs[{i}].{key}: {type(run[key]).__name__}")
        for j, sample in enumerate(run.get("lag", [])):
            if not (isinstance(sample, list) and len(sample) == 2):
                problems.append(f"runs[{i}].lag[{j}]: not [t, in_flight]")
                break
    for variant, entry in doc.get("max_sustainable", {}).items():
        for threshold in THRESHOLDS_MS:
            found = entry.get(threshold_key(threshold))
            if found is None or "tps" not in found or "bracket" not in found:
                problems.append(f"max_sustainable.{variant}: missing {threshold_key(threshold)}")
    for key in ("batched_over_unbatched", "batched_over_ceiling"):
        if key not in doc.get("ratios", {}):
            problems.append(f"ratios: missing {key!r}")
    return problems


def machine_info() -> dict[str, Any]:
    model = None
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cores": os.cpu_count(),
        "cpu_model": model or platform.processor() or None,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "load_avg_at_start": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
    }


# --- processes --------------------------------------------------------------------------


def _own_cpu_s() -> float:
    t = os.times()
    return t.user + t.system


def _sampler(worker_pids: Sequence[int], others: Mapping[str, int]) -> Callable[[], dict[str, float]]:
    """Readings for :class:`tools.loadgen.LoadConfig.sample`: CPU seconds (summed
    over a variant's worker processes) and RSS (the largest)."""

    def sample() -> dict[str, float]:
        cpu = [proc_cpu_s(pid) for pid in worker_pids]
        rss = [proc_rss_mb(pid) for pid in worker_pids]
        out: dict[str, Any] = {
            "cpu_s": None if None in cpu else sum(c for c in cpu if c is not None),
            "rss_mb": None if None in rss else max(r for r in rss if r is not None),
            # The generator shares the machine: its CPU is part of the picture.
            "loadgen_cpu_s": _own_cpu_s(),
        }
        for name, pid in others.items():
            out[f"{name}_cpu_s"] = proc_cpu_s(pid)
        return out

    return sample


class WorkerError(RuntimeError):
    """A worker did not start, did not answer the probe, or died."""


class Worker:
    """One worker subprocess on its own topics and consumer group, stopped by PID."""

    def __init__(
        self,
        variant: Variant,
        services: Services,
        workdir: Path,
        join: Worker | None = None,
        role: str = "score",
        extra_env: Mapping[str, str] | None = None,
    ) -> None:
        """``join``: a second process in that worker's group, on its topics.
        ``role``: FRAUD_WORKER_ROLE; ``feedback`` joins only the feedback loop's
        group (on ``join``'s topics), which answers no transactions.
        ``extra_env``: settings on top of the bench's (e.g. another registry)."""
        from tools import stack

        self.variant = variant
        self.role = role
        self.tag = f"{variant.name}-{uuid.uuid4().hex[:8]}"
        self.group_tag: str = join.group_tag if join else self.tag
        self.topics: dict[str, str] = join.topics if join else {
            name: f"bench-{short}-{self.tag}"
            for name, short in (
                ("transactions", "tx"), ("decisions", "dec"), ("dlq", "dlq"),
                ("feedback", "fb"), ("monitoring", "mon"), ("labels", "lab"),
            )
        }  # fmt: skip
        topics = self.topics
        port = stack.free_port()
        ours = {
            **services.env(),
            "FRAUD_APP_ID": f"bench-{self.group_tag}",
            "FRAUD_DATA_DIR": str(workdir / "faust" / self.tag),
            **{f"FRAUD_TOPIC_{name.upper()}": topic for name, topic in topics.items()},
            # The decision path as production deploys it: the feedback loop's
            # agents run in their own workers (--role feedback), not here.
            "FRAUD_WORKER_ROLE": role,
            **variant.env(),
            **(extra_env or {}),
        }
        env = {**os.environ, **ours, "PYTHONUNBUFFERED": "1"}
        # The load generator sees the settings the worker does (same environment),
        # with a payment client's credentials on a secure broker.
        self.settings = settings_from_env({**ours, **services.client_env()})
        if join is None:
            services.provision(settings_from_env(ours))
        if variant.kind == "bare":
            argv = [sys.executable, "-m", "bench.bare"]
        elif variant.kind == "faust":
            argv = [sys.executable, "-m", "bench.passthrough"]
        elif variant.kind == "streams":
            argv = streams_peer.launcher_argv(variant.commit_interval_s)
        else:
            script = Path(sys.executable).parent / "fraud-pipeline"
            argv = [str(script)] if script.exists() else [sys.executable, "-m", "tools.cli"]
            argv.append("worker")
        argv += ["--web-port", str(port), "--loglevel", "info"]
        self.peers: list[Worker] = []
        """Further processes in this worker's group (``variant.workers`` > 1), stopped with it."""
        self.log_path = workdir / f"worker-{self.tag}.log"
        (workdir / "faust").mkdir(parents=True, exist_ok=True)  # faust makes only the last level
        self.started_at = time.monotonic()
        with self.log_path.open("wb") as out:
            self.proc = subprocess.Popen(
                argv, cwd=REPO, env=env, stdin=subprocess.DEVNULL, stdout=out,
                stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip
        log.debug("worker %s pid %d: %s", self.tag, self.proc.pid, " ".join(argv))

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def pids(self) -> list[int]:
        return [self.pid, *(p.pid for p in self.peers)]

    def alive(self) -> bool:
        return self.proc.poll() is None and all(p.alive() for p in self.peers)

    def tail(self, lines: int = 12) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def wait_ready(self, timeout_s: float = READY_TIMEOUT_S) -> float:
        """Block until "Ready" is logged and a probe transaction got its decision;
        return the seconds since start."""
        deadline = time.monotonic() + timeout_s
        while b"Ready" not in self.log_path.read_bytes():
            if not self.alive():
                raise WorkerError(f"worker {self.tag} exited ({self.proc.returncode}):\n{self.tail()}")
            if time.monotonic() > deadline:
                raise WorkerError(f"worker {self.tag} not Ready after {timeout_s:.0f} s:\n{self.tail()}")
            time.sleep(0.1)
        if self.role != "feedback":  # a feedback worker decides nothing: no probe to answer
            self._probe()
        return time.monotonic() - self.started_at

    def _probe(self) -> None:
        from tools.loadgen import LoadConfig, run_load

        # A handful of transactions; run_load waits up to drain_s for their
        # decisions, which arrive once partitions are assigned and the model loaded.
        cfg = LoadConfig(
            rate=20.0, duration_s=0.25, data=POPULATION, seed=1, drain_s=PROBE_TIMEOUT_S, quiet=True,
            settings=self.settings, report_every_s=5.0,
        )  # fmt: skip
        summary = asyncio.run(run_load(cfg))
        if summary["decided"] == 0 or not self.alive():
            raise WorkerError(f"worker {self.tag} answered no probe in {PROBE_TIMEOUT_S:.0f} s:\n{self.tail()}")

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after STOP_TIMEOUT_S (its peers first)."""
        for peer in self.peers:
            peer.stop()
        if self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            log.warning("worker %s ignored SIGTERM for %.0f s; killing it", self.tag, STOP_TIMEOUT_S)
            self.proc.kill()
            self.proc.wait(timeout=5)


@dataclass
class Services:
    """The broker and Redis: ours (started and stopped here) or given by the environment."""

    bootstrap: str
    redis_url: str
    pids: dict[str, int] = field(default_factory=dict)
    """Processes we started, by name: their CPU is sampled too."""
    client_key: str = field(default_factory=lambda: secrets.token_hex(32))
    """This run's producer key: the load generator signs, pipeline workers verify."""
    decision_key: str = field(default_factory=lambda: secrets.token_hex(32))
    """This run's decision signing key (a raw Ed25519 seed): workers sign, the load generator verifies."""
    secure_dir: Path | None = None
    """Set when the broker runs SASL/SCRAM over TLS with ACLs and Redis has ACL users
    (``tools.stack``'s secure mode, material in this folder): every process then uses
    its role's credentials, as deployed."""

    def env(self) -> dict[str, str]:
        """The environment every bench worker (and the load generator's settings) gets."""
        return {
            **decision_key_env(self.decision_key),
            "KAFKA_BOOTSTRAP": self.bootstrap,
            "FRAUD_KAFKA_BOOTSTRAP": self.bootstrap,
            "REDIS_URL": self.redis_url,
            "FRAUD_REDIS_URL": self.redis_url,
            # Signed as a real producer would: verification is part of the cost.
            "FRAUD_CLIENT_KEYS": f"{BENCH_CLIENT}:{self.client_key}",
            **BENCH_RATE_LIMITS,
            **self.role_env("scoring", "worker"),
        }

    def role_env(self, kafka_user: str | None, redis_user: str | None = None) -> dict[str, str]:
        """A role's credentials on the secure stack (nothing on the plaintext one)."""
        from tools import kafka_secure, stack

        if self.secure_dir is None:
            return {}
        env = kafka_secure.client_env(self.secure_dir, kafka_user, self.bootstrap) if kafka_user else {}
        if redis_user:
            env["FRAUD_REDIS_USERNAME"] = redis_user
            env["FRAUD_REDIS_PASSWORD_FILE"] = str(stack.redis_password_path(self.secure_dir, redis_user))
        return env

    def client_env(self) -> dict[str, str]:
        """The load generator's: a payment client."""
        return self.role_env("payments")

    def admin_options(self) -> dict[str, Any]:
        """aiokafka connection options of the broker's super user (topic set-up and clean-up)."""
        from app.topics import kafka_auth
        from tools import kafka_secure

        if self.secure_dir is None:
            return {}
        return kafka_auth(kafka_secure.client_settings(self.secure_dir, kafka_secure.ADMIN, self.bootstrap))

    def provision(self, worker_settings: Any) -> None:
        """On the secure broker, as the super user: a worker's topics, and the ACL
        table's rows for their names and its app id (each bench worker has its own
        topics; roles may not create them). Nothing on the plaintext broker."""
        from tools import kafka_secure, stack

        if self.secure_dir is None:
            return
        admin = kafka_secure.client_settings(self.secure_dir, kafka_secure.ADMIN, self.bootstrap)
        connection = {name: getattr(admin, name) for name in type(admin).model_fields if name.startswith("kafka_")}
        asyncio.run(stack.provision_secure(worker_settings.model_copy(update=connection)))


def decision_key_env(seed_hex: str) -> dict[str, str]:
    """Workers sign decisions with ``seed_hex``; consumers verify with its public key (as deployed)."""
    from pipeline.decision_signing import DecisionSigner, public_key_text

    signer = DecisionSigner.from_bytes(seed_hex.encode(), "bench")
    return {"FRAUD_DECISION_SIGNING_KEY": seed_hex, "FRAUD_DECISION_PUBLIC_KEYS": public_key_text(signer.public_key)}


def settings_from_env(env: Mapping[str, str]) -> Any:
    """:class:`app.settings.Settings` with ``FRAUD_*`` values from ``env`` over the process's."""
    from app.settings import Settings

    fields = Settings.model_fields
    values = {key[len("FRAUD_") :].lower(): v for key, v in env.items() if key.startswith("FRAUD_")}
    # Any: strings from the environment, which Settings parses into each field's type.
    known: dict[str, Any] = {name: v for name, v in values.items() if name in fields}
    return Settings(**known)


@contextmanager
def services(workdir: Path, *, secure: bool = False) -> Iterator[Services]:
    """The broker and Redis: the environment's (KAFKA_BOOTSTRAP, REDIS_URL), else
    started here. ``secure``: always started here, in the stack's secure mode."""
    from tools import stack

    handles: list[Any] = []
    try:
        if secure:
            handles.append(stack.start_broker(workdir=workdir, secure=True))
            handles.append(stack.start_redis(workdir=workdir, secure=True))
            # The URL without the admin's credentials: each process brings its role's.
            redis_url = "redis://" + handles[-1].url.split("@", 1)[1]
            yield Services(handles[0].url, redis_url, {h.name: h.pid for h in handles}, secure_dir=workdir.resolve())
            return
        bootstrap = os.environ.get("FRAUD_KAFKA_BOOTSTRAP") or os.environ.get("KAFKA_BOOTSTRAP")
        if bootstrap:
            stack.wait_broker_ready(bootstrap)
        else:
            handles.append(stack.start_broker(workdir=workdir))
            bootstrap = handles[-1].url
        redis_url = os.environ.get("FRAUD_REDIS_URL") or os.environ.get("REDIS_URL")
        if redis_url:
            stack.wait_redis_ready(redis_url)
        else:
            handles.append(stack.start_redis(workdir=workdir))
            redis_url = handles[-1].url
        yield Services(bootstrap, redis_url, {h.name: h.pid for h in handles})
    finally:
        for handle in reversed(handles):
            handle.stop()


# --- the run ----------------------------------------------------------------------------


def _cli() -> list[str]:
    script = Path(sys.executable).parent / "fraud-pipeline"
    return [str(script)] if script.exists() else [sys.executable, "-m", "tools.cli"]


def prepare(svc: Services) -> dict[str, Any]:
    """Data, model and online features: simulate and train only if missing; always materialize."""
    from app.settings import Settings

    env = dict(os.environ, REDIS_URL=svc.redis_url, FRAUD_REDIS_URL=svc.redis_url, **svc.role_env(None, "materialize"))
    done: dict[str, Any] = {}

    def step(name: str, *args: str) -> None:
        t0 = time.monotonic()
        print(f"bench: {name} ...", flush=True)
        subprocess.run([*_cli(), name, *args], cwd=REPO, env=env, check=True, stdout=subprocess.DEVNULL)
        done[name] = round(time.monotonic() - t0, 1)

    if not DATA.exists():
        step("simulate", *SIMULATE_ARGS, "--out", str(DATA), "--quiet")
    registry = Settings().registry_dir
    registry = registry if registry.is_absolute() else REPO / registry
    from models.lifecycle import serving_problem

    if serving_problem(registry)[1]:  # nothing serves, or nothing this code can load
        step("train", "--data", str(DATA), "--quiet", "--serve-if-none")
    if not POPULATION.exists():
        step("simulate", *POPULATION_ARGS, "--out", str(POPULATION), "--quiet")
    step("materialize", "--data", str(POPULATION), "--quiet")
    done["model"] = (registry / "CURRENT").read_text().strip()
    settings = Settings()
    if settings.compiled_trees:
        # Built here, not by the first worker in the background, so that no
        # measured window holds a compile or a worker still on XGBoost.
        from models.compiled import load_or_compile
        from models.registry import load_ensemble

        t0 = time.monotonic()
        merged = load_ensemble(registry, warm_up=False).merged
        compiled = load_or_compile(merged, settings.compiled_trees_dir) if merged is not None else None
        done["compiled_trees"] = round(time.monotonic() - t0, 1) if compiled is not None else None
    return done


class Bench:
    """Runs the plan against one broker and Redis; collects ``runs`` and ``max_sustainable``."""

    def __init__(self, plan: Plan, svc: Services, workdir: Path, started: float) -> None:
        self.plan = plan
        self.svc = svc
        self.workdir = workdir
        self.deadline = started + plan.deadline_s
        self.runs: list[dict[str, Any]] = []
        self.errors: list[dict[str, str]] = []
        self.max_sustainable: dict[str, dict[str, Any]] = {}
        self.truncated: list[str] = []
        self._seed = 100
        # Running estimates for the deadline check (seconds); refined as we go.
        self._start_s = 10.0
        self._stop_s = 2.0
        self.reserve_s = 0.0
        """Seconds the main variants' searches leave for what comes after them."""

    # -- workers and single runs --

    def _start(self, variant: Variant) -> Worker | OutsideWorkers:
        if variant.shape == "outside":
            return self._start_outside(variant)
        worker = Worker(variant, self.svc, self.workdir)
        worker.peers = [Worker(variant, self.svc, self.workdir, join=worker) for _ in range(variant.workers - 1)]
        try:
            took = max(w.wait_ready() for w in (worker, *worker.peers))
        except BaseException:
            worker.stop()
            raise
        self._start_s = max(self._start_s, took)
        print(f"bench: {variant.name}: worker {worker.tag} (pids {worker.pids}) ready in {took:.1f} s", flush=True)
        return worker

    def _outside(self, variant: Variant) -> OutsideWorkers:
        """An outside session on topics of its own, created by ``fraud-pipeline topics``; no worker yet."""
        from bench.outside import OutsideSession

        tag = f"{variant.name}-{uuid.uuid4().hex[:8]}"
        # NOTE: names of its own (default partition counts and configs) so that
        # each session starts from empty topics and a new group, as a fresh
        # deployment does; every other setting is the worker's default.
        names = {f"FRAUD_TOPIC_{n.upper()}": f"{tag}-{n}" for n in OutsideWorkers.TOPICS} | {"FRAUD_APP_ID": tag}
        session = OutsideSession({**self.svc.env(), **names}, self.svc.pids, self.workdir, POPULATION, _cli(),
                                 workers=variant.workers)  # fmt: skip
        created = session.topics()
        print(f"bench: {variant.name}: fraud-pipeline topics: {'; '.join(created.splitlines())}", flush=True)
        return OutsideWorkers(variant, tag, session, list(names.values())[:-1])

    def _start_outside(self, variant: Variant) -> OutsideWorkers:
        t0 = time.monotonic()
        outside = self._outside(variant)
        try:
            outside.session.start()
        except BaseException:
            self._stop(outside)
            raise
        took = time.monotonic() - t0
        self._start_s = max(self._start_s, took)
        print(f"bench: {variant.name}: workers {outside.session.worker_pids} ready in {took:.1f} s", flush=True)
        return outside

    def _stop(self, worker: Worker | OutsideWorkers | None) -> None:
        if worker is not None:
            t0 = time.monotonic()
            worker.stop()
            # Drop what this worker's runs produced: later runs start from
            # empty topics and the broker's disk stays flat.
            asyncio.run(_delete_topics(self.svc.bootstrap, list(worker.topics.values()), self.svc.admin_options()))
            self._stop_s = max(self._stop_s, time.monotonic() - t0)

    def _measure(self, worker: Worker | OutsideWorkers, rate: float, phase: Phase, label: str) -> dict[str, Any]:
        from tools.loadgen import LoadConfig, run_load

        self._seed += 1
        if isinstance(worker, OutsideWorkers):
            summary, _, _ = worker.session.run(
                rate, arrivals=worker.variant.arrivals, warmup_s=phase.warmup_s, measure_s=phase.measure_s,
                drain_s=phase.drain_s, seed=self._seed,
            )  # fmt: skip
            others: tuple[str, ...] = ("stamper", *self.svc.pids)
        else:
            cfg = LoadConfig(
                rate=rate, duration_s=phase.load_s, warmup_s=phase.warmup_s, drain_s=phase.drain_s,
                data=POPULATION, seed=self._seed, report_every_s=SAMPLE_EVERY_S, quiet=True,
                verify_share=VERIFY_SHARE, settings=worker.settings, sample=_sampler(worker.pids, self.svc.pids),
                prebuild=True,
            )  # fmt: skip
            summary = asyncio.run(run_load(cfg))
            others = tuple(self.svc.pids)
        record = run_record(worker.variant, label, rate, summary, worker=worker.tag, other_pids=others)
        if not worker.alive():
            record["error"] = "a worker exited during the run"
        self.runs.append(record)
        print("bench:   " + _row(record), flush=True)
        return record

    def _afford(self, seconds: float, reserve: float = 0.0) -> bool:
        return time.monotonic() + seconds + reserve <= self.deadline

    def _cell_s(self) -> float:
        """Estimated seconds for one sweep cell: start, load, drain, stop."""
        return self._start_s + self.plan.sweep_phase.load_s + 1.0 + self._stop_s

    def _sweep_reserve(self, done: int = 0) -> float:
        return (len(self.plan.sweep) - done) * self._cell_s()

    # -- the phases --

    def main_variant(self, variant: Variant, leg: Leg | None = None) -> None:
        """The main rates, then the searches, on one worker (replaced when backlogged).
        ``leg``: its rates, phases and search steps instead of the plan's."""
        plan, worker = self.plan, None
        rates, main, search = (leg.rates, leg.main, leg.search) if leg else (plan.rates, plan.main, plan.search)
        steps = leg.search_steps if leg else plan.search_steps
        mine: list[dict[str, Any]] = []
        try:
            for rate in rates:
                if any(r["achieved_tps"] < 0.8 * r["offered_tps"] for r in mine):
                    break  # saturated already: a higher rate only grows the backlog
                if leg and not self._afford(main.load_s + main.drain_s + (0 if worker else self._start_s)):
                    self.truncated.append(f"{variant.name}: {rate:,.0f} TPS")
                    break
                worker = worker or self._start(variant)
                record = self._measure(worker, rate, main, "rate")
                mine.append(record)
                if _spent(record):
                    self._stop(worker)
                    worker = None
                worker = self._repeat_if_spike(variant, worker, record, mine, main, max(THRESHOLDS_MS))
            for threshold, n in zip(THRESHOLDS_MS, steps):
                for _ in range(n):
                    outcomes = verdicts(mine, threshold)
                    probe = next_probe(
                        outcomes,
                        floor=plan.search_floor_tps,
                        cap=plan.search_cap_tps,
                        saturated_tps=saturated_tps(mine, threshold),
                    )
                    if probe is None:
                        break
                    rate = probe
                    cost = search.load_s + search.drain_s + (0 if worker else self._start_s)
                    # The searches give the acceptance figures (max sustainable
                    # rates, ratios): they go before the sweep, which gets the
                    # rest, and leave the legs still to come their main rates.
                    if not self._afford(cost, self.reserve_s):
                        self.truncated.append(f"{variant.name}: search for {threshold_key(threshold)}")
                        break
                    worker = worker or self._start(variant)
                    record = self._measure(worker, rate, search, "search")
                    mine.append(record)
                    if _spent(record):
                        self._stop(worker)
                        worker = None
                    worker = self._repeat_if_spike(variant, worker, record, mine, search, threshold)
        except (WorkerError, OutsideError) as exc:
            self.errors.append({"variant": variant.name, "error": str(exc)})
            print(f"bench: {variant.name}: {exc}", file=sys.stderr, flush=True)
        finally:
            self._stop(worker)
        self.max_sustainable[variant.name] = {threshold_key(t): sustainable(mine, t) for t in THRESHOLDS_MS}

    def _repeat_if_spike(
        self, variant: Variant, worker: Worker | OutsideWorkers | None, record: Mapping[str, Any], mine: list[dict[str, Any]],
        phase: Phase, threshold: float,
    ) -> Worker | OutsideWorkers | None:  # fmt: skip
        """Measure a failing, unsaturated rate once more on a fresh worker (see :func:`needs_repeat`)."""
        if not needs_repeat(record, mine, threshold):
            return worker
        if not self._afford(phase.load_s + phase.drain_s + self._start_s + self._stop_s):
            self.truncated.append(f"{variant.name}: repeat of {record['offered_tps']:.0f} TPS")
            return worker
        self._stop(worker)
        fresh = self._start(variant)
        repeat = self._measure(fresh, record["offered_tps"], phase, "repeat")
        mine.append(repeat)
        if _spent(repeat):
            self._stop(fresh)
            return None
        return fresh

    def sweep(self) -> None:
        for variant in self.plan.sweep:
            if not self._afford(self._cell_s()):
                self.truncated.append(f"sweep from {variant.name}")
                break
            worker = None
            try:
                worker = self._start(variant)
                self._measure(worker, self.plan.sweep_rate, self.plan.sweep_phase, "sweep")
            except WorkerError as exc:
                self.errors.append({"variant": variant.name, "error": str(exc)})
                print(f"bench: {variant.name}: {exc}", file=sys.stderr, flush=True)
            finally:
                self._stop(worker)

    def fresh(self) -> None:
        """A fresh worker's first ``fresh_s`` seconds after Ready, under load at
        ``fresh_rate`` (outside shape): generator and stamper wait ready, the
        worker starts, and sending starts the moment it logs Ready."""
        from bench.outside import first_seconds

        plan = self.plan
        if plan.fresh_rate is None:
            return
        if not self._afford(self._start_s + plan.fresh_s + 10.0 + self._stop_s):
            self.truncated.append("a fresh worker's first seconds")
            return
        variant = replace(OUTSIDE, name="fresh")
        outside = None
        self._seed += 1
        try:
            outside = self._outside(variant)
            session = outside.session
            summary, sends, got = session.run(
                plan.fresh_rate, arrivals="constant", warmup_s=0.0, measure_s=plan.fresh_s, drain_s=10.0,
                seed=self._seed, before_go=session.start,
            )  # fmt: skip
            assert session.ready_at is not None  # set by session.start
            record = run_record(variant, "fresh", plan.fresh_rate, summary, worker=outside.tag,
                                other_pids=("stamper", *self.svc.pids))  # fmt: skip
            record["first_seconds"] = first_seconds(sends, got, session.ready_at, plan.fresh_s)
            self.runs.append(record)
            print("bench:   " + _row(record), flush=True)
        except OutsideError as exc:
            self.errors.append({"variant": variant.name, "error": str(exc)})
            print(f"bench: {variant.name}: {exc}", file=sys.stderr, flush=True)
        finally:
            self._stop(outside)


class OutsideWorkers:
    """An outside session (:class:`bench.outside.OutsideSession`) as the harness
    drives a worker: its variant, a tag, its topics (deleted when it stops)."""

    TOPICS = ("transactions", "decisions", "dlq", "feedback", "monitoring", "labels")

    def __init__(self, variant: Variant, tag: str, session: Any, topic_names: Sequence[str]) -> None:
        self.variant = variant
        self.tag = tag
        self.session = session
        self.topics = dict(zip(self.TOPICS, topic_names))

    def alive(self) -> bool:
        return bool(self.session.alive())

    def stop(self) -> None:
        self.session.stop()


async def _delete_topics(bootstrap: str, names: list[str], options: Mapping[str, Any] | None = None) -> None:
    """Best effort: a topic left behind costs memory, not correctness."""
    from aiokafka.admin import AIOKafkaAdminClient

    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, **(options or {}))
    try:
        await admin.start()
        await asyncio.wait_for(admin.delete_topics(names), 10.0)
    except Exception as exc:
        print(f"bench: could not delete topics {names}: {exc!r}", file=sys.stderr, flush=True)
    finally:
        with contextlib.suppress(Exception):
            await admin.close()


def _spent(record: Mapping[str, Any]) -> bool:
    """Whether the worker must be replaced before the next run: it lost or
    failed, or it fell behind its offered rate. NOTE: a worker (and its
    broker topics) that was just overrun answered the next, slower probe late
    (measured: a pass-through p99 of 339 ms at 500 TPS right after a 1,600 TPS
    run, 107 ms on a fresh one); each probe must measure the rate it offers."""
    return bool(record["lost"] or record.get("error") or not passes(record, max(THRESHOLDS_MS)))


# --- output -----------------------------------------------------------------------------

_HEADER = (
    f"{'variant':<14}{'phase':<7}{'offered':>8}{'sent':>8}{'achieved':>9}{'p50':>9}{'p95':>9}{'p99':>9}"
    f"{'p99.9':>9}{'undec':>8}{'degr':>6}{'cpu%':>6}{'rssMB':>6}{'gen%':>6}{'genlag99':>9}"
)


def _num(value: Any, width: int, digits: int = 0) -> str:
    if value is None:
        return f"{'-':>{width}}"
    return f"{value:>{width},.{digits}f}"


def _row(run: Mapping[str, Any]) -> str:
    return (
        f"{run['variant']:<14}{run['phase']:<7}{_num(run['offered_tps'], 8)}{_num(run['sent_tps'], 8)}"
        f"{_num(run['achieved_tps'], 9)}{_num(run['p50_ms'], 9, 1)}{_num(run['p95_ms'], 9, 1)}"
        f"{_num(run['p99_ms'], 9, 1)}{_num(run['p999_ms'], 9, 1)}{_num(run['lost'], 8)}"
        f"{_num(run['degraded'], 6)}{_num(run['cpu_pct'], 6)}{_num(run['rss_mb'], 6)}"
        f"{_num(run['other_cpu_pct'].get('loadgen'), 6)}{_num(run['generator_lag_p99_ms'], 9, 1)}"
        + (f"  ERROR {run['error']}" if run.get("error") else "")
    )


def format_report(doc: Mapping[str, Any]) -> str:
    lines = [
        f"fraud-pipeline bench ({'quick' if doc['quick'] else 'full'}) on {doc['machine']['cores']} cores, "
        f"{doc['machine']['cpu_model']}, Python {doc['machine']['python']}; {doc['duration_s']:.0f} s",
        "latency in ms from send to decision read back; cpu% of the worker (100 = one core), "
        "gen% the load generator's; undec: sent but undecided when the run's drain ended (in a saturated "
        "run its backlog, not a loss: loss is what the fault tests count); phase 'repeat': a failure "
        "measured again on a fresh worker (the rate's verdict is the repeat's)",
        _HEADER,
    ]
    order = {v.name: i for i, v in enumerate(MAIN_VARIANTS)}
    runs = sorted(doc["runs"], key=lambda r: (order.get(r["variant"], 99), r["variant"], r["offered_tps"]))
    lines += [_row(r) for r in runs]
    lines.append("")
    lines.append(f"{'max sustainable TPS':<20}" + "".join(f"{threshold_key(t):>22}" for t in THRESHOLDS_MS))
    for variant, entry in doc["max_sustainable"].items():
        cells = []
        for t in THRESHOLDS_MS:
            found = entry[threshold_key(t)]
            lo, hi = found["bracket"]
            if lo is None:
                text = "not measured"
            elif hi is None:
                text = f">= {lo:,.0f}"
            else:
                text = f"{lo:,.0f} (fails {hi:,.0f})"
            cells.append(f"{text:>22}")
        lines.append(f"{variant:<20}" + "".join(cells))
    cpu = doc.get("cpu_ms_per_decision") or {}
    if cpu:
        lines.append("")
        lines.append(
            "CPU ms per decision (lowest passing rate): "
            + "; ".join(
                f"{variant} @ {c['offered_tps']:,.0f} TPS: "
                + ", ".join(f"{k} {v}" for k, v in c.items() if k != "offered_tps" and v is not None)
                for variant, c in cpu.items()
            )
        )
    r = doc["ratios"]
    lines.append(
        f"ratios at p99 < {r['threshold_ms']:g} ms: batched/unbatched {r['batched_over_unbatched']}, "
        f"batched/ceiling {r['batched_over_ceiling']}, batched/bare {r.get('batched_over_bare')}"
    )
    peer = doc.get("against_peer") or {}
    if peer.get("rates"):
        lines.append(f"p99 ms against the Kafka Streams peer, up to {peer['pipeline']}'s knee: " + "; ".join(
            f"{r['offered_tps']:,.0f} TPS " + ", ".join(f"{k} {v:.0f}" for k, v in r["p99_ms"].items())
            for r in peer["rates"]
        ) + f"; {peer['pipeline']} lower at every rate: " + ", ".join(f"vs {k} {v}" for k, v in peer["beats"].items()))
    by_rate = doc.get("cpu_ms_per_decision_by_rate") or {}
    if by_rate:
        lines.append("")
        lines.append(
            "CPU ms per decision by offered rate (worker / broker / redis / generator [/ stamper, the outside "
            "shape's consumer]; * the knee, x failed):"
        )
        for variant, rows in by_rate.items():
            cells = [
                f"{r['offered_tps']:,.0f}{'*' if r['knee'] else '' if r['passes'] else 'x'} "
                + "/".join(
                    "-" if r.get(k) is None else f"{r[k]:.2f}"
                    for k in ("worker", "broker", "redis", "loadgen", "stamper")
                    if k != "stamper" or r.get(k) is not None
                )
                for r in rows
            ]
            lines.append(f"  {variant:<10} " + "  ".join(cells))
    lines += _shape_lines(doc)
    for note in doc.get("truncated", []):
        lines.append(f"cut short by the time budget: {note}")
    for err in doc.get("errors", []):
        lines.append(f"ERROR {err['variant']}: {err['error'].splitlines()[0]}")
    return "\n".join(lines)


def _shape_lines(doc: Mapping[str, Any]) -> list[str]:
    """The two load shapes' agreement, the scaling by partitions and a fresh worker's first seconds."""
    lines: list[str] = []
    for pair, entry in (doc.get("shapes") or {}).items():
        verdict = "AGREE" if entry["agree"] else "DISAGREE"
        lines.append("")
        lines.append(f"load shapes {pair} (within {entry['tolerance']:.0%}): {verdict}")
        for c in entry["checks"]:
            mark = {True: "ok", False: "NO", None: "-"}[c["agree"]]
            digits = 3 if "CPU" in c["what"] else 1  # CPU: tenths of a ms are most of the figure
            lines.append(f"  {c['what']:<34}{_num(c['inside'], 10, digits)}{_num(c['outside'], 10, digits)}  {mark}")
    scaling = doc.get("scaling")
    if scaling:
        lines.append("")
        lines.append(
            f"scaling by partitions (batched, p99 < 200 ms): 1 worker {_num(scaling['workers_1_tps'], 0)} TPS, "
            f"2 workers {_num(scaling['workers_2_tps'], 0)} TPS (x{scaling['ratio']})"
        )
    fresh = next((r for r in doc["runs"] if r.get("first_seconds")), None)
    if fresh:
        f = fresh["first_seconds"]
        lat = f["latency_ms"]
        lines.append("")
        lines.append(
            f"a fresh worker's first {f['seconds']:g} s after Ready at {fresh['offered_tps']:,.0f} TPS: "
            f"{f['decided']:,} decided, p50 {lat['p50']} / p99 {lat['p99']} / max {lat['max']} ms; p99 per second "
            f"{f['p99_by_second']}; {f['undecided_at_end']} sent in them undecided by their end"
        )
    return lines


def write_results(doc: dict[str, Any], out_dir: Path) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    text = json.dumps(doc, indent=1) + "\n"
    stamp = doc["started_at"].replace(":", "").replace("-", "")[:15]
    (out_dir / f"bench-{stamp}.json").write_text(text)
    latest = out_dir / "latest.json"
    latest.write_text(text)
    return latest


def _settings_doc(svc: Services) -> dict[str, Any]:
    doc: dict[str, Any] = settings_from_env(svc.env()).model_dump(mode="json")  # secrets come out masked
    # Per variant: see each run's batch_size / batch_window_ms; topics and app id are per worker.
    for key in ("batch_size", "batch_window_s", "app_id", "web_port"):
        doc.pop(key, None)
    return {k: v for k, v in doc.items() if not k.startswith("topic_")}


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
        help="measure only these of the main variants, the legs (outside, outside-poisson, batched-x2) and fresh; "
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
        bench.reserve_s = sum(leg.min_s for leg in plan.legs) + (30.0 if plan.fresh_rate else 0.0)
        for variant in main_variants:
            bench.main_variant(variant)
        for leg in plan.legs:
            bench.reserve_s -= leg.min_s
            bench.main_variant(leg.variant, leg)
        bench.reserve_s = 0.0
        bench.fresh()
        bench.sweep()
        settings = _settings_doc(svc)
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


def _plan_doc(plan: Plan) -> dict[str, Any]:
    doc = asdict(plan)
    doc["sweep"] = [v.name for v in plan.sweep]
    doc["variants"] = [v.name for v in plan.variants]
    doc["thresholds_ms"] = list(THRESHOLDS_MS)
    doc["max_degraded_fraction"] = MAX_DEGRADED_FRACTION
    doc["generator_lag_limit_ms"] = GENERATOR_LAG_LIMIT_MS
    return doc


if __name__ == "__main__":
    sys.exit(main())
