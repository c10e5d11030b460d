"""The pure parts of the soak (bench/soak.py): windows, per-minute rows, the
verdict, and the cluster soak's readings, promotion and candidate version."""

from __future__ import annotations

from typing import Any

import pytest

from bench.soak import (
    extend_verdict,
    judge,
    minute_of,
    per_minute,
    pick_candidate,
    promotion_s,
    swapped_to,
    total,
    windows,
)


def timeline(minutes: int, *, rate: float = 100.0, feedback: bool = False, nodes: int = 0) -> list[dict[str, Any]]:
    """Samples every 10 s: ``rate`` decisions a second, 1 ms of worker CPU and 2 ms
    of broker CPU per decision (the feedback worker: 0.5 ms)."""
    out = []
    for i in range(minutes * 6 + 1):
        t = i * 10.0
        decided = int(rate * t)
        entry: dict[str, Any] = {
            "t": t, "decided": decided, "in_flight": 3, "cpu_s": decided * 0.001, "broker_cpu_s": decided * 0.002,
            "rss_mb": 300.0, "broker_rss_mb": 900.0,
        }  # fmt: skip
        if feedback:
            entry |= {"feedback_cpu_s": decided * 0.0005, "feedback_rss_mb": 200.0}
        if nodes:
            entry["broker_rss_mb_by_node"] = [300.0 + n for n in range(nodes)]
        out.append(entry)
    return out


def decisions(minutes: int, latency_ms: float = 20.0) -> dict[str, list[float]]:
    ts = [s + 0.5 for s in range(minutes * 60)]
    return {"t": ts, "latency_ms": [latency_ms] * len(ts)}


def test_per_minute_single_broker_rows_keep_their_columns() -> None:
    rows = per_minute(timeline(3), decisions(3), 3)
    assert [r["minute"] for r in rows] == [1, 2, 3]
    assert rows[1]["decided_per_s"] == 100.0
    assert rows[1]["worker_cpu_ms_per_decision"] == 1.0
    assert rows[1]["broker_cpu_ms_per_message"] == 2.0
    assert "feedback_cpu_ms_per_decision" not in rows[1]
    assert "broker_rss_mb_by_node" not in rows[1]


def test_per_minute_cluster_rows_add_the_feedback_worker_and_each_node() -> None:
    rows = per_minute(timeline(3, feedback=True, nodes=3), decisions(3), 3)
    assert rows[2]["feedback_cpu_ms_per_decision"] == 0.5
    assert rows[2]["feedback_rss_mb"] == 200.0
    assert rows[2]["broker_rss_mb_by_node"] == [300.0, 301.0, 302.0]


def test_total_is_none_when_any_process_is_missing() -> None:
    assert total([1.0, 2.5, 3.0]) == 6.5
    assert total([1.0, None]) is None  # a node gone: no partial sum passing for the whole
    assert total([]) is None


@pytest.mark.parametrize("minutes", [3, 5, 6, 12, 30, 60])
def test_promotion_falls_after_the_baseline(minutes: int) -> None:
    baseline, last, _ = windows(minutes)
    minute = minute_of(promotion_s(baseline, last))
    assert baseline[-1] < minute <= minutes
    if last[0] - baseline[-1] > 1:  # room between the windows: the swap is in neither
        assert minute not in baseline and minute not in last


def test_windows_after_the_default_warm_up() -> None:
    assert windows(60)[:2] == (range(2, 8), range(56, 61))
    assert windows(12)[:2] == (range(2, 8), range(8, 13))
    assert windows(5)[:2] == (range(2, 3), range(5, 6))
    assert windows(5)[2] is not None and windows(60)[2] is None


def test_windows_after_a_longer_warm_up() -> None:
    assert windows(60, warmup=5)[:2] == (range(6, 12), range(56, 61))
    assert windows(16, warmup=5)[:2] == (range(6, 12), range(12, 17))
    baseline, last, note = windows(10, warmup=5)  # too short: two windows after the warm-up
    assert (baseline, last) == (range(6, 8), range(9, 11))
    assert note is not None and "minute 6" in note


def test_promotion_of_the_hour_is_half_way() -> None:
    baseline, last, _ = windows(60)
    assert promotion_s(baseline, last) == 31 * 60 + 30.0
    assert minute_of(promotion_s(baseline, last)) == 32
    baseline, last, _ = windows(60, warmup=5)
    assert promotion_s(baseline, last) == 33 * 60 + 30.0


def test_minute_of() -> None:
    assert minute_of(0.0) == 1
    assert minute_of(59.9) == 1
    assert minute_of(60.0) == 2


def test_pick_candidate_is_the_newest_loadable_other_version() -> None:
    versions = ["v20261201-000000", "v20261202-000000", "v20261203-000000"]
    assert pick_candidate(versions, "v20261203-000000", lambda v: True) == "v20261202-000000"
    assert pick_candidate(versions, "v20261201-000000", lambda v: v != "v20261203-000000") == "v20261202-000000"
    assert pick_candidate(versions, "v20261202-000000", lambda v: False) is None
    assert pick_candidate(["v1"], "v1", lambda v: True) is None


def test_swapped_to_reads_the_reloaders_line() -> None:
    log = (
        "[2026-12-04 09:40:01,000] [1] [INFO] registry: model v2 requested (serving v1)\n"
        "[2026-12-04 09:40:02,000] [1] [INFO] now serving: model v1 -> v2 (swapped between batches)\n"
    )
    assert swapped_to(log, "v2")
    assert not swapped_to(log, "v3")
    assert not swapped_to(log.splitlines()[0], "v2")  # requested is not swapped


def test_extend_verdict_fails_on_any_added_check() -> None:
    base = judge({"broker_cpu_ms_per_message": 1.0, "p99_ms": 50.0, "broker_rss_mb": 900.0},
                 {"broker_cpu_ms_per_message": 1.05, "p99_ms": 52.0, "broker_rss_mb": 910.0}, lost=0)  # fmt: skip
    assert base["pass"]
    assert extend_verdict(base, labels_all_consumed=True, promotion_swapped=True)["pass"]
    failed = extend_verdict(base, labels_all_consumed=False)
    assert not failed["pass"] and failed["broker_rss_flat"] and not failed["labels_all_consumed"]


def test_a_worker_that_grows_or_slows_fails_the_verdict() -> None:
    steady = {"broker_cpu_ms_per_message": 1.0, "p99_ms": 50.0, "broker_rss_mb": 900.0,
              "worker_cpu_ms_per_decision": 1.8, "worker_rss_mb": 500.0}  # fmt: skip
    assert judge(steady, dict(steady, worker_rss_mb=560.0), lost=0)["pass"]  # +12 %
    grown = judge(steady, dict(steady, worker_rss_mb=600.0), lost=0)  # +20 %
    assert not grown["pass"] and not grown["worker_rss_flat"] and grown["broker_rss_flat"]
    slower = judge(steady, dict(steady, worker_cpu_ms_per_decision=2.2), lost=0)
    assert not slower["pass"] and not slower["worker_cpu_per_decision_stable"]
