"""Pure verdicts on measured runs: pass/fail, the rate search, ratios, CPU per decision, the results' shape."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from bench.criteria import THRESHOLDS_MS, generator_kept_up
from bench.plan import Variant

__all__ = [
    "MAX_DEGRADED_FRACTION", "SHAPE_PAIRS", "bracket", "cpu_by_rate", "cpu_pct_between",
    "cpu_per_decision_by_variant", "needs_repeat", "next_probe", "passes", "ratios", "run_record", "saturated",
    "saturated_tps", "scaling_doc", "shape_figures", "shapes_doc", "sustainable", "threshold_key",
    "throughput_ratios", "validate_results", "verdicts",
]  # fmt: skip

MAX_DEGRADED_FRACTION = 0.01


def threshold_key(threshold_ms: float) -> str:
    return f"p99_under_{threshold_ms:g}ms"


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
    first = max_sustainable.get("batched", {}).get(key) or {}
    second = max_sustainable["batched-x2"].get(key) or {}
    one, two = first.get("tps"), second.get("tps")
    # A knee whose search the time budget stopped is only bracketed: no ratio of it.
    cut = [name for name, e in (("batched", first), ("batched-x2", second)) if e.get("cut_short")]
    return {
        "workers_1_tps": one, "workers_2_tps": two,
        "ratio": round(two / one, 3) if one and two and not cut else None,
        "cut_short": cut,
    }  # fmt: skip


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
