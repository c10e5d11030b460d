"""The README's kcat example, run as written (only the broker address and topic
names are the test's), with Debian's kcat against the local Apache Kafka broker."""

from __future__ import annotations

import asyncio
import json
import re
import secrets
import shutil
import subprocess
from pathlib import Path

import pandas as pd
import pytest
from workers import Topics, Workers, worker_env

from tools.materialize import materialize

pytestmark = [
    pytest.mark.integration,
    pytest.mark.timeout(180),
    pytest.mark.skipif(shutil.which("kcat") is None, reason="kcat is not installed (Debian: apt-get install kcat)"),
]

REPO = Path(__file__).resolve().parents[2]


def readme_kcat_block() -> str:
    text = (REPO / "README.md").read_text()
    section = text[text.index("### With a plain Kafka client (kcat)"):]
    return re.search(r"```sh\n(.*?)```", section, re.S).group(1)  # type: ignore[union-attr]


def test_the_readme_kcat_example_gets_its_decision(
    kafka_bootstrap: str, redis_url: str, sim_frame: pd.DataFrame, trained_registry: Path, tmp_path: Path
) -> None:
    import redis

    workdir = tmp_path

    client = redis.Redis.from_url(redis_url)
    try:
        materialize(sim_frame, client, progress=False)
    finally:
        client.close()
    key = secrets.token_bytes(32).hex()
    (workdir / "config").mkdir()
    keys = workdir / "config" / "client-keys.json"
    keys.write_text(json.dumps({"clients": {"pos-eu-1": key}}))
    topics = Topics.unique("kcat")
    asyncio.run(topics.create(kafka_bootstrap, 8))
    env = worker_env(bootstrap=kafka_bootstrap, redis_url=redis_url, topics=topics, registry=trained_registry,
                     workdir=workdir / "worker", FRAUD_ALLOW_UNSIGNED="false", FRAUD_CLIENT_KEYS_FILE=str(keys))  # fmt: skip
    workers = Workers(workdir / "worker", env)
    block = (
        readme_kcat_block()
        .replace("127.0.0.1:19092", kafka_bootstrap)
        .replace("-t transactions", f"-t {topics.transactions}")
        .replace("-t decisions", f"-t {topics.decisions}")
    )
    try:
        worker = workers.start()
        asyncio.run(worker.wait_for_log("Ready", 90))
        done = subprocess.run(["bash", "-euo", "pipefail", "-c", block], cwd=workdir, capture_output=True,
                              text=True, timeout=60)  # fmt: skip
    finally:
        workers.stop_all()
    assert done.returncode == 0, done.stderr
    line = done.stdout.strip()
    assert line.startswith("key=t-demo-1 {"), line
    decision = json.loads(line.split(" ", 1)[1])
    assert decision["transaction_id"] == "t-demo-1" and decision["user_id"] == "u-000042"
    # 15,000 USD: over the 10,000 USD floor, so never approved; the README's comment shows what decided.
    assert decision["action"] in ("review", "decline"), decision
    if decision["action"] == "decline":
        assert decision["explanation"][0].startswith("score ") and "decline threshold" in decision["explanation"][0]
    assert not any("new device" in w for w in decision["explanation"]), decision  # no device_id was sent
    assert decision["correlation_id"] == "abc123"
    assert not decision["degraded"], decision
