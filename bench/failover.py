"""How long the 3-broker stack takes to get past a ``kill -9``, with no load
(``python -m bench.failover``): of the active KRaft controller (until another
controller is active) and of the broker leading the most partitions (until the
dead broker leads nothing).

The local cluster's controllers are processes of their own
(``tools/cluster.py``): losing the active one costs an election of the quorum
(its fetch and election timeouts) and moves no leadership; losing a broker
costs its fencing by the active controller (``broker.session.timeout.ms``)
and moves its leaderships. Per kill this measures, from the kill: for a
controller, until another controller logged its activation; for a broker, until
no partition is led by it any more (polled every 50 ms through the other two);
then it restarts the process and waits for every in-sync replica. Variants are
the cluster's settings with some overridden; each variant runs its own cluster,
all of them up at once, and their kills alternate, so a slow minute of the
machine falls on every variant alike.

    python -m bench.failover --kills 3          # the cluster as configured vs the shortened quorum timeouts

Writes ``bench/results/failover.json`` and ``.png``.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import signal
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from app.settings import Settings  # noqa: E402
from bench.plan import REPO  # noqa: E402
from bench.procs import machine_info  # noqa: E402
from tools import cluster  # noqa: E402

#: name -> settings over ``cluster.CLUSTER_CONFIG``.
VARIANTS: dict[str, dict[str, str]] = {
    "cluster": {},
    # What the cluster ran while every node was a broker and a voter too.
    "quorum_short": {
        "controller.quorum.fetch.timeout.ms": "1000",
        "controller.quorum.election.timeout.ms": "500",
        "controller.quorum.election.backoff.max.ms": "500",
    },
    "session_2s": {"broker.session.timeout.ms": "2000", "broker.heartbeat.interval.ms": "500"},
}
KINDS = ("controller", "broker")


async def _leaders(bootstrap: str) -> dict[tuple[str, int], tuple[int, int]]:
    described = await cluster.describe_partitions(Settings(kafka_bootstrap=bootstrap))
    return {(t, p["partition"]): (p["leader"], len(p["isr"])) for t, parts in described.items() for p in parts}


def _up(variant: str, root: Path) -> tuple[Path, cluster.Cluster, dict[str, str]]:
    state = root / variant
    layout = cluster.Cluster.free()
    base = dict(cluster.CLUSTER_CONFIG)
    cluster.CLUSTER_CONFIG.update(VARIANTS[variant])  # read when the configs are written
    try:
        env = cluster.cluster_up(state, layout)
    finally:
        cluster.CLUSTER_CONFIG.clear()
        cluster.CLUSTER_CONFIG.update(base)
    return state, layout, env


def _activated_after(state: Path, since: float) -> float | None:
    """When (``time.time()``) a controller logged its activation after ``since``, if one did."""
    times = []
    for index in range(1, cluster.CONTROLLERS + 1):
        log = state / f"controller-{index}.log"
        for line in log.read_text(errors="replace").splitlines() if log.exists() else ():
            if m := cluster._ACTIVATION.match(line):
                at = dt.datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()  # the JVM's local time
                if at > since:
                    times.append(at)
    return min(times, default=None)


async def kill(kind: str, state: Path, layout: cluster.Cluster, env: dict[str, str]) -> dict[str, Any]:
    """Kill the active controller or the broker leading most partitions; the
    seconds until the cluster is past it; restart it."""
    if kind == "controller":
        victim = cluster.active_controller(state)
    else:
        leaders = [leader for leader, _ in (await _leaders(env["KAFKA_BOOTSTRAP"])).values()]
        victim = max(set(leaders), key=leaders.count)
    others = ",".join(f"127.0.0.1:{port}" for i, port in enumerate(layout.brokers, 1) if i != victim)
    os.kill(int((state / f"{kind}-{victim}.pid").read_text()), signal.SIGKILL)
    killed, killed_at = time.monotonic(), time.time()
    while True:
        if kind == "controller":
            activated = _activated_after(state, killed_at)
            if activated is not None:
                moved_s = activated - killed_at
                break
        else:
            try:
                leaders_now = await _leaders(others)
                if leaders_now and all(leader != victim for leader, _ in leaders_now.values()):
                    moved_s = time.monotonic() - killed
                    break
            except Exception:  # a broker that is down answers nothing yet; ask again
                pass
        assert time.monotonic() - killed < 60, f"{kind} {victim}: not past its loss after 60 s"
        await asyncio.sleep(0.05)
    await asyncio.to_thread(cluster.start_node, state, victim, kind)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            leaders_now = await _leaders(env["KAFKA_BOOTSTRAP"])
            if leaders_now and all(isr == len(layout.brokers) for _, isr in leaders_now.values()):
                break
        except Exception:
            pass
        await asyncio.sleep(0.5)
    return {"kind": kind, "node": victim, "moved_s": round(moved_s, 2),
            "controller_after": cluster.active_controller(state)}  # fmt: skip


def plot(doc: dict[str, Any], path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(7, 3.5))
    names = [(variant, kind) for kind in doc["kinds"] for variant in doc["variants"]]
    for x, (variant, kind) in enumerate(names):
        values = [k["moved_s"] for k in doc["kills"] if (k["variant"], k["kind"]) == (variant, kind)]
        ax.scatter([x] * len(values), values, color="C0" if kind == "controller" else "C1")
    ax.set_xticks(range(len(names)), [f"{kind}\n{variant}" for variant, kind in names], fontsize=7)
    ax.set_ylabel("s until another controller is active /\nthe dead broker leads nothing", fontsize=8)
    ax.set_ylim(bottom=0)
    m = doc["machine"]
    ax.set_title(f"kill -9 of the active controller or a broker, no load; {m['cores']} cores, {m['cpu_model']}, "
                 f"{doc['started_at']}", fontsize=8)  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


async def run(variants: Sequence[str], kinds: Sequence[str], kills: int) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": machine_info(),
        "variants": {name: VARIANTS[name] for name in variants},
        "kinds": list(kinds),
        "base": dict(cluster.CLUSTER_CONFIG),
        "kills": [],
    }
    with tempfile.TemporaryDirectory(prefix="failover-") as tmp:
        stacks = {name: _up(name, Path(tmp)) for name in variants}
        try:
            for round_ in range(kills):
                for kind in kinds:
                    for name, (state, layout, env) in stacks.items():
                        await asyncio.sleep(3)  # the restarted process settles before the next kill
                        result = {"variant": name, "round": round_, **await kill(kind, state, layout, env)}
                        doc["kills"].append(result)
                        print(json.dumps(result), flush=True)
        finally:
            for state, _, _ in stacks.values():
                cluster.cluster_down(state)
    return doc


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", nargs="+", default=["cluster", "quorum_short"], choices=sorted(VARIANTS))
    parser.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS, help="what is killed")
    parser.add_argument("--kills", type=int, default=3, help="kills of each kind per variant")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "failover.json")
    args = parser.parse_args(argv)
    doc = asyncio.run(run(args.variants, args.kinds, args.kills))
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"results: {args.out}\nplot:    {plot(doc, args.out.with_suffix('.png'))}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
