"""PNGs from a bench results document (``bench/results/latest.json``).

    python -m bench.plots [bench/results/latest.json]   # redraw without rerunning

latency_vs_rate.png  p50/p95/p99 against offered rate, every variant (bare, peers, the outside shape included)
stages.png           the pipeline's own per-stage latency (the decisions' ``latency_ms``)
lag.png              transactions awaiting their decision over each main run
sweep.png            p99 and throughput over batch size × window (full mode only)

A ``bench.knobs`` document (``{"rows": [...]}``) draws one PNG beside it: the
worker CPU per transaction and the p99 of each row (one setting or code
version per row, ``label`` when given).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # NOTE: before pyplot: no display on servers and in CI

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.colors import LogNorm  # noqa: E402
from matplotlib.ticker import FuncFormatter  # noqa: E402

from bench.criteria import THRESHOLDS_MS, generator_kept_up  # noqa: E402

__all__ = ["knobs_plot", "plot_all"]

#: Fixed colours for the variants every run has; any other variant (the
#: outside shape, two workers) gets the next free one of tab10.
COLORS = {
    "bare": "tab:green", "ceiling": "tab:gray", "streams": "tab:olive", "streams-25ms": "tab:cyan",
    "unbatched": "tab:red", "batched": "tab:blue",
}  # fmt: skip
#: The pipeline's stages in flow order; stages it adds later are drawn after these.
STAGES = ("queue_wait", "validate", "cache", "features", "model", "rules")

Run = Mapping[str, Any]


def _runs(doc: Mapping[str, Any], variant: str, phases: Sequence[str] = ("rate", "search")) -> list[Run]:
    runs = [r for r in doc["runs"] if r["variant"] == variant and r.get("phase") in phases]
    return sorted(runs, key=lambda r: r["offered_tps"])


def variant_colors(doc: Mapping[str, Any]) -> dict[str, str]:
    """Every variant with a rate or search run, in the order of first appearance,
    mapped to its colour: the fixed ones of COLORS, then tab10's free ones."""
    names = list(dict.fromkeys(r["variant"] for r in doc["runs"] if r.get("phase") in ("rate", "search")))
    free = iter(c for c in (f"tab:{n}" for n in ("orange", "purple", "brown", "pink", "olive", "cyan"))
                if c not in COLORS.values())  # fmt: skip
    out = {}
    for name in sorted(names, key=lambda n: (n not in COLORS, list(COLORS).index(n) if n in COLORS else 0)):
        out[name] = COLORS.get(name) or next(free, "black")
    return out


def _subtitle(doc: Mapping[str, Any]) -> str:
    m = doc["machine"]
    return f"{m['cores']} cores, {m['cpu_model']}, {'quick' if doc.get('quick') else 'full'} run {doc['started_at']}"


def _rate_label(value: float, _pos: object) -> str:
    """1, 2 and 5 times a power of ten, written out (2,000, not 2×10³); no label between."""
    if value <= 0:
        return ""
    lead = value / 10 ** np.floor(np.log10(value))
    return f"{value:,.0f}" if any(abs(lead - m) < 1e-6 for m in (1, 2, 5)) else ""


def latency_vs_rate(doc: Mapping[str, Any], out: Path) -> Path:
    fig, ax = plt.subplots(figsize=(10, 6))
    for variant, color in variant_colors(doc).items():
        runs = [r for r in _runs(doc, variant) if r["p50_ms"] is not None]
        if not runs:
            continue
        x = [r["offered_tps"] for r in runs]
        for key, style, label in (("p50_ms", ":", "p50"), ("p95_ms", "--", "p95"), ("p99_ms", "-", "p99")):
            ax.plot(x, [r[key] for r in runs], style, color=color, marker="o", ms=3, label=f"{variant} {label}")
        # Runs that lost decisions (their percentiles flatter them) or whose generator lagged.
        bad = [r for r in runs if r["lost"] or not generator_kept_up(r)]
        if bad:
            ax.scatter([r["offered_tps"] for r in bad], [r["p99_ms"] for r in bad], marker="x", s=60,
                       color=color, zorder=5)  # fmt: skip
    # NOTE: log rates (tens to tens of thousands of TPS), set before the
    # thresholds' labels are placed at the axis's left end.
    ax.set_xscale("log")
    ax.xaxis.set_major_formatter(FuncFormatter(_rate_label))
    ax.xaxis.set_minor_formatter(FuncFormatter(_rate_label))
    for t in THRESHOLDS_MS:
        ax.axhline(t, color="black", lw=0.8, alpha=0.5)
        ax.text(ax.get_xlim()[0], t, f" {t:g} ms", va="bottom", fontsize=8)
    ax.set_yscale("log")
    ax.set_xlabel("offered rate (transactions/s; Poisson, the outside shape constant unless named -poisson)")
    ax.set_ylabel("latency send → decision read (ms)")
    ax.set_title(f"Latency vs offered rate (x: decisions lost, or the generator lagged)\n{_subtitle(doc)}", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=6, ncol=3)
    path = out / "latency_vs_rate.png"
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def stages(doc: Mapping[str, Any], out: Path) -> Path | None:
    """Top: the scoring stages' p50s stacked, queue wait and end to end written above.
    Bottom: every stage's p99, queue wait included, on a log scale.

    NOTE: stages other than queue_wait are per batch: every decision of a batch
    carries its batch's times. Queue wait runs from the producer's timestamp to
    the start of scoring (linger, broker, fetch wait, take batching, backlog).
    """
    variants = [v for v in ("unbatched", "batched") if any(r["stages"] for r in _runs(doc, v, ("rate",)))]
    if not variants:
        return None
    fig, axes = plt.subplots(2, len(variants), figsize=(6.5 * len(variants), 8), squeeze=False)
    cmap = plt.get_cmap("tab10")
    seen = {name for v in variants for r in _runs(doc, v, ("rate",)) for name in r["stages"]}
    order = [*STAGES, *sorted(seen - set(STAGES) - {"total", "after"})]  # after: not scoring work
    work = order[1:]  # everything after queue_wait
    for col, variant in enumerate(variants):
        runs = [r for r in _runs(doc, variant, ("rate",)) if r["stages"]]
        labels = [f"{r['offered_tps']:,.0f}" for r in runs]
        x = np.arange(len(runs))

        def stage(run: Run, name: str, pct: str) -> float:
            return float((run["stages"].get(name) or {}).get(pct) or 0.0)

        ax = axes[0][col]
        bottom = np.zeros(len(runs))
        for i, name in enumerate(work, start=1):
            values = np.array([stage(r, name, "p50") for r in runs])
            ax.bar(x, values, 0.6, bottom=bottom, label=name, color=cmap(i))
            bottom += values
        for xi, r, top in zip(x, runs, bottom):
            ax.annotate(f"queue wait {stage(r, 'queue_wait', 'p50'):,.1f}\nend to end {r['p50_ms']:,.1f}",
                        (xi, top), ha="center", va="bottom", fontsize=8)  # fmt: skip
        ax.set_ylim(0, max(bottom.max() * 1.8, 1.0))  # room for the labels and the legend
        ax.set_xticks(x, labels)
        ax.set_xlabel("offered rate (TPS)")
        ax.set_ylabel("p50 ms")
        ax.set_title(f"{variant}: scoring stages, p50 (stacked)", fontsize=9)
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(fontsize=7, ncol=5, loc="upper center")

        ax = axes[1][col]
        names = (*order, "total")
        width = 0.8 / len(names)
        for i, name in enumerate(names):
            p99s = [stage(r, name, "p99") or np.nan for r in runs]  # a missing stage: no bar
            ax.bar(x - 0.4 + (i + 0.5) * width, p99s, width, label=name,
                   color="black" if name == "total" else cmap(i))  # fmt: skip
        ax.plot(x, [r["p99_ms"] for r in runs], "kD", ms=5, label="end to end")
        ax.set_yscale("log")
        low, high = ax.get_ylim()
        ax.set_ylim(max(low, 0.05), high * 30)  # headroom for the legend
        ax.set_xticks(x, labels)
        ax.set_xlabel("offered rate (TPS)")
        ax.set_ylabel("p99 ms (log)")
        ax.set_title(f"{variant}: each stage's p99", fontsize=9)
        ax.grid(True, axis="y", which="both", alpha=0.3)
        ax.legend(fontsize=7, ncol=4, loc="upper center")
    fig.suptitle(f"Where a decision's time goes (the decisions' latency_ms)\n{_subtitle(doc)}", fontsize=10)
    fig.tight_layout()
    path = out / "stages.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def lag(doc: Mapping[str, Any], out: Path) -> Path | None:
    rates = sorted({r["offered_tps"] for r in doc["runs"] if r.get("phase") == "rate"})
    if not rates:
        return None
    fig, axes = plt.subplots(1, len(rates), figsize=(5 * len(rates), 4), squeeze=False)
    for ax, rate in zip(axes[0], rates):
        for variant, color in variant_colors(doc).items():
            for r in _runs(doc, variant, ("rate",)):
                if r["offered_tps"] == rate and r["lag"]:
                    t, n = zip(*r["lag"])
                    ax.plot(t, n, color=color, label=variant)
                    ax.axvline(r["warmup_s"], color="black", lw=0.6, alpha=0.4)
        ax.set_title(f"{rate:,.0f} TPS offered", fontsize=9)
        ax.set_xlabel("s since load start (line: end of warm-up)")
        ax.set_ylabel("awaiting decision")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(f"End-to-end lag: transactions sent and not yet decided\n{_subtitle(doc)}", fontsize=10)
    fig.tight_layout()
    path = out / "lag.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def sweep(doc: Mapping[str, Any], out: Path) -> Path | None:
    runs = [r for r in doc["runs"] if r.get("phase") == "sweep" and r["p99_ms"] is not None]
    if not runs:
        return None
    sizes = sorted({r["batch_size"] for r in runs})
    windows = sorted({r["batch_window_ms"] for r in runs})
    p99 = np.full((len(sizes), len(windows)), np.nan)
    text = [["" for _ in windows] for _ in sizes]
    for r in runs:
        i, j = sizes.index(r["batch_size"]), windows.index(r["batch_window_ms"])
        p99[i, j] = r["p99_ms"]
        text[i][j] = f"p99 {r['p99_ms']:,.0f}\np50 {r['p50_ms']:,.0f}\n{r['achieved_tps']:,.0f}/s"
        if r["lost"]:
            text[i][j] += f"\nlost {r['lost']}"
    fig, ax = plt.subplots(figsize=(max(7.0, 2.2 * len(windows) + 2), 1.3 * len(sizes) + 2.5))
    finite = p99[np.isfinite(p99)]
    # A fixed scale (10 ms .. 1 s at least), so colours mean the same from run to run.
    vmin, vmax = min(10.0, float(finite.min())), max(1000.0, float(finite.max()))
    norm = LogNorm(vmin=vmin, vmax=vmax)
    im = ax.imshow(p99, cmap="viridis_r", norm=norm, aspect="auto")
    for i in range(len(sizes)):
        for j in range(len(windows)):
            ax.text(j, i, text[i][j], ha="center", va="center", fontsize=8,
                    color="white" if np.isfinite(p99[i, j]) and p99[i, j] > np.sqrt(vmin * vmax) else "black")  # fmt: skip
    ax.set_xticks(range(len(windows)), [f"{w:g} ms" for w in windows])
    ax.set_yticks(range(len(sizes)), [str(s) for s in sizes])
    ax.set_xlabel("batch window (FRAUD_BATCH_WINDOW_S)")
    ax.set_ylabel("batch size (FRAUD_BATCH_SIZE)")
    fig.colorbar(im, ax=ax, label="p99 ms")
    rate = runs[0]["offered_tps"]
    ax.set_title(f"Batch size × window at {rate:,.0f} TPS offered\n{_subtitle(doc)}", fontsize=9)
    fig.tight_layout()
    path = out / "sweep.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_all(doc: Mapping[str, Any], out: Path) -> list[Path]:
    """Draw every plot the document has data for; return the files written."""
    out.mkdir(parents=True, exist_ok=True)
    drawn = [latency_vs_rate(doc, out), stages(doc, out), lag(doc, out), sweep(doc, out)]
    # A quick run draws no sweep: do not leave an older run's next to its numbers.
    for name in ("stages.png", "lag.png", "sweep.png"):
        if out / name not in drawn:
            (out / name).unlink(missing_ok=True)
    return [p for p in drawn if p is not None]


def knobs_plot(doc: Mapping[str, Any], path: Path) -> Path:
    """Worker CPU ms per transaction and p99 per ``bench.knobs`` row, side by side."""
    rows = doc["rows"]
    names = [
        f"{r.get('label') + ': ' if r.get('label') else ''}{r['knob']} @ {r['offered_tps']:,.0f} TPS" for r in rows
    ]
    y = np.arange(len(rows))[::-1]
    fig, (cpu, p99) = plt.subplots(1, 2, figsize=(11, 0.45 * len(rows) + 1.6), sharey=True)
    cpu.barh(y, [r["cpu_ms_per_tx"] or 0 for r in rows], color="tab:blue")
    cpu.set_xlabel("worker CPU ms per decided transaction")
    cpu.set_yticks(y, names, fontsize=8)
    p99.barh(y, [r["p99_ms"] or 0 for r in rows], color="tab:orange")
    p99.set_xlabel("p99 ms, send to decision")
    for ax, key in ((cpu, "cpu_ms_per_tx"), (p99, "p99_ms")):
        for yi, r in zip(y, rows):
            if r.get(key) is not None:
                ax.annotate(f" {r[key]:g}", (r[key], yi), va="center", fontsize=7)
    return _save(fig, doc, "bench.knobs", path)


def scorer_redis_plot(doc: Mapping[str, Any], path: Path) -> Path:
    """Per ``bench.scorer`` batch size, per transaction: the scorer's CPU, Redis's,
    the batch script's time in Redis, and the time of every command counted apart."""
    rows = [r for r in doc["rows"] if r.get("redis_cpu_us_per_tx") is not None]
    labels = [f"{r['batch']} ({r['lookup']})" for r in rows]
    x = np.arange(len(rows))
    fig, ax = plt.subplots(figsize=(8, 4.2))
    width = 0.2
    scorer = [r["cpu_ms_per_tx"] * 1000 for r in rows]
    redis_all = [r["redis_cpu_us_per_tx"] for r in rows]
    script = [r["redis_command_us_per_tx"].get("evalsha", 0.0) for r in rows]
    commands = [sum(v for k, v in r["redis_command_us_per_tx"].items() if k not in ("evalsha", "script|load"))
                for r in rows]  # fmt: skip
    for i, (values, name) in enumerate(((scorer, "scorer process CPU"), (redis_all, "Redis CPU"),
                                        (script, "Redis: the batch script (commands in it included)"),
                                        (commands, "Redis: every command counted apart"))):  # fmt: skip
        ax.bar(x + (i - 1.5) * width, values, width, label=name)
        for xi, v in zip(x, values):
            ax.annotate(f"{v:.0f}", (xi + (i - 1.5) * width, v), ha="center", va="bottom", fontsize=7)
    ax.set_xticks(x, labels)
    ax.set_xlabel("records per batch (lookup)")
    ax.set_ylabel("µs per transaction")
    ax.set_yscale("log")
    ax.legend(fontsize=8)
    return _save(fig, doc, "bench.scorer — the scoring stage and its Redis", path)


def velocity_plot(doc: Mapping[str, Any], path: Path) -> Path:
    """``bench.velocity``: Redis's and the worker's µs per transaction, by events a
    user has, for the script as kept and as it was."""
    rows = doc["rows"]
    events = sorted({r["events_per_user"] for r in rows})
    fig, ax = plt.subplots(figsize=(7, 4))
    x = np.arange(len(events))
    width = 0.2
    bars = [("earlier", "redis_us_per_tx_p50", "Redis, amounts cut in Lua (earlier)"),
            ("kept", "redis_us_per_tx_p50", "Redis, ZRANGE's reply as it is (kept)"),
            ("earlier", "worker_cpu_us_per_tx_p50", "worker, earlier reply"),
            ("kept", "worker_cpu_us_per_tx_p50", "worker, kept reply")]  # fmt: skip
    for k, (script, field, label) in enumerate(bars):
        values = [next(r[field] for r in rows if r["script"] == script and r["events_per_user"] == e) for e in events]
        ax.bar(x + (k - 1.5) * width, values, width, label=label)
        for xi, v in zip(x, values):
            ax.annotate(f"{v:.0f}", (xi + (k - 1.5) * width, v), ha="center", va="bottom", fontsize=7)
    ax.set_xticks(x, [str(e) for e in events])
    ax.set_xlabel("velocity events per user")
    ax.set_ylabel("µs per transaction (p50 of batches)")
    ax.legend(fontsize=8)
    return _save(fig, doc, "bench.velocity — the enrichment script's velocity reply", path)


def feedback_drain_plot(doc: Mapping[str, Any], path: Path) -> Path:
    """``bench.feedback_drain``: each cell's records a second and CPU per record, by variant, in run order."""
    rows = [r for r in doc["rows"] if "records_per_s" in r]
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.6))
    colors = {"change": "tab:blue", "base": "tab:gray"}
    for ax, field, label in (
        (left, "records_per_s", "records a second"),
        (right, "cpu_us_per_record", "worker CPU µs a record"),
    ):
        for k, r in enumerate(rows):
            ax.bar(k, r[field], color=colors.get(r["variant"], "tab:orange"))
            ax.annotate(f"{r[field]:,.0f}", (k, r[field]), ha="center", va="bottom", fontsize=7)
        ax.set_xticks(range(len(rows)), [r["variant"] for r in rows], fontsize=7)
        ax.set_ylabel(label)
    return _save(fig, doc, "bench.feedback_drain — a feedback worker draining feedback and labels", path)


def _save(fig: Any, doc: Mapping[str, Any], title: str, path: Path) -> Path:
    """``fig`` to ``path``, titled with the machine the document was measured on."""
    m = doc.get("machine", "")
    where = f"{m.get('cores')} cores, {m.get('cpu_model')}" if isinstance(m, dict) else m
    fig.suptitle(f"{title} — {where}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


if __name__ == "__main__":
    source = Path(sys.argv[1]) if len(sys.argv) > 1 else Path("bench/results/latest.json")
    document = json.loads(source.read_text())
    if "rows" in document and "knob" in document["rows"][0]:  # a bench.knobs document
        print(knobs_plot(document, source.with_suffix(".png")))
    elif "rows" in document:  # a bench.scorer document
        print(scorer_redis_plot(document, source.with_suffix(".png")))
    else:
        for png in plot_all(document, source.parent):
            print(png)
