"""Worker roles on the real broker and Redis: ``--role score`` decides and runs
no feedback loop; ``--role feedback`` (its own consumer group) joins the
labels with every decision served so far, and ``report quality`` reads it."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import orjson
import pandas as pd
import pytest
from workers import (
    REPO,
    Collector,
    Topics,
    TxFactory,
    Workers,
    committed_offsets,
    make_producer,
    send_all,
    tx_msg,
    worker_env,
)

from tools import stack

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

PARTITIONS = 2


def report(env: dict[str, str]) -> dict[str, Any]:
    done = subprocess.run([sys.executable, "-m", "tools.cli", "report", "quality", "--json"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def labelled(env: dict[str, str]) -> tuple[int, int]:
    """(decisions, labelled) over every model version in the live figures."""
    models = report(env)["models"].values()
    return sum(m["decisions"] for m in models), sum(m["labelled"] for m in models)


async def wait_consumed(
    bootstrap: str, group: str, topic: str, ends: dict[int, int], timeout: float
) -> dict[int, int | None]:
    """The group's committed offsets of ``topic``, once they reach ``ends`` or ``timeout`` passes."""
    deadline = time.monotonic() + timeout
    while True:
        committed = await committed_offsets(bootstrap, group, topic, max(ends) + 1)
        committed = {p: committed.get(p) for p in ends}
        if committed == ends or time.monotonic() > deadline:
            return committed
        await asyncio.sleep(0.5)


def test_score_workers_decide_and_the_feedback_worker_joins_the_labels(
    kafka_bootstrap: str, redis_url: str, sim_frame: pd.DataFrame, trained_registry: Path, tmp_path: Path
) -> None:
    topics = Topics.unique("roles")
    env = worker_env(
        bootstrap=kafka_bootstrap, redis_url=redis_url, topics=topics, registry=trained_registry,
        workdir=tmp_path, partitions=PARTITIONS, FRAUD_QUALITY_EVERY_S="1",
    )  # fmt: skip
    asyncio.run(topics.create(kafka_bootstrap, PARTITIONS))
    make = TxFactory(sim_frame, f"t-roles-{topics.transactions[-6:]}")
    docs = [make(currency="USD") for _ in range(10)]
    labels = [
        {"transaction_id": d["transaction_id"], "label": "fraud" if i % 2 else "legit", "source": "analyst"}
        for i, d in enumerate(docs[:6])
    ]
    workers = Workers(tmp_path, env)
    try:
        scorer = workers.start(FRAUD_WORKER_ROLE="score")
        asyncio.run(scorer.wait_for_log("Ready", 90))

        async def decide_and_label() -> dict[str, Any]:
            async with Collector(kafka_bootstrap, topics, PARTITIONS) as collector:
                producer = make_producer(kafka_bootstrap)
                await producer.start()
                try:
                    await send_all(producer, topics.transactions, [tx_msg(d) for d in docs])
                    ids = [d["transaction_id"] for d in docs]
                    await collector.wait_for(lambda: all(collector.by_tx.get(t) for t in ids), 90, "decisions")
                    sent = [await producer.send(topics.labels, orjson.dumps(lb), key=lb["transaction_id"].encode())
                            for lb in labels]  # fmt: skip
                    delivered = await asyncio.gather(*sent)
                finally:
                    await producer.stop()
                ends: dict[int, int] = {}
                for meta in delivered:
                    ends[meta.partition] = max(ends.get(meta.partition, 0), meta.offset + 1)
                return {t: collector.by_tx[t][0] for t in ids}, ends

        decided, label_ends = asyncio.run(decide_and_label())
        assert all(d["action"] in ("approve", "review", "decline") for d in decided.values())
        # The scoring worker consumes `labels` too (the merchant tally, in a group
        # of its own): once that group has committed them to their end, the
        # worker has counted them. It runs no feedback loop: nothing is joined.
        consumed = asyncio.run(wait_consumed(kafka_bootstrap, f"{env['FRAUD_APP_ID']}-tally", topics.labels,
                                             label_ends, 60))  # fmt: skip
        assert consumed == label_ends, f"labels committed {consumed}, end {label_ends}\n{workers.logs()}"
        assert labelled(env) == (0, 0), workers.logs()

        feedback = workers.start(FRAUD_WORKER_ROLE="feedback")
        asyncio.run(feedback.wait_for_log("Ready", 90))
        deadline, last = time.monotonic() + 90, None
        while time.monotonic() < deadline:
            last = labelled(env)
            if last == (10, 6):
                break
            time.sleep(1.0)
        # Every decision served before it started, and every label, from its own consumer group.
        assert last == (10, 6), f"{last}\n{workers.logs()}"
        assert scorer.alive() and feedback.alive()
    finally:
        workers.stop_all()


def test_a_worker_starts_in_a_fresh_checkout_without_a_state_dir(
    kafka_bootstrap: str, redis_url: str, trained_registry: Path, tmp_path: Path
) -> None:
    """`fraud-pipeline worker` from a directory with no `.stack/` yet: the default
    FRAUD_DATA_DIR (.stack/faust) is created, not a FileNotFoundError."""
    topics = Topics.unique("fresh")
    asyncio.run(topics.create(kafka_bootstrap, PARTITIONS))
    env = worker_env(bootstrap=kafka_bootstrap, redis_url=redis_url, topics=topics, registry=trained_registry,
                     workdir=tmp_path / "config", partitions=PARTITIONS)  # fmt: skip
    env.pop("FRAUD_DATA_DIR", None)
    env["PYTHONPATH"] = str(REPO)
    checkout = tmp_path / "checkout"
    checkout.mkdir()
    log = tmp_path / "worker.log"
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "tools.cli", "worker", "--web-port", str(stack.free_port())], cwd=checkout, env=env,
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 90
        while "Ready" not in log.read_text(errors="replace"):
            assert proc.poll() is None, log.read_text(errors="replace")[-3000:]
            assert time.monotonic() < deadline, log.read_text(errors="replace")[-3000:]
            time.sleep(0.2)
        assert (checkout / ".stack" / "faust").is_dir()
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
