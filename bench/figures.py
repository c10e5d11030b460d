"""The performance figures the docs quote, rendered from a bench run's results.

README.md and docs/performance.md quote ``make bench``'s figures only between
markers (``<!-- bench:NAME -->`` ... ``<!-- /bench:NAME -->``) whose contents
this module renders from ``bench/results/latest.json``; ``python -m bench.run``
rewrites them at the end of every run, so a figure in the docs is never typed by
hand and never outlives the run it came from. tests/unit/test_docs_drift.py
holds the committed blocks equal to what :func:`render` makes of the committed
results.

    python -m bench.figures        # rewrite the blocks from bench/results/latest.json
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from bench.criteria import THRESHOLDS_MS
from bench.verdicts import passes

__all__ = [
    "BLOCKS",
    "DOCS",
    "GOALS",
    "LOOP_SETTINGS",
    "SIZING_TPS",
    "STAGES",
    "Goal",
    "render",
    "replace_blocks",
    "update_docs",
]

REPO = Path(__file__).resolve().parents[1]
LATEST = REPO / "bench" / "results" / "latest.json"
#: The documents that may hold blocks (any other block name in them is an error).
DOCS = (REPO / "README.md", REPO / "docs" / "performance.md")

#: The main variants, in the order the bench runs them, with what each measures.
VARIANTS = {
    "bare": "librdkafka consumer → producer, no faust, no transaction (the transport's limit)",
    "ceiling": "faust pass-through (`bench/passthrough.py`)",
    "batched": "the exactly-once pipeline, default settings",
    "unbatched": "the pipeline with one record per batch and per transaction",
}
_THRESHOLD = "p99_under_200ms"
_BLOCK = re.compile(r"(<!-- bench:([a-z-]+) -->\n)(.*?)(<!-- /bench:\2 -->)", re.S)


def _tps(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f}"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f}"


def _cpu(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _first_run(doc: Mapping[str, Any], variant: str, offered_tps: float) -> Mapping[str, Any] | None:
    """The first run of ``variant`` at ``offered_tps`` (a repeat's verdict is in ``max_sustainable``)."""
    return next((r for r in doc["runs"] if r["variant"] == variant and r["offered_tps"] == offered_tps), None)


def _held_run(doc: Mapping[str, Any], variant: str, offered_tps: float) -> Mapping[str, Any] | None:
    """The run of ``variant`` at its knee ``offered_tps`` that passed the search's
    own verdict (a repeat, when the first run there did not), else the first."""
    runs = [r for r in doc["runs"] if r["variant"] == variant and r["offered_tps"] == offered_tps]
    return next((r for r in runs if passes(r, THRESHOLDS_MS[0])), runs[0] if runs else None)


def _rate_row(doc: Mapping[str, Any], variant: str, offered_tps: float) -> Mapping[str, Any] | None:
    rows = doc.get("cpu_ms_per_decision_by_rate", {}).get(variant, [])
    return next((r for r in rows if r["offered_tps"] == offered_tps), None)


def _cut_short(doc: Mapping[str, Any], variant: str) -> bool:
    """Whether the time budget stopped the search of ``variant``'s knee (only bracketed then):
    its entry says so, or (results written before entries did) the run's ``truncated`` list."""
    entry = doc["max_sustainable"].get(variant, {}).get(_THRESHOLD) or {}
    return bool(entry.get("cut_short")) or f"{variant}: search for {_THRESHOLD}" in doc.get("truncated", ())


def _knee_text(doc: Mapping[str, Any], variant: str) -> str:
    """A knee as the goals and tables give it: bracketed where its search was cut short."""
    lo, hi, open_ = _knee(doc, variant)
    if hi is not None and _cut_short(doc, variant):
        return f"{_tps(lo)}-{_tps(hi)} (search cut short)"
    return ("≥ " if open_ else "") + _tps(lo)


def _knee(doc: Mapping[str, Any], variant: str) -> tuple[float | None, float | None, bool]:
    """The highest rate that kept p99 under 200 ms, the lowest that did not, and
    whether no probed rate failed (the knee is then a lower bound)."""
    found = doc["max_sustainable"].get(variant, {}).get(_THRESHOLD)
    if not found:
        return None, None, False
    lo, hi = found["bracket"]
    return lo, hi, bool(found["lower_bound"])


def _when(doc: Mapping[str, Any]) -> str:
    started = datetime.fromisoformat(doc["started_at"])
    return started.strftime("%Y-%m-%d %H:%M UTC")


def _machine(doc: Mapping[str, Any]) -> str:
    machine = doc["machine"]
    return f"{machine['cores']} cores ({machine['cpu_model']})"


def _speed(doc: Mapping[str, Any]) -> str:
    """The machine's speed over the run (bench/procs.py, python_loop_ms), if recorded."""
    machine = doc["machine"]
    start, end = machine.get("python_loop_ms_at_start"), machine.get("python_loop_ms_at_end")
    if start is None:
        return ""
    at_end = f", {end:,.0f} ms at its end" if end is not None else ""
    return f" A fixed pure-Python loop took {start:,.0f} ms at the run's start{at_end}: compare runs by it."


def _max_achieved(doc: Mapping[str, Any], variant: str) -> float | None:
    value = doc.get("throughput_ratios", {}).get("max_achieved_tps", {}).get(variant)
    return None if value is None else float(value)


def render_headline(doc: Mapping[str, Any]) -> str:
    """README's paragraph: the pipeline's knee beside the pass-through's and the transport's."""
    lo, hi, _ = _knee(doc, "batched")
    at = _held_run(doc, "batched", lo) if lo is not None else None
    there = [f"p50 {_ms(at['p50_ms'])} / p99 {_ms(at['p99_ms'])} ms"] if at else []
    there += [f"fails {_tps(hi)}"] if hi is not None else []
    ceiling, _, ceiling_open = _knee(doc, "ceiling")
    bare, _, bare_open = _knee(doc, "bare")
    quick = ", `QUICK=1`" if doc.get("quick") else ""
    return (
        f"On {doc['machine']['cores']} cores shared by Kafka, Redis, one worker and the load generator, the\n"
        f"exactly-once pipeline sustained **{_tps(lo)} TPS at p99 < 200 ms**"
        f"{' (' + '; '.join(there) + ')' if there else ''},\n"
        f"the faust pass-through {'≥ ' if ceiling_open else ''}{_tps(ceiling)}, a bare librdkafka client "
        f"{'≥ ' if bare_open else ''}{_tps(bare)} (`make bench`, {_when(doc)}{quick}).\n"
    )


@dataclass(frozen=True)
class Goal:
    """A performance goal and how a run's results answer it: (what was measured, met)."""

    label: str
    check: Callable[[Mapping[str, Any]], tuple[str, bool | None]]


#: The variants a client's latency goals are read on: the bench's own load
#: shape and the independent client's (bench/outside.py).
CLIENT_VARIANTS = ("batched", "outside", "outside-poisson")


def _goal_latency_every_rate(doc: Mapping[str, Any]) -> tuple[str, bool | None]:
    """p99 ≤ 50 ms and p50 ≤ 25 ms at every rate measured from 10 to 2,000 TPS, both shapes."""
    runs = [
        r for r in doc["runs"]
        if r["variant"] in CLIENT_VARIANTS and 10.0 <= r["offered_tps"] <= 2000.0 and r.get("p99_ms") is not None
    ]  # fmt: skip
    if not runs:
        return "not measured", None
    worst99 = max(runs, key=lambda r: r["p99_ms"])
    worst50 = max(runs, key=lambda r: r["p50_ms"])
    text = (
        f"worst p99 {_ms(worst99['p99_ms'])} ms (`{worst99['variant']}` at {_tps(worst99['offered_tps'])}), "
        f"worst p50 {_ms(worst50['p50_ms'])} ms (`{worst50['variant']}` at {_tps(worst50['offered_tps'])}), "
        f"{len(runs)} runs"
    )
    return text, worst99["p99_ms"] <= 50.0 and worst50["p50_ms"] <= 25.0


#: The two load shapes, each by the variants that run it with one worker and with two.
SHAPE_VARIANTS: dict[str, tuple[str, ...]] = {"inside": ("batched", "batched-x2"), "outside": ("outside", "outside-x2")}


def _goal_rate(tps: float, workers: int) -> Callable[[Mapping[str, Any]], tuple[str, bool | None]]:
    """``tps`` at p99 < 200 ms in both load shapes, each by its best knee with
    up to ``workers`` workers. Met when each shape reached it; a shape not
    measured is not a pass."""

    def check(doc: Mapping[str, Any]) -> tuple[str, bool | None]:
        parts, best = [], {}
        for shape, variants in SHAPE_VARIANTS.items():
            knees = {v: k for v in variants[:workers] if (k := _knee(doc, v)[0]) is not None}
            if knees:
                best[shape] = max(knees.values())
                parts.append(f"{shape}: " + ", ".join(f"`{v}` {_knee_text(doc, v)}" for v in knees))
        if not best:
            return "not measured", None
        return "; ".join(parts), len(best) == len(SHAPE_VARIANTS) and all(k >= tps for k in best.values())

    return check


def _goal_shapes(doc: Mapping[str, Any]) -> tuple[str, bool | None]:
    pairs = doc.get("shapes") or {}
    if not pairs:
        return "not measured", None
    parts = []
    for name, pair in pairs.items():
        checks = [c for c in pair["checks"] if c["agree"] is not None]
        parts.append(f"{name}: {sum(c['agree'] for c in checks)} of {len(checks)} figures within 10 %")
    return "; ".join(parts), all(pair["agree"] for pair in pairs.values())


def _goal_peer(doc: Mapping[str, Any]) -> tuple[str, bool | None]:
    peer = doc.get("against_peer") or {}
    beats = {k: v for k, v in (peer.get("beats") or {}).items() if v is not None}
    if not beats:
        return "not measured", None
    text = ", ".join(f"`{k}`: {'below' if v else 'not below'} at every shared rate" for k, v in beats.items())
    return f"`batched` p99 against {text}", all(beats.values())


def _goal_first_seconds(doc: Mapping[str, Any]) -> tuple[str, bool | None]:
    first = doc.get("first_seconds")
    if not first or not first.get("latency_ms"):
        return "not measured", None
    p99 = first["latency_ms"].get("p99")
    if p99 is None:
        return "not measured", None
    return f"p99 {_ms(p99)} ms over the first {first['seconds']:g} s", p99 < 200.0


#: The goals every run is read against (the project's targets on this 2-core machine).
GOALS: tuple[Goal, ...] = (
    Goal("p99 ≤ 50 ms and p50 ≤ 25 ms at every rate from 10 to 2,000 TPS, both load shapes", _goal_latency_every_rate),
    Goal("5,000 TPS at p99 < 200 ms, both load shapes (one or two workers)", _goal_rate(5000.0, workers=2)),
    Goal("2,000 TPS at p99 < 200 ms, both load shapes", _goal_rate(2000.0, workers=1)),
    Goal("the two load shapes agree within 10 %", _goal_shapes),
    Goal("p99 below the Kafka Streams peer's at every rate up to the knee", _goal_peer),
    Goal("a fresh worker's first 5 s after Ready at p99 < 200 ms", _goal_first_seconds),
)


def _verdict(met: bool | None) -> str:
    return {True: "met", False: "**not met**", None: "-"}[met]


def _value(value: Any) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    return f"{value:g}" if isinstance(value, float) else str(value)


#: The scoring loop's settings a run records, as the docs name them (those a run's code had).
LOOP_SETTINGS = ("commit_interval_s", "commit_caught_up", "quiet_below_tps", "quiet_window_s", "fetch_min_bytes")


def _loop_settings(doc: Mapping[str, Any]) -> list[str]:
    """The batched variant's batch shape and the loop's settings in that run."""
    batched = next((r for r in doc["runs"] if r["variant"] == "batched"), None)
    shape = (
        [f"`FRAUD_BATCH_SIZE` {batched['batch_size']}", f"`FRAUD_BATCH_WINDOW_S` {batched['batch_window_ms'] / 1000:g}"]
        if batched
        else []
    )
    recorded = doc.get("settings", {})
    named = [f"`FRAUD_{key.upper()}` {_value(recorded[key])}" for key in LOOP_SETTINGS if key in recorded]
    if not shape and not named:
        return []
    return ["The batched pipeline's loop in that run: " + ", ".join(shape + named) + ".", ""]


def render_summary(doc: Mapping[str, Any]) -> str:
    """performance.md's tables: each variant's knee, the goals, every rate, the batch sweep."""
    lines = [
        f"`make bench` on {_when(doc)}{' (`QUICK=1`)' if doc.get('quick') else ''}, {doc['duration_s']:,.0f} s, "
        f"on {_machine(doc)}; `bench/results/latest.json`.{_speed(doc)}",
        "",
        *_loop_settings(doc),
        "| variant | what | max TPS with p99 < 200 ms | p50 / p99 there (ms) | most decided/s in any run |",
        "|---|---|---|---|---|",
    ]
    for variant, what in VARIANTS.items():
        lo, hi, open_ = _knee(doc, variant)
        if lo is None and variant not in doc["max_sustainable"]:
            continue
        at = _held_run(doc, variant, lo) if lo is not None else None
        knee = ("≥ " if open_ else "") + _tps(lo) + (f" (fails {_tps(hi)})" if hi is not None else "")
        if _cut_short(doc, variant):
            knee += ", search cut short"
        there = f"{_ms(at['p50_ms'])} / {_ms(at['p99_ms'])}" if at else "-"
        lines.append(f"| `{variant}` | {what} | {knee} | {there} | {_tps(_max_achieved(doc, variant))} |")
    ratios = doc.get("ratios", {})
    lines += [
        "",
        f"Ratios of the knees: batched / unbatched {ratios.get('batched_over_unbatched')}, "
        f"batched / ceiling {ratios.get('batched_over_ceiling')}, batched / bare {ratios.get('batched_over_bare')}.",
        "",
        "| goal | this run | |",
        "|---|---|---|",
    ]
    for goal in GOALS:
        text, met = goal.check(doc)
        lines.append(f"| {goal.label} | {text} | {_verdict(met)} |")
    lines += [
        "",
        "Every rate (the first run of each; `*` the knee, `x` over 200 ms or not kept up with); CPU ms per "
        "decision of each process over the measured window:",
        "",
        "| variant | offered TPS | achieved | p50 / p99 / p99.9 ms | worker / broker / Redis / generator CPU ms |",
        "|---|---|---|---|---|",
    ]
    by_rate = doc.get("cpu_ms_per_decision_by_rate", {})
    for variant in VARIANTS:
        for row in by_rate.get(variant, []):
            run = _first_run(doc, variant, row["offered_tps"])
            mark = "*" if row["knee"] else "" if row["passes"] else " x"
            latency = f"{_ms(run['p50_ms'])} / {_ms(run['p99_ms'])} / {_ms(run['p999_ms'])}" if run else "-"
            cpu = " / ".join(_cpu(row.get(k)) for k in ("worker", "broker", "redis", "loadgen"))
            lines.append(
                f"| {variant} | {_tps(row['offered_tps'])}{mark} | {_tps(row['achieved_tps'])} | {latency} | {cpu} |"
            )
    lines += _stages(doc)
    sweep = [r for r in doc["runs"] if r.get("phase") == "sweep"]
    if sweep:
        lines += [
            "",
            "The batch sweep (batch size × window, at one rate):",
            "",
            "| batch / window | offered TPS | achieved | p50 / p99 ms | degraded | worker CPU ms |",
            "|---|---|---|---|---|---|",
        ]
        for run in sweep:
            worker_ms = (run.get("cpu_ms_per_decision") or {}).get("worker")
            lines.append(
                f"| {run['batch_size']} / {run['batch_window_ms']:g} ms | {_tps(run['offered_tps'])} | "
                f"{_tps(run['achieved_tps'])} | {_ms(run['p50_ms'])} / {_ms(run['p99_ms'])} | {run['degraded']} | "
                f"{_cpu(worker_ms)} |"
            )
    return "\n".join(lines) + "\n"


#: A decision's own stages (its ``latency_ms``), in the order it meets them,
#: then ``after``: from its decision to its arrival at the client (tools/loadgen.py).
STAGES = ("queue_wait", "validate", "cache", "features", "model", "rules", "total", "after")
#: The pipeline under each load shape, in the stage table.
SHAPES = ("batched", "outside", "outside-poisson")


def _stages(doc: Mapping[str, Any]) -> list[str]:
    """The pipeline's stage latencies under each load shape, at each main rate it kept up with."""
    runs = [r for r in doc["runs"] if r["variant"] in SHAPES and r.get("phase") == "rate" and r.get("stages")]
    runs = [r for r in runs if r["p99_ms"] is not None and r["p99_ms"] < 200.0]
    if not runs:
        return []
    runs.sort(key=lambda r: (r["offered_tps"], SHAPES.index(r["variant"])))
    lines = [
        "",
        "Where a decision's time went, under each load shape (its `latency_ms`: `queue_wait` is sent to "
        "taken, `total` sent to decided; `after` is the rest of the latency above: the wait for the "
        "transaction's commit, the commit and the `read_committed` fetch back), p50 / p99 ms:",
        "",
        "| offered TPS | variant | " + " | ".join(STAGES) + " |",
        "|---" * (len(STAGES) + 2) + "|",
    ]
    for run in runs:
        stages = run["stages"]
        cells = [f"{stages[s]['p50']:.1f} / {stages[s]['p99']:.1f}" if s in stages else "-" for s in STAGES]
        lines.append(f"| {_tps(run['offered_tps'])} | {run['variant']} | " + " | ".join(cells) + " |")
    return lines


#: The rate docs/performance.md sizes a deployment for.
SIZING_TPS = 5000.0


def render_sizing(doc: Mapping[str, Any]) -> str:
    """performance.md's sizing for :data:`SIZING_TPS`, scaled linearly from the batched runs at 1,000-2,000 TPS."""
    rows = [
        r for r in doc.get("cpu_ms_per_decision_by_rate", {}).get("batched", [])
        if 1000.0 <= r["offered_tps"] <= 2000.0 and r["passes"]
    ]  # fmt: skip
    lo, _, _ = _knee(doc, "batched")
    if not rows or lo is None:
        return "The last run measured no batched rate between 1,000 and 2,000 TPS: nothing to scale from.\n"

    def spread(key: str) -> tuple[float, float]:
        values = [float(r[key]) for r in rows if r.get(key) is not None]
        return min(values), max(values)

    def span(values: tuple[float, float], scale: float = 1.0, fmt: Callable[[float], str] = _cpu) -> str:
        low, high = (fmt(v * scale) for v in values)
        return low if low == high else f"{low}-{high}"

    top = rows[-1]
    workers = -(-SIZING_TPS // min(lo, 2000.0)) + 1  # at the peak, plus one for a lost worker's partitions
    broker, redis = spread("broker"), spread("redis")
    return (
        f"- **Workers**: one worker carried {_tps(top['offered_tps'])} TPS at p99 {_ms(top['p99_ms'])} ms "
        f"({_cpu(top['worker'])} ms of CPU per decision, {top['worker'] * top['achieved_tps'] / 10.0:.0f} % of a "
        f"core) and kept p99 < 200 ms up to {_tps(lo)}; planned at no more than 2,000 each, plus one for a lost "
        f"worker's partitions: **{workers:.0f} workers** with a core each, and at least as many partitions of "
        "`transactions` (partitions cannot shrink, and adding them moves users).\n"
        f"- **Broker**: {span(broker)} ms per decision on one KRaft node with replication "
        f"factor 1 → {span(broker, SIZING_TPS / 1000, lambda v: f'{v:.1f}')} cores at "
        f"{_tps(SIZING_TPS)} TPS before replication; with replication factor 3 every write is also fetched and "
        "written by two followers (deploy/README.md sizes the cluster from this).\n"
        f"- **Redis**: {span(redis)} ms per decision → "
        f"{redis[1] * SIZING_TPS / 10:.0f} % of one Redis's single thread at {_tps(SIZING_TPS)} TPS; a Redis "
        "Cluster past ~60 %.\n"
    )


#: Block name -> its renderer.
BLOCKS: dict[str, Callable[[Mapping[str, Any]], str]] = {
    "headline": render_headline,
    "summary": render_summary,
    "sizing": render_sizing,
}


def render(doc: Mapping[str, Any]) -> dict[str, str]:
    """Every block's text for the run ``doc`` (a ``bench/results/*.json`` document)."""
    return {name: make(doc) for name, make in BLOCKS.items()}


def replace_blocks(text: str, blocks: Mapping[str, str]) -> str:
    """``text`` with each marked block's contents replaced by ``blocks[name]``."""

    def one(match: re.Match[str]) -> str:
        name = match.group(2)
        if name not in blocks:
            raise KeyError(f"no bench block named {name!r} (known: {sorted(blocks)})")
        return match.group(1) + blocks[name] + match.group(4)

    return _BLOCK.sub(one, text)


def update_docs(doc: Mapping[str, Any], paths: Sequence[Path] = DOCS) -> list[Path]:
    """Rewrite the blocks of ``paths`` from ``doc``; the files that changed."""
    blocks = render(doc)
    changed = []
    for path in paths:
        text = path.read_text()
        new = replace_blocks(text, blocks)
        if new != text:
            path.write_text(new)
            changed.append(path)
    return changed


def main(argv: Sequence[str] | None = None) -> int:
    path = Path(argv[0]) if argv else LATEST
    changed = update_docs(json.loads(path.read_text()))
    for doc_path in changed:
        print(f"updated: {doc_path.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
