"""``make demo``'s own script, end to end on the secured stack, as a user runs it.

``scripts/demo.sh`` with a small data file, the trained registry fixture, free
ports and a state dir under ``tmp_path``: it brings up the secure broker and
Redis, runs every process as its role's user, sends a short load and stops
everything it started. The assertions are what its user sees: the summary, the
logs, and no process left behind.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import asdict
from datetime import UTC, datetime
from pathlib import Path

import pandas as pd
import pytest

from tests.conftest import TINY_SIM
from tools import kafka_secure, stack

pytestmark = [pytest.mark.integration, pytest.mark.timeout(420)]

REPO = Path(__file__).resolve().parents[2]
RATE, DURATION = 30, 5


def _data_file(sim_frame: pd.DataFrame, folder: Path) -> Path:
    """The frame as ``fraud-pipeline simulate`` writes it: Parquet, and the sidecar
    from which the load generator rebuilds the same population."""
    from tools.simulator import SimulationConfig, write_parquet

    path = folder / "transactions.parquet"
    write_parquet(sim_frame, path)
    end = datetime.now(UTC).replace(hour=0, minute=0, second=0, microsecond=0)  # as conftest's sim_frame
    meta = {k: (v.isoformat() if isinstance(v, datetime) else v) for k, v in asdict(SimulationConfig(**TINY_SIM, end=end)).items()}
    path.with_suffix(".sim.json").write_text(json.dumps(meta))
    return path


def test_the_secure_demo_decides_everything_with_every_role_on_its_own_user(
    sim_frame: pd.DataFrame, trained_registry: Path, tmp_path: Path
) -> None:
    state = tmp_path / "state"
    env = {k: v for k, v in os.environ.items() if k not in ("KAFKA_BOOTSTRAP", "REDIS_URL") and not k.startswith("FRAUD_")}
    broker, redis_port, web, feedback_web = stack.free_ports(4)
    env.update(
        SECURE="1", DEMO_STATE_DIR=str(state), DEMO_DATA=str(_data_file(sim_frame, tmp_path)),
        DEMO_REGISTRY=str(trained_registry), DEMO_BIN=str(Path(sys.executable).parent),
        DEMO_BROKER_PORT=str(broker), DEMO_REDIS_PORT=str(redis_port),
        DEMO_WEB_PORT=str(web), DEMO_FEEDBACK_WEB_PORT=str(feedback_web),
    )  # fmt: skip
    done = subprocess.run(
        ["bash", str(REPO / "scripts" / "demo.sh"), str(RATE), str(DURATION)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=400,
    )  # fmt: skip
    output = done.stdout + done.stderr
    logs = {p.name: p.read_text(errors="replace") for p in state.glob("*.log")}
    assert done.returncode == 0, output[-4000:] + "".join(f"\n--- {n}\n{t[-2000:]}" for n, t in logs.items())

    # Everything it started is gone: the stack's servers and both workers.
    pids = [int(p) for p in re.findall(r"(?:broker|redis) pid (\d+)", output)]
    pids += [int(p) for p in re.search(r"workers ([\d ]+) ready", output)[1].split()]  # type: ignore[index]
    assert len(pids) == 4, output
    assert not [pid for pid in pids if stack.pid_alive(pid)]
    assert not (state / "broker.pid").exists() and not (state / "redis.pid").exists()

    # Every transaction sent got a decision signed by the worker's key.
    summary = json.loads((state / "demo-summary.json").read_text())
    assert summary["sent"] > 0 and summary["decided"] == summary["sent"] and summary["lost"] == 0, summary
    assert summary["verified"] and summary["unverified"] == 0, summary

    # Each process was its role's user, and none was refused anything on the way.
    assert "Kafka user scoring (SCRAM-SHA-512 over TLS), Redis user worker" in logs["worker-score.log"]
    assert "Kafka user feedback (SCRAM-SHA-512 over TLS), Redis user worker" in logs["worker-feedback.log"]
    assert "Authenticated as scoring via SCRAM-SHA-512" in logs["worker-score.log"], logs["worker-score.log"][-3000:]
    for name, text in logs.items():
        assert "AuthorizationFailed" not in text and "NOPERM" not in text, f"{name}:\n{text[-3000:]}"
    assert "AuthorizationFailed" not in output and "NOPERM" not in output, output[-3000:]

    # Nothing the demo printed or logged shows a password.
    passwords = [kafka_secure.password_file(state, u).read_text().strip() for u in kafka_secure.USERS]
    passwords += [p.read_text().strip() for p in (state / "redis-users").glob("*.password")]
    for text in (output, *logs.values()):
        assert not [p for p in passwords if p in text]
