"""bench/phases.py: the loop's wall time by phase from two scrapes of a worker's /metrics."""

from __future__ import annotations

from bench.phases import histograms, report, script_ms

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
