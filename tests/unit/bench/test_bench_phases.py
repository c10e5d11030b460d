"""bench/phases.py: the loop's wall time by phase from two scrapes of a worker's /metrics."""

from __future__ import annotations

from typing import Any

from bench.phases import broker_requests, histograms, jfr_top, report, script_ms, thread_cpu

BEFORE = """# HELP fraud_loop_seconds The scoring loop's time per step, by phase
fraud_loop_seconds_bucket{le="0.001",phase="take"} 3.0
fraud_loop_seconds_sum{phase="take"} 0.5
fraud_loop_seconds_count{phase="take"} 10.0
fraud_loop_seconds_sum{phase="score"} 1.0
fraud_loop_seconds_count{phase="score"} 10.0
fraud_kafka_commit_seconds_sum 0.25
fraud_kafka_commit_seconds_count 5.0
fraud_messages_total 1280.0
"""
AFTER = """fraud_loop_seconds_sum{phase="take"} 0.6
fraud_loop_seconds_count{phase="take"} 110.0
fraud_loop_seconds_sum{phase="score"} 5.0
fraud_loop_seconds_count{phase="score"} 110.0
fraud_loop_seconds_sum{phase="send"} 0.4
fraud_loop_seconds_count{phase="send"} 100.0
fraud_kafka_commit_seconds_sum 0.25
fraud_kafka_commit_seconds_count 5.0
"""


def test_a_phase_is_its_time_within_the_window_over_the_windows_wall_time() -> None:
    rows = report(BEFORE, AFTER, wall_s=10.0)
    assert rows['fraud_loop_seconds{phase="score"}'] == {"share_of_wall": 0.4, "per_s": 10.0, "mean_ms": 40.0}
    assert rows['fraud_loop_seconds{phase="take"}'] == {"share_of_wall": 0.01, "per_s": 10.0, "mean_ms": 1.0}
    # Not in the first scrape: all of it is the window's.
    assert rows['fraud_loop_seconds{phase="send"}']["mean_ms"] == 4.0
    # No call within the window: nothing to say about it.
    assert "fraud_kafka_commit_seconds" not in rows


def test_only_the_loops_histograms_are_read_and_buckets_are_not_sums() -> None:
    assert set(histograms(BEFORE)) == {
        'fraud_loop_seconds{phase="take"}',
        'fraud_loop_seconds{phase="score"}',
        "fraud_kafka_commit_seconds",
    }


def test_the_batch_scripts_durations_are_read_from_the_slowlog_in_ms() -> None:
    entries = [
        {"duration": 14000, "command": "EVALSHA 3f2a 12 k1 k2"},
        {"duration": 900, "command": "SET x 1"},
        {"duration": 21500, "command": "evalsha 3f2a 9 k1"},
    ]
    assert script_ms(entries) == [14.0, 21.5]


# Kafka's JmxTool, --report-format properties (two versions of Produce counted apart by the broker).
JMX_BEFORE = """time=1000000
kafka.network:type=RequestMetrics,name=LocalTimeMs,request=Produce:Count=1000
kafka.network:type=RequestMetrics,name=LocalTimeMs,request=Produce:Mean=0.02
kafka.network:type=RequestMetrics,name=LocalTimeMs,request=WriteTxnMarkers:Count=10
kafka.network:type=RequestMetrics,name=LocalTimeMs,request=WriteTxnMarkers:Mean=0.5
kafka.network:type=RequestMetrics,name=RequestsPerSec,request=Produce,version=9:Count=400
kafka.network:type=RequestMetrics,name=RequestsPerSec,request=Produce,version=10:Count=600
kafka.network:type=RequestMetrics,name=RequestsPerSec,request=WriteTxnMarkers,version=2:Count=10
kafka.network:type=RequestMetrics,name=RequestsPerSec,request=Heartbeat,version=4:Count=7
"""
JMX_AFTER = """time=1010000
kafka.network:type=RequestMetrics,name=LocalTimeMs,request=Produce:Count=3000
kafka.network:type=RequestMetrics,name=LocalTimeMs,request=Produce:Mean=0.03
kafka.network:type=RequestMetrics,name=LocalTimeMs,request=WriteTxnMarkers:Count=110
kafka.network:type=RequestMetrics,name=LocalTimeMs,request=WriteTxnMarkers:Mean=0.5
kafka.network:type=RequestMetrics,name=RequestsPerSec,request=Produce,version=9:Count=400
kafka.network:type=RequestMetrics,name=RequestsPerSec,request=Produce,version=10:Count=2600
kafka.network:type=RequestMetrics,name=RequestsPerSec,request=WriteTxnMarkers,version=2:Count=110
kafka.network:type=RequestMetrics,name=RequestsPerSec,request=Heartbeat,version=4:Count=7
"""


def test_broker_requests_are_rates_over_the_reports_own_times_with_the_handlers_time_each() -> None:
    rows = broker_requests(JMX_BEFORE, JMX_AFTER)
    # 2,000 more Produce requests in 10 s; local time went from 1,000 x 0.02 ms to 3,000 x 0.03 ms.
    assert rows["Produce"] == {"per_s": 200.0, "local_ms_per_s": 7.0, "local_us_each": 35.0}
    assert rows["WriteTxnMarkers"] == {"per_s": 10.0, "local_ms_per_s": 5.0, "local_us_each": 500.0}
    assert "Heartbeat" not in rows  # none within the window
    assert list(rows) == ["Produce", "WriteTxnMarkers"]  # the busiest first


def test_broker_requests_need_two_reports_in_order() -> None:
    assert broker_requests(JMX_AFTER, JMX_BEFORE) == {}
    assert broker_requests("", JMX_AFTER) == {}


def _stat(tid: int, name: str, utime: int, stime: int) -> str:
    """A /proc/<pid>/task/<tid>/stat line as Linux writes it (fields 3-13 and 16 on made up)."""
    return f"{tid} ({name}) S 1 1 1 0 -1 4194624 10 0 0 0 {utime} {stime} 0 0 20 0 40 0 100 0 0"


def test_thread_cpu_adds_up_threads_whose_names_differ_by_their_numbers() -> None:
    before = "\n".join([_stat(1, "data-plane-kafk", 60, 40), _stat(2, "data-plane-kafk", 30, 20),
                        _stat(3, "C2 CompilerThre", 10, 0), _stat(4, "GC Thread#0", 5, 0)])  # fmt: skip
    after = "\n".join([_stat(1, "data-plane-kafk", 160, 140), _stat(2, "data-plane-kafk", 80, 70),
                       _stat(3, "C2 CompilerThre", 209, 1), _stat(4, "GC Thread#0", 5, 0),
                       _stat(5, "GC Thread#1", 30, 0)])  # fmt: skip
    # 10 s at 100 ticks a second: 1,000 ticks are one core.
    assert thread_cpu(before, after, wall_s=10.0, ticks_per_s=100) == {
        "data-plane-kafk": 30.0, "C2 CompilerThre": 20.0, "GC Thread#N": 3.0,
    }  # fmt: skip
    # The kernel's share alone; a name with a space does not shift the fields read.
    assert thread_cpu(before, after, wall_s=10.0, ticks_per_s=100, kernel=True) == {
        "data-plane-kafk": 15.0, "C2 CompilerThre": 0.1,
    }  # fmt: skip


def _sample(thread: str, *methods: str) -> dict[str, Any]:
    """One jdk.ExecutionSample event as `jfr print --json` writes it (innermost frame first)."""
    frames = [{"method": {"type": {"name": m.rpartition(".")[0].replace(".", "/")}, "name": m.rpartition(".")[2]}}
              for m in methods]  # fmt: skip
    return {
        "type": "jdk.ExecutionSample",
        "values": {"sampledThread": {"javaName": thread}, "stackTrace": {"frames": frames}},
    }


def test_jfr_top_shares_samples_by_thread_own_method_and_stack() -> None:
    recording = {"recording": {"events": [
        _sample("data-plane-kafka-request-handler-0", "a.Histogram.update", "a.Api.handleProduce", "a.Api.handle"),
        _sample("data-plane-kafka-request-handler-1", "a.Log.append", "a.Api.handleProduce", "a.Api.handle"),
        _sample("data-plane-kafka-request-handler-1", "a.Histogram.update", "a.Api.handleFetch", "a.Api.handle"),
        _sample("TxnMarkerSenderThread-1", "a.Marker.send"),
    ]}}  # fmt: skip
    top = jfr_top(recording, n=3)
    assert top["samples"] == 4
    assert top["threads_pct"] == {"data-plane-kafka-request-handler-N": 75.0, "TxnMarkerSenderThread-N": 25.0}
    assert top["self_pct"] == {"a.Histogram.update": 50.0, "a.Log.append": 25.0, "a.Marker.send": 25.0}
    # a method counts once per sample however deep; only the n largest are kept
    assert top["inclusive_pct"] == {"a.Api.handle": 75.0, "a.Api.handleProduce": 50.0, "a.Histogram.update": 50.0}
    assert jfr_top({}) == {"samples": 0, "threads_pct": {}, "self_pct": {}, "inclusive_pct": {}}
