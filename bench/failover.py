"""How long the 3-node stack takes to move the leaderships of a node that was
the active KRaft controller, killed with no load (``python -m bench.failover``).

Every node of the local cluster is a broker and a voter (``tools/cluster.py``),
so killing the active controller costs an election before the dead node is
fenced: a new controller starts every broker's session afresh. This measures,
per ``kill -9`` of the active controller, the seconds until no partition is led
by the dead node any more (polled every 50 ms through the other two), then
restarts it and waits for every in-sync replica. Variants are the cluster's
settings with some overridden; each variant runs its own cluster, all of them
up at once, and their kills alternate, so a slow minute of the machine falls on
every variant alike.

    python -m bench.failover --kills 3          # the cluster as configured vs Kafka's quorum defaults

Writes ``bench/results/failover.json`` and ``.png``.
"""

from __future__ import annotations

import argparse
import asyncio
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
from bench.run import REPO, machine_info  # noqa: E402
from tools import cluster  # noqa: E402

#: name -> settings over ``cluster.CLUSTER_CONFIG``.
VARIANTS: dict[str, dict[str, str]] = {
    "cluster": {},
    "quorum_defaults": {
        "controller.quorum.fetch.timeout.ms": "2000",
        "controller.quorum.election.timeout.ms": "1000",
        "controller.quorum.election.backoff.max.ms": "1000",
    },
    "session_2s": {"broker.session.timeout.ms": "2000", "broker.heartbeat.interval.ms": "500"},
}

async def _leaders(bootstrap: str) -> dict[tuple[str, int], tuple[int, int]]:
    described = await cluster.describe_partitions(Settings(kafka_bootstrap=bootstrap))
    return {(t, p["partition"]): (p["leader"], len(p["isr"])) for t, parts in described.items() for p in parts}


def _up(variant: str, root: Path) -> tuple[Path, cluster.Cluster, dict[str, str]]:
    state = root / variant
    layout = cluster.Cluster.free()
    base = dict(cluster.CLUSTER_CONFIG)
    cluster.CLUSTER_CONFIG.update(VARIANTS[variant])  # read when the nodes' configs are written
    try:
        env = cluster.cluster_up(state, layout)
    finally:
        cluster.CLUSTER_CONFIG.clear()
        cluster.CLUSTER_CONFIG.update(base)
    return state, layout, env


async def kill_controller(state: Path, layout: cluster.Cluster, env: dict[str, str]) -> dict[str, Any]:
    """Kill the active controller; seconds until none of its leaderships is left; restart it."""
    nodes = len(layout.nodes)
    victim = cluster.active_controller(state, nodes)
    others = ",".join(f"127.0.0.1:{port}" for i, (port, _) in enumerate(layout.nodes, 1) if i != victim)
    os.kill(int((state / f"broker-{victim}.pid").read_text()), signal.SIGKILL)
    killed = time.monotonic()
    while True:
        try:
            leaders = await _leaders(others)
            if leaders and all(leader != victim for leader, _ in leaders.values()):
                break
        except Exception:  # a node that is down answers nothing yet; ask again
            pass
        await asyncio.sleep(0.05)
    moved_s = time.monotonic() - killed
    await asyncio.to_thread(cluster.start_node, state, victim)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            leaders = await _leaders(env["KAFKA_BOOTSTRAP"])
            if leaders and all(isr == nodes for _, isr in leaders.values()):
                break
        except Exception:
            pass
        await asyncio.sleep(0.5)
    return {"node": victim, "moved_s": round(moved_s, 2), "controller_after": cluster.active_controller(state, nodes)}


def plot(doc: dict[str, Any], path: Path) -> Path:
    fig, ax = plt.subplots(figsize=(7, 3.5))
    names = list(doc["variants"])
    for x, name in enumerate(names):
        values = [k["moved_s"] for k in doc["kills"] if k["variant"] == name]
        ax.scatter([x] * len(values), values, color="C0")
    ax.set_xticks(range(len(names)), names)
    ax.set_ylabel("s until the dead node leads nothing")
    ax.set_ylim(bottom=0)
    m = doc["machine"]
    ax.set_title(f"kill -9 of the active controller, no load; {m['cores']} cores, {m['cpu_model']}, "
                 f"{doc['started_at']}", fontsize=8)  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


async def run(variants: Sequence[str], kills: int) -> dict[str, Any]:
    doc: dict[str, Any] = {
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": machine_info(),
        "variants": {name: VARIANTS[name] for name in variants},
        "base": dict(cluster.CLUSTER_CONFIG),
        "kills": [],
    }
    with tempfile.TemporaryDirectory(prefix="failover-") as tmp:
        stacks = {name: _up(name, Path(tmp)) for name in variants}
        try:
            for round_ in range(kills):
                for name, (state, layout, env) in stacks.items():
                    await asyncio.sleep(3)  # the restarted node settles before the next kill
                    result = {"variant": name, "round": round_, **await kill_controller(state, layout, env)}
                    doc["kills"].append(result)
                    print(json.dumps(result), flush=True)
        finally:
            for state, _, _ in stacks.values():
                cluster.cluster_down(state)
    return doc


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", nargs="+", default=["cluster", "quorum_defaults"], choices=sorted(VARIANTS))
    parser.add_argument("--kills", type=int, default=3, help="kills of the active controller per variant")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "failover.json")
    args = parser.parse_args(argv)
    doc = asyncio.run(run(args.variants, args.kills))
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"results: {args.out}\nplot:    {plot(doc, args.out.with_suffix('.png'))}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
