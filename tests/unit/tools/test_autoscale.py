"""The autoscaling arithmetic and the reading of worker scrapes (pure)."""

from __future__ import annotations

import math

import pytest

from app.errors import ConfigError
from tools.autoscale import WorkerScrape, advise, combine, parse_scrape


def test_workers_cover_arrival_plus_draining_the_lag() -> None:
    # 300 TPS arriving, 6,000 behind, drained in 60 s: 400 TPS; 200 TPS per worker at 70 % = 140.
    a = advise(lag=6000, arrival_tps=300, capacity_per_worker_tps=200, partitions=8, current_workers=2)
    assert a.needed_tps == 400 and a.per_worker_tps == 140
    assert a.workers == 3 and not a.capped  # ceil(400 / 140) = 3
    assert any("scale up: 2 -> 3" in r for r in a.reasons)


def test_capped_by_partitions_says_so() -> None:
    a = advise(lag=0, arrival_tps=5000, capacity_per_worker_tps=300, partitions=8, current_workers=8)
    assert a.workers == 8 and a.capped
    assert any("add partitions" in r for r in a.reasons)


def test_idle_scales_down_to_one_not_zero() -> None:
    a = advise(lag=0, arrival_tps=0, capacity_per_worker_tps=300, partitions=8, current_workers=4)
    assert a.workers == 1
    assert any("scale down: 4 -> 1" in r for r in a.reasons)


def test_exact_fit_does_not_round_up() -> None:
    a = advise(lag=0, arrival_tps=280, capacity_per_worker_tps=200, partitions=8, current_workers=2,
               target_utilization=0.7)  # fmt: skip
    assert a.workers == 2  # 280 / 140 is exactly 2


def test_lag_alone_drives_scale_up_with_a_short_drain() -> None:
    slow = advise(lag=12000, arrival_tps=0, capacity_per_worker_tps=100, partitions=16, current_workers=1, drain_s=600)
    fast = advise(lag=12000, arrival_tps=0, capacity_per_worker_tps=100, partitions=16, current_workers=1, drain_s=30)
    assert (slow.workers, fast.workers) == (1, 6)  # 20 TPS -> 1; 400 TPS / 70 -> 6


def test_unknown_capacity_keeps_the_current_count() -> None:
    for capacity in (None, math.nan, 0.0):
        a = advise(lag=100, arrival_tps=10, capacity_per_worker_tps=capacity, partitions=8, current_workers=3)
        assert a.workers == 3 and "no measured per-worker capacity" in a.reasons[-1]
    assert advise(lag=0, arrival_tps=0, capacity_per_worker_tps=None, partitions=4, current_workers=9).workers == 4


@pytest.mark.parametrize(
    "bad", [{"partitions": 0}, {"target_utilization": 0.0}, {"target_utilization": 1.5}, {"drain_s": 0.0}]
)
def test_refuses_nonsense_parameters(bad: dict[str, float]) -> None:
    args = {"lag": 0, "arrival_tps": 1, "capacity_per_worker_tps": 10, "partitions": 8, "current_workers": 1, **bad}
    with pytest.raises(ConfigError):
        advise(**args)  # type: ignore[arg-type]


SCRAPE = """\
# HELP fraud_messages_total Messages taken from the transactions topic
# TYPE fraud_messages_total counter
fraud_messages_total 1200.0
# TYPE fraud_busy_seconds_total counter
fraud_busy_seconds_total 3.0
# TYPE fraud_worker_capacity_tps gauge
fraud_worker_capacity_tps 410.5
# TYPE fraud_consumer_lag gauge
fraud_consumer_lag{partition="0",topic="transactions"} 15.0
fraud_consumer_lag{partition="1",topic="transactions"} 5.0
"""


def test_parse_scrape() -> None:
    w = parse_scrape("http://w1:6066/metrics", SCRAPE)
    assert (w.messages, w.busy_seconds, w.capacity_tps) == (1200.0, 3.0, 410.5)
    assert w.lag == {("transactions", "0"): 15.0, ("transactions", "1"): 5.0}
    with pytest.raises(ConfigError, match="no fraud_messages_total"):
        parse_scrape("http://elsewhere/metrics", "# TYPE up gauge\nup 1.0\n")


def _w(url: str, messages: float, busy: float, lag: dict[str, float], capacity: float = math.nan) -> WorkerScrape:
    return WorkerScrape(url, messages, busy, capacity, {("transactions", p): v for p, v in lag.items()})


def test_combine_two_scrapes() -> None:
    first = [_w("a", 1000, 2.0, {"0": 100, "1": 0}), _w("b", 500, 1.0, {"2": 50})]
    second = [_w("a", 1600, 3.0, {"0": 150, "1": 0}), _w("b", 900, 2.0, {"2": 100})]
    m = combine(first, second, interval_s=10.0)
    assert m.processed_tps == 100.0  # (600 + 400) / 10
    assert m.capacity_per_worker_tps == 500.0  # 1000 messages in 2 busy seconds
    assert m.lag == 250 and m.partitions_seen == 3
    assert m.arrival_tps == 110.0  # processed + lag growth (100 / 10 s)


def test_combine_counts_a_partition_reported_twice_once_and_skips_restarted_workers() -> None:
    first = [_w("a", 1000, 2.0, {"0": 10}), _w("b", 5000, 9.0, {})]
    second = [_w("a", 1100, 2.5, {"0": 10}), _w("b", 20, 0.1, {"0": 10})]  # b restarted, counters reset
    m = combine(first, second, interval_s=5.0)
    assert m.lag == 10 and m.processed_tps == 20.0 and m.capacity_per_worker_tps == 200.0


def test_combine_idle_falls_back_to_the_capacity_gauge() -> None:
    first = [_w("a", 10, 1.0, {"0": 0}, capacity=300.0)]
    m = combine(first, [_w("a", 10, 1.0, {"0": 0}, capacity=300.0)], interval_s=5.0)
    assert m.capacity_per_worker_tps == 300.0 and m.arrival_tps == 0.0


def test_combine_broker_samples() -> None:
    from tools.autoscale import PartitionOffsets, combine_broker

    first = {0: PartitionOffsets(100, 90), 1: PartitionOffsets(50, None)}
    second = {0: PartitionOffsets(160, 150), 1: PartitionOffsets(80, 20)}
    m = combine_broker(first, second, interval_s=10.0, workers=2)
    assert m.arrival_tps == 9.0 and m.processed_tps == 8.0  # (60 + 30) / 10 arrived, (60 + 20) / 10 committed
    assert m.lag == 10 + 60 and m.partitions_seen == 2 and m.capacity_per_worker_tps is None


def test_an_idle_worker_with_part_empty_batches_is_not_scaled_up() -> None:
    """30 TPS on one worker using 19 % of a core: its one-message batches are
    busy 81 % of the time (37 messages per busy second), which once advised 1 -> 2."""
    interval, tps, batch_size = 30.0, 30.0, 32
    messages, busy, cpu = tps * interval, tps * interval / 37.0, 0.19 * interval
    first = [WorkerScrape("a", 0.0, 0.0, math.nan, {("transactions", "0"): 0.0}, 100.0, 0.0, 0.0)]
    second = [WorkerScrape("a", messages, busy, math.nan, {("transactions", "0"): 0.0},
                           100.0 + cpu, messages / batch_size, messages)]  # fmt: skip
    m = combine(first, second, interval)
    assert m.capacity_per_worker_tps is not None and m.capacity_per_worker_tps > 150  # 900 / 5.7 CPU s
    advice = advise(
        lag=m.lag, arrival_tps=m.arrival_tps, capacity_per_worker_tps=m.capacity_per_worker_tps,
        partitions=8, current_workers=1,
    )  # fmt: skip
    assert advice.workers == 1, advice.reasons
    # Without the CPU and fill figures the old estimate stands (and would scale up).
    bare = combine([_w("a", 0.0, 0.0, {"0": 0})], [_w("a", messages, busy, {"0": 0})], interval)
    assert bare.capacity_per_worker_tps == pytest.approx(37.0)


def test_a_saturated_worker_keeps_messages_per_busy_second() -> None:
    first = [WorkerScrape("a", 0.0, 0.0, math.nan, {}, 0.0, 0.0, 0.0)]
    second = [WorkerScrape("a", 9000.0, 30.0, math.nan, {}, 29.0, 280.0, 290.0)]  # batches 97 % full
    assert combine(first, second, 30.0).capacity_per_worker_tps == 300.0


def test_parse_scrape_reads_cpu_and_batch_fill() -> None:
    text = SCRAPE + (
        "# TYPE process_cpu_seconds_total counter\nprocess_cpu_seconds_total 12.5\n"
        "# TYPE fraud_batch_fill_ratio histogram\nfraud_batch_fill_ratio_bucket{le=\"+Inf\"} 40.0\n"
        "fraud_batch_fill_ratio_count 40.0\nfraud_batch_fill_ratio_sum 10.0\n"
    )
    w = parse_scrape("http://w1:6066/metrics", text)
    assert (w.cpu_seconds, w.fill_sum, w.batches) == (12.5, 10.0, 40.0)
