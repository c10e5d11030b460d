"""The report: the results document's settings and plan, the table printed to stdout, the files written."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict
from pathlib import Path
from typing import Any

from bench.criteria import GENERATOR_LAG_LIMIT_MS, THRESHOLDS_MS
from bench.plan import MAIN_VARIANTS, Plan
from bench.verdicts import MAX_DEGRADED_FRACTION, threshold_key
from bench.workers import Services, settings_from_env

__all__ = ["SCHEMA", "format_report", "write_results"]

SCHEMA = "fraud-pipeline-bench/1"


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
            elif found.get("cut_short"):  # the time budget stopped its search: only bracketed
                text = f"{lo:,.0f}-{hi:,.0f}, cut short"
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
        cut = scaling.get("cut_short") or []
        lines.append(
            f"scaling by partitions (batched, p99 < 200 ms): 1 worker {_num(scaling['workers_1_tps'], 0)} TPS, "
            f"2 workers {_num(scaling['workers_2_tps'], 0)} TPS "
            + (f"(no ratio: the search of {', '.join(cut)} was cut short by the time budget)" if cut
               else f"(x{scaling['ratio']})")
        )  # fmt: skip
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


def _plan_doc(plan: Plan) -> dict[str, Any]:
    doc = asdict(plan)
    doc["sweep"] = [v.name for v in plan.sweep]
    doc["variants"] = [v.name for v in plan.variants]
    doc["thresholds_ms"] = list(THRESHOLDS_MS)
    doc["max_degraded_fraction"] = MAX_DEGRADED_FRACTION
    doc["generator_lag_limit_ms"] = GENERATOR_LAG_LIMIT_MS
    return doc
