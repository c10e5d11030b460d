"""The load generator's schedule and its pre-built sends (tools/loadgen.py).

No broker: the clients are made but never used (librdkafka connects lazily).
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

import numpy as np
import orjson
import pytest

from app.settings import Settings
from pipeline.auth import verify
from tools.loadgen import LoadConfig, _LoadRun

#: Only its simulation sidecar is read, if there is one: the default population otherwise.
DATA = Path("data/transactions.parquet")
KEY = "6c6f616467656e2d746573742d6b6579"


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    keys = tmp_path / "client-keys.json"
    keys.write_text(json.dumps({"clients": {"loadgen": KEY}}))
    return Settings(kafka_bootstrap="127.0.0.1:9", client_keys_file=keys)


def test_prebuilt_sends_are_stamped_and_signed_for_the_moment_they_are_sent(settings: Settings) -> None:
    run = _LoadRun(LoadConfig(rate=400.0, duration_s=2.0, data=DATA, settings=settings, prebuild=True, seed=3))
    run.prepare()

    times = run._times
    assert 600 < len(times) < 1000  # Poisson: 800 expected
    assert np.all(np.diff(times) >= 0) and times[0] == 0.0 and times[-1] < 2.0
    assert run._prebuilt is not None and len(run._prebuilt) == len(times)
    start = run._start_epoch
    assert start is not None
    for at, send in list(zip(times, run._prebuilt))[::50]:
        stamp = start + float(at)
        tx = orjson.loads(send.value)
        assert datetime.fromisoformat(tx["timestamp"].replace("Z", "+00:00")).timestamp() == pytest.approx(
            stamp, abs=0.002
        )
        headers = dict(send.headers)
        assert int(headers["signed-at"]) == int(stamp * 1000)
        keys = {"loadgen": bytes.fromhex(KEY)}
        assert verify(send.value, headers, keys, stamp, 1.0).client_id == "loadgen"  # type: ignore[union-attr]
    assert len({send.tx_id for send in run._prebuilt}) == len(times)


def test_the_schedule_is_the_same_for_the_same_seed_and_covers_the_duration(settings: Settings) -> None:
    def schedule(seed: int) -> np.ndarray:
        return _LoadRun.schedule(type("Run", (), {"cfg": LoadConfig(rate=1000.0, duration_s=3.0, seed=seed)})())  # type: ignore[arg-type]

    a, b, c = schedule(1), schedule(1), schedule(2)
    assert np.array_equal(a, b) and not np.array_equal(a, c)
    assert 2700 < len(a) < 3300 and a[-1] > 2.9


def test_the_summary_gives_the_time_after_a_decision_beside_its_stages(settings: Settings) -> None:
    """``after``: a decision's latency at the client less the worker's own total
    (the commit and the read back), for measured decisions only."""
    run = _LoadRun(LoadConfig(rate=10.0, duration_s=1.0, data=DATA, settings=settings))
    for tx, total in (("a", 4.0), ("b", 8.0)):
        run.sent_at[tx] = 0.0
        run.measured_ids.add(tx)
        run.collect({"transaction_id": tx, "action": "approve", "latency_ms": {"queue_wait": 1.0, "total": total}}, 0.02)
    run.sent_at["warm"] = 0.0  # sent in the warm-up: not measured
    run.collect({"transaction_id": "warm", "action": "approve", "latency_ms": {"total": 1.0}}, 0.02)
    stages = run.summarise(sent=3, send_s=1.0)["stages_ms"]
    assert stages["after"]["max"] == pytest.approx(16.0) and stages["after"]["p50"] == pytest.approx(14.0)
    assert stages["total"]["max"] == 8.0 and stages["queue_wait"]["p50"] == 1.0


def test_the_summary_says_why_decisions_were_degraded(settings: Settings) -> None:
    run = _LoadRun(LoadConfig(rate=10.0, duration_s=1.0, data=DATA, settings=settings))
    why = ["amount over the review line", "degraded: feature store unavailable"]
    decisions = [
        {"transaction_id": "a", "action": "approve", "degraded": True, "explanation": why},
        {"transaction_id": "b", "action": "review", "degraded": True, "explanation": ["degraded: model budget exceeded"]},
        {"transaction_id": "c", "action": "approve", "degraded": True, "explanation": why},
        {"transaction_id": "d", "action": "approve", "explanation": ["low risk"]},
    ]
    for doc in decisions:
        run.sent_at[str(doc["transaction_id"])] = 0.0
        run.collect(doc, 0.01)

    summary = run.summarise(sent=4, send_s=1.0)
    assert summary["degraded"] == 3
    assert summary["degraded_why"] == {"feature store unavailable": 2, "model budget exceeded": 1}
