"""The REST-vs-gRPC benchmark's pure parts: the echo backend's decision, the figures, the plot."""

from __future__ import annotations

import dataclasses
import time
from collections import Counter
from pathlib import Path

import orjson

from app.contract import Decision
from bench.transports import Sample, Transactions, echo_decision, plot, scenario_record
from gateway.grpc_codec import decision_dict, decision_message
from pipeline.validate import Rejection, validate


def test_the_echo_answers_a_valid_transaction_with_a_decision_of_every_field() -> None:
    tx = Transactions("r1")()
    raw = orjson.dumps(tx)
    assert not isinstance(validate(raw, time.time()), Rejection)
    record = orjson.loads(echo_decision(raw, "c-1"))
    assert set(record) == {f.name for f in dataclasses.fields(Decision)}
    assert (record["transaction_id"], record["correlation_id"]) == (tx["transaction_id"], "c-1")
    assert decision_dict(decision_message(record)) == record


def test_cpu_per_request_leaves_out_the_idle_rate() -> None:
    sample = Sample([10.0] * 100, Counter(), seconds=2.0)
    record = scenario_record("grpc-seq", sample, cpu_s=0.3, requests=100, idle_cpu_per_s=0.05)
    assert record["gateway_cpu_ms_per_request"] == 3.0
    assert record["gateway_cpu_ms_per_request_net"] == 2.0  # (0.3 - 0.05 * 2) s / 100
    assert record["achieved_rps"] == 50.0 and record["latency_ms"]["p50"] == 10.0


def test_the_plot_is_written(tmp_path: Path) -> None:
    rows = [scenario_record(n, Sample([5.0, 9.0, 12.0], Counter(), 1.0), 0.01, 3) for n in ("rest-seq", "grpc-seq")]
    doc = {"scenarios": rows, "machine": {"cores": 2, "cpu_model": "x"}, "backend": "echo", "stream_rates": [500.0]}
    out = plot(doc, tmp_path / "t.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
