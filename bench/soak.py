"""Soak: does the local stack stay flat under steady load? (``python -m bench.soak``).

One worker (``--variant``) at a fixed offered rate for ``--minutes`` against
the broker and Redis this run starts. Per minute of load it reports decisions
per second, the p50/p99 latency of the decisions that arrived in that minute,
the broker's and the worker's CPU per transaction, their RSS and the
transactions in flight. A short benchmark cannot see what only time shows: a
broker whose CPU per message creeps up (segments, indexes, group or transaction
state piling up), tail latency that drifts, memory that grows. So the verdict
compares the end of the run with its start once warm:

    broker CPU per message  mean of the last 5 minutes within 15 % of minutes 2-7's
    p99                     the same
    broker RSS              mean of the last 5 minutes at most 15 % above minutes 2-7's
    worker CPU per decision as broker CPU per message
    worker RSS              as broker RSS
    nothing lost            every transaction sent got its decision

Minute 1 is warm-up (JIT, caches, first segments) and is in no window
(``--warmup-minutes W``: minutes 1-W, the baseline then W+1 to W+6). Runs
under 12 minutes (smoke tests) compare minutes 2..1+w with the last w, where
w = max(1, (minutes - 2) // 2). Writes ``soak.json`` and ``soak.png`` to
``--out``; exits 1 when the verdict fails.

``--brokers 3`` soaks the replicated stack instead (``tools/cluster.py``: three
brokers and three KRaft controllers, every topic with 3 replicas and min ISR 2, Redis with two replicas
and three Sentinels), as a deployment runs: ``--workers`` scoring workers, a
``--role feedback`` worker consuming ``--label-share`` of the transactions'
labels, and a model version promoted through ``fraud-pipeline models promote``
in the middle of the run (in a copy of the registry: the project's served
version does not change). Broker CPU and RSS are the sum of the three nodes
(each node's RSS is in the JSON too); it writes ``soak-cluster.json`` and
``soak-cluster.png``, and fails too when the labels were not all consumed or
the workers did not swap to the promoted version.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from bench.plan import BATCHED, CEILING, DATA, REPO
from bench.procs import machine_info, proc_cpu_s, proc_rss_mb
from bench.workers import (
    READY_TIMEOUT_S,
    SAMPLE_EVERY_S,
    Services,
    Worker,
    _cli,
    _sampler,
    prepare,
    services,
)  # fmt: skip
from tools.loadgen import LoadConfig, percentiles, run_load

VARIANTS = {v.name: v for v in (BATCHED, CEILING)}
TOLERANCE = 0.15
BASELINE_MINUTES = range(2, 8)  # minutes 2-7
LAST_MINUTES = 5
SHORT_RUN_MINUTES = 12  # below this the windows shrink (see windows())
DRAIN_S = 30.0
#: The cluster soak's defaults: labels for 5 % of transactions (chargebacks and
#: analyst verdicts arrive for a few), as the feedback loop sees in production.
CLUSTER_LABEL_SHARE = 0.05
#: After the load, how long the feedback worker gets to commit the last labels'
#: offsets (faust commits every few seconds) before they are counted.
LABELS_SETTLE_S = 15.0
#: A worker's start on the cluster: topics declared at start (3 replicas each)
#: and groups joined, on cores the six JVMs share; one start there took over
#: bench.workers' 90 s.
CLUSTER_READY_S = 240.0
COLUMNS = ("minute", "decided_per_s", "p50_ms", "p99_ms", "broker_cpu_ms_per_message",
           "worker_cpu_ms_per_decision", "broker_rss_mb", "worker_rss_mb", "in_flight")  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=int, default=30)
    parser.add_argument("--rate", type=float, default=500.0)
    parser.add_argument("--variant", choices=sorted(VARIANTS), default="batched")
    parser.add_argument("--brokers", type=int, choices=(1, 3), default=1,
                        help="1: one broker and one Redis; 3: the replicated stack (tools/cluster.py)")  # fmt: skip
    parser.add_argument("--workers", type=int, default=1, help="scoring workers, in one consumer group")
    parser.add_argument("--label-share", type=float, default=None,
                        help=f"share of transactions labelled on `labels`, consumed by a --role feedback worker "
                             f"(default: {CLUSTER_LABEL_SHARE:g} with --brokers 3, else 0: no feedback worker)")  # fmt: skip
    parser.add_argument("--no-promote", action="store_true",
                        help="--brokers 3: leave the served model alone (default: promote another version mid-run)")  # fmt: skip
    parser.add_argument("--warmup-minutes", type=int, default=1,
                        help="minutes of load in no window (JIT, caches, first segments); the baseline follows")  # fmt: skip
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    args = parser.parse_args()
    if args.warmup_minutes < 1:
        parser.error("--warmup-minutes must be at least 1")
    if args.minutes < args.warmup_minutes + 2:
        parser.error("--minutes must be at least --warmup-minutes + 2: the warm-up, then two windows to compare")
    if args.workers < 1:
        parser.error("--workers must be at least 1")
    cluster = args.brokers == 3
    if cluster and args.variant != "batched":
        parser.error("--brokers 3 soaks the scoring pipeline (labels, a promotion): --variant batched")
    label_share = args.label_share if args.label_share is not None else (CLUSTER_LABEL_SHARE if cluster else 0.0)
    promote = cluster and not args.no_promote
    name = "soak-cluster" if cluster else "soak"
    baseline, last, note = windows(args.minutes, args.warmup_minutes)
    promote_at_s = promotion_s(baseline, last) if promote else None
    machine = machine_info()  # before the run: its load average is the machine's, not ours
    with tempfile.TemporaryDirectory(prefix="bench-soak-") as tmp, \
            (cluster_services(Path(tmp)) if cluster else services(Path(tmp))) as svc:  # fmt: skip
        if not any(_is_broker(n) for n in svc.pids):
            sys.exit("bench.soak measures the broker it starts: unset KAFKA_BOOTSTRAP / FRAUD_KAFKA_BOOTSTRAP")
        prepare(svc)
        extra_env: dict[str, str] = {}
        promotion: dict[str, Any] | None = None
        if promote:
            registry = Path(tmp) / "registry"
            served, candidate = soak_registry(_registry(), registry)
            extra_env["FRAUD_REGISTRY_DIR"] = str(registry)
            promotion = {"from": served, "to": candidate, "minute": minute_of(promote_at_s or 0.0)}
        workers = [Worker(VARIANTS[args.variant], svc, Path(tmp), extra_env=extra_env)]
        workers += [Worker(VARIANTS[args.variant], svc, Path(tmp), join=workers[0], extra_env=extra_env)
                    for _ in range(args.workers - 1)]  # fmt: skip
        feedback = None
        if label_share > 0:
            feedback = Worker(VARIANTS[args.variant], svc, Path(tmp), join=workers[0], role="feedback",
                              extra_env=extra_env)  # fmt: skip
        everyone = [*workers, *([feedback] if feedback else [])]
        promoter = None
        try:
            for worker in everyone:
                worker.wait_ready(CLUSTER_READY_S if cluster else READY_TIMEOUT_S)
            if promotion is not None and promote_at_s is not None:
                promoter = Promoter(registry, promotion["to"], promote_at_s)
            cfg = LoadConfig(
                rate=args.rate, duration_s=args.minutes * 60, drain_s=DRAIN_S, data=DATA, seed=7,
                report_every_s=SAMPLE_EVERY_S, quiet=True, settings=workers[0].settings, record_decisions=True,
                label_share=label_share,
                sample=soak_sampler([w.pid for w in workers], feedback.pid if feedback else None, svc.pids,
                                    args.minutes, promoter),
            )  # fmt: skip
            print(f"soak: {len(workers)} {args.variant} worker(s){' + 1 feedback' if feedback else ''} on "
                  f"{args.brokers} broker(s), {args.rate:g} TPS offered for {args.minutes} min"
                  + (f", labels on {label_share:.0%}" if label_share else "")
                  + (f", promotion at {promote_at_s / 60:.1f} min" if promote_at_s is not None else ""),
                  flush=True)  # fmt: skip
            summary = asyncio.run(run_load(cfg))
            labels = None
            if feedback is not None:
                time.sleep(LABELS_SETTLE_S)
                labels = asyncio.run(labels_consumed(workers[0].settings, f"{workers[0].settings.app_id}-feedback"))
            replication = asyncio.run(topic_replication(workers[0].settings)) if cluster else None
        finally:
            if promoter is not None:
                promoter.cancel()
            for worker in everyone:
                worker.stop()
        if promotion is not None and promoter is not None:
            promotion |= promoter.record()
            promotion["swapped"] = [
                swapped_to(w.log_path.read_text(errors="replace"), promotion["to"]) for w in workers
            ]

    rows = per_minute(summary["timeline"], summary["decisions"], args.minutes)
    means = {"baseline": window_means(rows, baseline), "last": window_means(rows, last)}
    verdict = judge(means["baseline"], means["last"], summary["lost"])
    if labels is not None:
        verdict = extend_verdict(verdict, labels_all_consumed=labels["consumed"] == labels["produced"] > 0)
    if promotion is not None:
        verdict = extend_verdict(verdict, promotion_swapped=bool(promotion["swapped"]) and all(promotion["swapped"]))
    doc: dict[str, Any] = {
        "machine": machine,
        "settings": {"rate": args.rate, "minutes": args.minutes, "variant": args.variant, "brokers": args.brokers,
                     "workers": len(workers), "feedback_workers": 1 if feedback else 0, "label_share": label_share,
                     "warmup_minutes": args.warmup_minutes},
        "totals": {key: summary[key] for key in ("sent", "decided", "lost", "achieved_rate", "latency_ms")},
        "per_minute": rows,
        "windows": {"baseline_minutes": list(baseline), "last_minutes": list(last), "note": note, "means": means},
        "tolerance": TOLERANCE,
        "verdict": verdict,
    }  # fmt: skip
    if cluster:
        doc["broker_readings"] = "sum of the 3 nodes (broker_rss_mb_by_node: each)"
        doc["replication"] = replication
    if labels is not None:
        doc["labels"] = labels
    if promotion is not None:
        doc["promotion"] = promotion
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{name}.json").write_text(json.dumps(doc, indent=1))
    plot(doc, args.out / f"{name}.png")

    for row in rows:
        print(json.dumps(row))
    print(table(rows))
    print(f"windows: minutes {_span(baseline)} vs {_span(last)}" + (f" ({note})" if note else ""))
    for key, values in means.items():
        print(f"  {key:8} " + "  ".join(f"{k} {v}" for k, v in values.items()))
    t = doc["totals"]
    print(f"sent {t['sent']:,}, decided {t['decided']:,}, lost {t['lost']}")
    if labels is not None:
        print(f"labels: produced {labels['produced']:,}, consumed by the feedback worker {labels['consumed']:,}")
    if promotion is not None:
        print(f"promotion: {promotion['from']} -> {promotion['to']} at {promotion.get('at_s')} s "
              f"(minute {promotion['minute']}); workers swapped: {promotion['swapped']}")  # fmt: skip
    if replication is not None:
        print("replication: " + ", ".join(f"{k} {v}" for k, v in replication.items()))
    print("verdict: " + ", ".join(f"{k} {'yes' if v else 'NO'}" for k, v in verdict.items() if k != "pass"))
    print(f"soak {'PASSED' if verdict['pass'] else 'FAILED'}; wrote {args.out / name}.json and {name}.png")
    return 0 if verdict["pass"] else 1


# --- the cluster soak's parts ---------------------------------------------------------


@contextlib.contextmanager
def cluster_services(workdir: Path) -> Iterator[Services]:
    """The replicated stack on free ports, its state under ``workdir``; on exit
    exactly the processes it started (its PID files) are stopped."""
    from tools import cluster
    from tools import stack as st

    state = workdir / "cluster"
    try:
        env = cluster.cluster_up(state, cluster.Cluster.free())
        pids = {p.stem: pid for p in sorted(state.glob("*.pid")) if (pid := st.read_pid(p)) is not None}
        yield Services(env["KAFKA_BOOTSTRAP"], env["REDIS_URL"], pids)
    finally:
        cluster.cluster_down(state)


def _is_broker(name: str) -> bool:
    """``broker`` (the single node) or ``broker-<i>`` (a cluster node)."""
    return name.split("-")[0] == "broker"


def _registry() -> Path:
    from app.settings import Settings

    registry = Settings().registry_dir
    return registry if registry.is_absolute() else REPO / registry


def pick_candidate(versions: Sequence[str], served: str, loadable: Callable[[str], bool]) -> str | None:
    """The version to promote over ``served``: the newest other one this code can
    load (version names sort by their creation time), or None."""
    return next((v for v in sorted(versions, reverse=True) if v != served and loadable(v)), None)


def soak_registry(source: Path, dest: Path) -> tuple[str, str]:
    """A registry for the run in ``dest``: ``source``'s served version, serving,
    and a candidate to promote: ``source``'s newest other loadable version, else
    one trained here (registered in ``dest`` only). Returns (served, candidate)."""
    from app.errors import ModelError
    from models.registry import current_version, list_versions, read_manifest, set_current, verify

    def loadable(version: str) -> bool:
        try:
            verify(source / version, read_manifest(source, version))
        except ModelError:
            return False
        return True

    served = current_version(source)
    candidate = pick_candidate(list_versions(source), served, loadable)
    dest.mkdir(parents=True)
    for version in (served, candidate):
        if version is not None:
            shutil.copytree(source / version, dest / version)
    set_current(dest, served)
    if candidate is None:
        print("bench: train (a second version to promote) ...", flush=True)
        env = dict(os.environ, FRAUD_REGISTRY_DIR=str(dest))
        subprocess.run([*_cli(), "train", "--data", str(DATA), "--quiet"], cwd=REPO, env=env, check=True,
                       stdout=subprocess.DEVNULL)  # fmt: skip
        candidate = pick_candidate(list_versions(dest), served, lambda v: True)
        if candidate is None:
            raise RuntimeError(f"training registered no new version in {dest}")
    return served, candidate


def promotion_s(baseline: range, last: range) -> float:
    """When to promote, in seconds of load: the middle of the minute halfway
    between the two windows, so neither compares a minute with a swap in it
    when the run leaves room (short runs put it in the last window)."""
    minute = (baseline[-1] + last[0] + 1) // 2
    return (minute - 1) * 60 + 30.0


def minute_of(t_s: float) -> int:
    """The per-minute row (from 1) that second ``t_s`` of the load falls in."""
    return int(t_s // 60) + 1


class Promoter:
    """``fraud-pipeline models promote`` against ``registry``, once, when the
    load's clock passes ``at_s``: the CLI an operator uses, in a thread so the
    load generator's loop never waits on it."""

    def __init__(self, registry: Path, version: str, at_s: float) -> None:
        self.registry, self.version, self.at_s = registry, version, at_s
        self._thread: threading.Thread | None = None
        self._result: dict[str, Any] = {}

    def due(self, elapsed_s: float) -> None:
        if self._thread is None and elapsed_s >= self.at_s:
            self._result["at_s"] = round(elapsed_s, 1)
            self._thread = threading.Thread(target=self._run, name="soak-promote", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        env = dict(os.environ, FRAUD_REGISTRY_DIR=str(self.registry))
        argv = [
            *_cli(),
            "models",
            "promote",
            self.version,
            "--by",
            "bench.soak",
            "--reason",
            "soak: promoted under load",
        ]
        done = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True)
        self._result["rc"] = done.returncode
        self._result["output"] = (done.stdout + done.stderr).strip()[-500:]

    def cancel(self) -> None:
        if self._thread is not None:
            self._thread.join(timeout=30)

    def record(self) -> dict[str, Any]:
        return dict(self._result) or {"at_s": None, "rc": None, "output": "the load ended before the promotion"}


def swapped_to(worker_log: str, version: str) -> bool:
    """Whether a worker's log says it swapped its model to ``version`` (agents/reload.py)."""
    return any("now serving:" in line and f"-> {version}" in line for line in worker_log.splitlines())


def extend_verdict(verdict: Mapping[str, bool], **checks: bool) -> dict[str, bool]:
    out = {k: v for k, v in verdict.items() if k != "pass"} | checks
    out["pass"] = all(out.values())
    return out


async def labels_consumed(settings: Any, group: str) -> dict[str, int]:
    """Labels on ``labels`` (its end offsets: the load generator's plain
    producer writes no transaction markers) and the feedback group's committed
    offsets there: equal when every label was consumed."""
    from aiokafka import AIOKafkaConsumer, TopicPartition
    from aiokafka.admin import AIOKafkaAdminClient

    from app.topics import kafka_auth

    admin = AIOKafkaAdminClient(bootstrap_servers=settings.kafka_bootstrap, **kafka_auth(settings))
    consumer = AIOKafkaConsumer(bootstrap_servers=settings.kafka_bootstrap, **kafka_auth(settings))
    await admin.start()
    await consumer.start()
    try:
        parts = consumer.partitions_for_topic(settings.topic_labels) or set()
        if not parts:
            await consumer._client.force_metadata_update()  # first call: no metadata yet
            parts = consumer.partitions_for_topic(settings.topic_labels) or set()
        tps = [TopicPartition(settings.topic_labels, p) for p in sorted(parts)]
        ends = await consumer.end_offsets(tps)
        committed = await admin.list_consumer_group_offsets(group)
    finally:
        await consumer.stop()
        await admin.close()
    done = sum(meta.offset for tp, meta in committed.items() if tp.topic == settings.topic_labels and meta.offset > 0)
    return {"produced": int(sum(ends.values())), "consumed": int(done)}


async def topic_replication(settings: Any) -> dict[str, str]:
    """Each of the run's topics: its replication factor and the smallest in-sync
    replica set seen (after the load: all 3 when no broker fell behind)."""
    from tools.cluster import describe_partitions

    names = [settings.topic_transactions, settings.topic_decisions, settings.topic_feedback, settings.topic_labels]
    described = await describe_partitions(settings, names)
    return {topic: f"RF {min(len(p['replicas']) for p in parts)}, ISR >= {min(len(p['isr']) for p in parts)}"
            for topic, parts in described.items()}  # fmt: skip


# --- readings ------------------------------------------------------------------------


def soak_sampler(
    worker_pids: Sequence[int],
    feedback_pid: int | None,
    pids: Mapping[str, int],
    minutes: int,
    promoter: Promoter | None = None,
) -> Callable[[], dict[str, Any]]:
    """``bench.workers``' sampler, summed over the scoring workers (``cpu_s``,
    ``rss_mb``) and over the brokers (``broker_cpu_s``, ``broker_rss_mb``), plus
    the feedback worker's and each broker's RSS. Prints one progress line a
    minute, as the per-minute rows need the whole run's decisions; fires the
    promotion when its time comes (the load's clock runs from the first sample)."""
    brokers = sorted(name for name in pids if _is_broker(name))
    base = _sampler(worker_pids[:1], pids)
    started = time.monotonic()
    shown = 0

    def sample() -> dict[str, Any]:
        nonlocal shown
        out: dict[str, Any] = base()
        out["cpu_s"] = total([proc_cpu_s(pid) for pid in worker_pids])
        out["rss_mb"] = total([proc_rss_mb(pid) for pid in worker_pids])
        if feedback_pid is not None:
            out["feedback_cpu_s"], out["feedback_rss_mb"] = proc_cpu_s(feedback_pid), proc_rss_mb(feedback_pid)
        rss = [proc_rss_mb(pids[name]) for name in brokers]
        out["broker_cpu_s"] = total([out.get(f"{name}_cpu_s") for name in brokers])
        out["broker_rss_mb"] = total(rss)
        if len(brokers) > 1:
            out["broker_rss_mb_by_node"] = rss
        elapsed_s = time.monotonic() - started
        if promoter is not None:
            promoter.due(elapsed_s)
        elapsed = int(elapsed_s // 60)
        if elapsed > shown:
            shown = elapsed
            worker_mb, broker_mb = (_mean([out[key]], digits=0) for key in ("rss_mb", "broker_rss_mb"))
            print(f"soak: {elapsed}/{minutes} min, worker RSS {worker_mb} MB, broker RSS {broker_mb} MB",
                  file=sys.stderr, flush=True)  # fmt: skip
        return out

    return sample


def total(values: Sequence[float | None]) -> float | None:
    """The sum of processes' readings; None when any is missing (a process gone
    or unreadable), so a partial sum never passes for the whole."""
    if not values or any(v is None for v in values):
        return None
    return float(sum(v for v in values if v is not None))


def per_minute(
    timeline: Sequence[Mapping[str, Any]], decisions: Mapping[str, list[float]], minutes: int
) -> list[dict[str, Any]]:
    """One row per minute of load. Each minute runs between the timeline
    samples nearest its ends, so its CPU and its decisions cover the same span;
    RSS is the mean of the minute's samples (steadier than one reading), in
    flight the count at its end (a backlog shows as growth from row to row)."""
    t = np.array([e["t"] for e in timeline])
    decided_at, latency_ms = np.asarray(decisions["t"]), np.asarray(decisions["latency_ms"])
    rows = []
    for minute in range(1, minutes + 1):
        a, b = (timeline[int(np.abs(t - edge).argmin())] for edge in ((minute - 1) * 60, minute * 60))
        span, decided = b["t"] - a["t"], b["decided"] - a["decided"]
        lat = percentiles(latency_ms[(decided_at > a["t"]) & (decided_at <= b["t"])])
        samples = [e for e in timeline if a["t"] < e["t"] <= b["t"]]
        rows.append({
            "minute": minute,
            "decided_per_s": round(decided / span, 1) if span > 0 else None,
            "p50_ms": lat["p50"],
            "p99_ms": lat["p99"],
            # Per transaction: one message in on transactions, one out on decisions.
            "broker_cpu_ms_per_message": _ms_per(a, b, "broker_cpu_s", decided),
            "worker_cpu_ms_per_decision": _ms_per(a, b, "cpu_s", decided),
            "broker_rss_mb": _mean([e.get("broker_rss_mb") for e in samples], digits=1),
            "worker_rss_mb": _mean([e.get("rss_mb") for e in samples], digits=1),
            "in_flight": b["in_flight"],
        })  # fmt: skip
        # The cluster soak's extra readings, only when sampled: the single-broker
        # rows keep their columns.
        if any("feedback_cpu_s" in e for e in samples):
            rows[-1]["feedback_cpu_ms_per_decision"] = _ms_per(a, b, "feedback_cpu_s", decided)
            rows[-1]["feedback_rss_mb"] = _mean([e.get("feedback_rss_mb") for e in samples], digits=1)
        by_node = [e["broker_rss_mb_by_node"] for e in samples if e.get("broker_rss_mb_by_node")]
        if by_node:
            rows[-1]["broker_rss_mb_by_node"] = [_mean(list(node), digits=1) for node in zip(*by_node, strict=True)]
    return rows


def _ms_per(a: Mapping[str, Any], b: Mapping[str, Any], key: str, n: int) -> float | None:
    if a.get(key) is None or b.get(key) is None or n <= 0:
        return None
    ms: float = round(1000 * (b[key] - a[key]) / n, 3)
    return ms


def _mean(values: Sequence[float | None], digits: int = 3) -> float | None:
    known = [v for v in values if v is not None]
    return round(float(np.mean(known)), digits) if known else None


def windows(minutes: int, warmup: int = 1) -> tuple[range, range, str | None]:
    """The baseline (the 6 minutes after ``warmup`` minutes of warm-up) and the
    last window, in minutes. With the default warm-up: minutes 2-7 and the last 5."""
    first = warmup + 1
    if minutes >= SHORT_RUN_MINUTES + warmup - 1:
        return range(first, first + len(BASELINE_MINUTES)), range(minutes - LAST_MINUTES + 1, minutes + 1), None
    # Too short for 6 minutes against the last 5 without overlap: two equal halves.
    w = max(1, (minutes - first) // 2)
    baseline, last = range(first, first + w), range(minutes - w + 1, minutes + 1)
    note = (f"run under {SHORT_RUN_MINUTES + warmup - 1} min: the last {w} against {w} from minute {first}, "
            f"not the last 5 against {first}-{first + len(BASELINE_MINUTES) - 1}")  # fmt: skip
    return baseline, last, note


def window_means(rows: Sequence[Mapping[str, Any]], minutes: range) -> dict[str, float | None]:
    """Means of the per-minute values over the window: each minute weighs the
    same, so one slow minute moves the mean as much as any other would."""
    inside = [r for r in rows if r["minute"] in minutes]
    keys = ("broker_cpu_ms_per_message", "p99_ms", "broker_rss_mb", "worker_cpu_ms_per_decision", "worker_rss_mb",
            "decided_per_s")  # fmt: skip
    return {key: _mean([r[key] for r in inside]) for key in keys}


def judge(baseline: Mapping[str, float | None], last: Mapping[str, float | None], lost: int) -> dict[str, bool]:
    def within(key: str) -> bool:
        # Both ways: a window that is much cheaper or faster than the baseline
        # means the baseline was not steady either, so flatness is not shown.
        b, e = baseline[key], last[key]
        return b is not None and e is not None and b > 0 and abs(e - b) <= TOLERANCE * b

    def flat(key: str) -> bool:
        b, e = baseline[key], last[key]
        return b is not None and e is not None and e <= (1 + TOLERANCE) * b

    verdict = {
        "broker_cpu_per_message_stable": within("broker_cpu_ms_per_message"),
        "p99_stable": within("p99_ms"),
        # Flat = the last window's mean at most 15 % above the baseline's. Upwards
        # only: a JVM handing heap back is not a problem. A mean ratio, not a
        # slope: the broker's heap is capped (-Xmx) and G1 commits it in steps,
        # so a fitted slope would flag a one-off step as a trend, while growth
        # that keeps going past the baseline (off-heap, mmapped indexes) shows up
        # in the ratio too, on the same windows as the other checks.
        "broker_rss_flat": flat("broker_rss_mb"),
        "nothing_lost": lost == 0,
    }
    # The worker's side, where the windows have its readings: its CPU per
    # decision both ways, its RSS upwards only (a promotion holds two models
    # for a moment, ~8 MB, well inside the tolerance).
    if baseline.get("worker_cpu_ms_per_decision") is not None:
        verdict["worker_cpu_per_decision_stable"] = within("worker_cpu_ms_per_decision")
    if baseline.get("worker_rss_mb") is not None:
        verdict["worker_rss_flat"] = flat("worker_rss_mb")
    verdict["pass"] = all(verdict.values())
    return verdict


def _span(minutes: range) -> str:
    return f"{minutes[0]}-{minutes[-1]}" if len(minutes) > 1 else str(minutes[0])


def table(rows: Sequence[Mapping[str, Any]]) -> str:
    heads = ("min", "dec/s", "p50 ms", "p99 ms", "brk cpu ms/msg", "wrk cpu ms/dec",
             "brk RSS MB", "wrk RSS MB", "in flight")  # fmt: skip
    cells = [[("-" if r[c] is None else f"{r[c]:g}") for c in COLUMNS] for r in rows]
    widths = [max(len(h), *(len(row[i]) for row in cells)) for i, h in enumerate(heads)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(heads, widths, strict=True))]
    lines += ["  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)) for row in cells]
    return "\n".join(lines)


def plot(doc: Mapping[str, Any], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # no display on servers
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    rows = doc["per_minute"]
    x = [r["minute"] - 0.5 for r in rows]  # minute k spans [k-1, k]
    fig, (lat, mem) = plt.subplots(2, 1, figsize=(9, 6.5), sharex=True)

    def series(key: str) -> list[float]:
        return [np.nan if r[key] is None else r[key] for r in rows]

    lat.plot(x, series("p99_ms"), marker="o", ms=3, color="tab:blue", label="p99")
    lat.set_ylabel("p99 latency (ms)", color="tab:blue")
    cpu = lat.twinx()
    cpu.plot(x, series("broker_cpu_ms_per_message"), marker="s", ms=3, color="tab:orange", label="broker CPU/msg")
    cpu.set_ylabel("broker CPU per message (ms)", color="tab:orange")
    mem.plot(x, series("broker_rss_mb"), marker="o", ms=3, color="tab:purple", label="broker RSS")
    mem.plot(x, series("worker_rss_mb"), marker="s", ms=3, color="tab:green", label="worker RSS")
    mem.set_ylabel("RSS (MB)")
    mem.set_xlabel("minutes of load")
    mem.xaxis.set_major_locator(MaxNLocator(integer=True))
    mem.legend(loc="lower right", fontsize=8)
    w = doc["windows"]
    for ax in (lat, mem):
        shaded = ((w["baseline_minutes"], "tab:gray", "baseline"), (w["last_minutes"], "tab:red", "last"))
        for minutes, color, label in shaded:
            ax.axvspan(minutes[0] - 1, minutes[-1], color=color, alpha=0.12, label=f"{label} window")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    cpu.set_ylim(bottom=0)
    promotion = doc.get("promotion") or {}
    if promotion.get("at_s") is not None:
        for ax in (lat, mem):
            ax.axvline(promotion["at_s"] / 60, color="black", ls="--", lw=1, label=f"promoted {promotion['to']}")
    handles = [h for ax in (lat, cpu) for h in ax.get_legend_handles_labels()[0]]
    lat.legend(handles, [str(h.get_label()) for h in handles], loc="lower right", fontsize=8)
    s, v = doc["settings"], doc["verdict"]
    lat.set_title(
        f"soak: {s.get('workers', 1)} {s['variant']} worker(s), {s.get('brokers', 1)} broker(s), "
        f"{s['rate']:g} TPS offered, {s['minutes']} min, "
        f"{doc['machine']['cores']} cores: {'passed' if v['pass'] else 'FAILED'}",
        fontsize=10,
    )
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
