"""How fast a ``--role feedback`` worker drains ``feedback`` and ``labels`` into
live quality, and its CPU per record (``python -m bench.feedback_drain``).

The topics are filled first (``--feedback`` decisions' feedback records, a label
for ``--label-share`` of them), then feedback workers start one after another,
each in a consumer group and quality keys of its own, so each reads everything
from the start: this checkout (``change``) and, with ``--base CHECKOUT``,
another one (``base``), alternated cell by cell in one run. A cell's figures
are taken between 10 % and 90 % of the records joined (the worker's start and
its group's join left out): records a second, and the worker's CPU per
record. The feedback records are written outside transactions here (the
scoring loop's have a marker after each transaction's records).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import time
import uuid
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import orjson

from app import redis_keys
from app.redis_client import sync_client
from app.topics import ensure_topics
from bench.plan import BATCHED, REPO
from bench.procs import machine_info, proc_cpu_s
from bench.workers import Worker, services, settings_from_env

PARTITIONS = 4
WINDOW = (0.1, 0.9)


def _fill(bootstrap: str, topics: dict[str, str], feedback: int, label_share: float) -> int:
    """``feedback`` feedback records and a label for every ``1 / label_share``-th; returns the labels written."""
    from confluent_kafka import Producer

    producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 20, "acks": "all"})
    every = max(1, round(1 / label_share)) if label_share > 0 else 0
    labels = 0
    now = time.time()
    for i in range(feedback):
        txid = f"t-drain-{i:08d}"
        decision = {"transaction_id": txid, "action": ("approve", "review", "decline")[i % 3],
                    "fraud_score": (i % 100) / 100, "decided_at": now - 3600 + i * 0.01,
                    "model_version": "v-drain", "rules_version": "rules-drain"}  # fmt: skip
        producer.produce(topics["feedback"], orjson.dumps({"decision": decision, "rule": "score"}), key=txid.encode())
        if every and i % every == 0:
            label = {"transaction_id": txid, "label": "fraud" if i % 7 == 0 else "legit", "source": "chargeback"}
            producer.produce(topics["labels"], orjson.dumps(label), key=txid.encode())
            labels += 1
        if i % 10_000 == 0:
            producer.poll(0)
    producer.flush(60)
    return labels


def _cell(
    variant: Any, svc: Any, workdir: Path, topics: dict[str, str], total: int, timeout_s: float
) -> dict[str, Any]:
    app_id = f"bench-drain-{uuid.uuid4().hex[:8]}"
    worker = Worker(variant, svc, workdir, join=SimpleNamespace(topics=topics, group_tag=app_id),  # type: ignore[arg-type]
                    role="feedback", extra_env={"FRAUD_APP_ID": app_id})  # fmt: skip
    client = sync_client(settings_from_env({"FRAUD_REDIS_URL": svc.redis_url}), timeout_s=10)
    prefix = redis_keys.quality_prefix(app_id)
    marks: dict[float, tuple[float, float]] = {}
    try:
        ready_s = worker.wait_ready()
        deadline = time.monotonic() + timeout_s
        while len(marks) < len(WINDOW) and time.monotonic() < deadline:
            decided = sum(int(n) for n in client.hvals(redis_keys.quality_decided_key(prefix)))
            done = decided + int(client.hlen(redis_keys.quality_joined_key(prefix)))
            for share in WINDOW:
                if share not in marks and done >= share * total:
                    marks[share] = (time.monotonic(), proc_cpu_s(worker.pid) or 0.0)
            time.sleep(0.05)
    finally:
        worker.stop()
        client.close()
    if len(marks) < len(WINDOW):
        return {"variant": variant.name, "ready_s": round(ready_s, 1), "error": f"not drained in {timeout_s:.0f} s"}
    (t0, c0), (t1, c1) = marks[WINDOW[0]], marks[WINDOW[1]]
    records = (WINDOW[1] - WINDOW[0]) * total
    return {"variant": variant.name, "ready_s": round(ready_s, 1), "records_per_s": round(records / (t1 - t0)),
            "cpu_us_per_record": round((c1 - c0) / records * 1e6, 1)}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--feedback", type=int, default=60_000, help="feedback records (one per decision)")
    parser.add_argument("--label-share", type=float, default=0.25, help="share of decisions labelled")
    parser.add_argument("--cells", type=int, default=3, help="cells per variant, alternated")
    parser.add_argument("--base", type=Path, help="another checkout's feedback worker, alternated with this one")
    parser.add_argument("--timeout", type=float, default=180.0, help="seconds a cell may take to drain")
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "feedback-drain.json")
    args = parser.parse_args()

    variants = [replace(BATCHED, name="change")]
    if args.base:
        variants.append(replace(BATCHED, name="base", checkout=str(args.base.resolve())))
    workdir = REPO / ".stack" / "bench" / f"feedback-drain-{datetime.now(UTC):%Y%m%dT%H%M%S}"
    workdir.mkdir(parents=True, exist_ok=True)
    tag = uuid.uuid4().hex[:8]
    topics = {name: f"bench-{short}-drain-{tag}" for name, short in (
        ("transactions", "tx"), ("decisions", "dec"), ("dlq", "dlq"), ("feedback", "fb"),
        ("monitoring", "mon"), ("labels", "lab"))}  # fmt: skip
    with services(workdir) as svc:
        settings = settings_from_env({**svc.env(), **{f"FRAUD_TOPIC_{k.upper()}": v for k, v in topics.items()},
                                      "FRAUD_PARTITIONS": str(PARTITIONS)})  # fmt: skip
        asyncio.run(ensure_topics(settings))
        labels = _fill(svc.bootstrap, topics, args.feedback, args.label_share)
        total = args.feedback + labels
        rows = []
        for k in range(args.cells):
            for variant in variants if k % 2 == 0 else variants[::-1]:
                row = _cell(variant, svc, workdir, topics, total, args.timeout)
                print(json.dumps(row), flush=True)
                rows.append(row)
    base = None
    if args.base:  # the commit, not the folder: results are committed
        base = subprocess.run(["git", "-C", str(args.base), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, check=False).stdout.strip() or None  # fmt: skip
    doc = {"machine": machine_info(), "feedback": args.feedback, "labels": labels, "partitions": PARTITIONS,
           "base": base, "rows": rows}  # fmt: skip
    args.out.write_text(json.dumps(doc, indent=2) + "\n")
    from bench.plots import feedback_drain_plot

    print(f"wrote {args.out} and {feedback_drain_plot(doc, args.out.with_suffix('.png'))}")


if __name__ == "__main__":
    main()
