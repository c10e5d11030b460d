"""The outside load shape's pure parts: schedules, joining the two processes' stamps,
a fresh worker's first seconds, the shapes' agreement, and what the report and plot show."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from bench.criteria import THRESHOLDS_MS
from bench.outside import agreement, arrival_times, first_seconds, in_flight_at, stage_percentiles, summarise
from bench.plan import BATCHED, BATCHED_X2, FULL_PLAN, OUTSIDE, QUICK_PLAN
from bench.report import format_report
from bench.verdicts import run_record, scaling_doc, shapes_doc, sustainable, threshold_key

# --- schedules -------------------------------------------------------------------------


def test_constant_arrivals_are_evenly_spaced() -> None:
    times = arrival_times(500.0, 2.0, "constant", seed=1)
    assert len(times) == 1000
    assert np.allclose(np.diff(times), 0.002)
    assert times[0] == 0.0 and times[-1] < 2.0


def test_poisson_arrivals_average_the_rate_and_vary() -> None:
    times = arrival_times(1000.0, 20.0, "poisson", seed=3)
    assert 19_000 < len(times) < 21_000
    gaps = np.diff(times)
    assert abs(gaps.mean() - 0.001) < 0.0001
    assert gaps.std() > 0.0005  # exponential gaps: std ≈ mean; constant ones have none
    assert np.array_equal(times, arrival_times(1000.0, 20.0, "poisson", seed=3))


def test_unknown_arrivals_are_refused() -> None:
    with pytest.raises(ValueError, match="arrivals"):
        arrival_times(100.0, 1.0, "bursty", seed=1)


# --- joining the generator's and the stamper's files -------------------------------------


def two_files(n: int = 100, rate: float = 100.0, latency_s: float = 0.02, undecided: int = 0) -> tuple[Any, Any]:
    """A generator's file (sends at ``rate`` from t=1000) and a stamper's, each decided ``latency_s`` later;
    the last ``undecided`` never decided, one decision degraded."""
    t = [1000.0 + i / rate for i in range(n)]
    ids = [f"tx-{i}" for i in range(n)]
    sends = {"start": 1000.0, "end": 1000.0 + n / rate, "ids": ids, "t": t, "lag_ms": [0.5] * n}
    arrivals = {i: [s + latency_s, None, False, "approve"] for i, s in zip(ids[: n - undecided], t)}
    arrivals["tx-3"][1] = "model over budget"
    arrivals["unrelated"] = [1000.5, None, False, "approve"]  # another client's decision: ignored
    return sends, arrivals


def test_summary_joins_send_and_arrival_stamps() -> None:
    sends, arrivals = two_files(n=200, latency_s=0.02, undecided=5)
    samples = [
        {"t": 1000.5, "cpu_s": 1.0, "event": None},
        {"t": 1001.0, "cpu_s": 1.0, "loadgen_cpu_s": 0.0, "event": "measure_start"},
        {"t": 1002.0, "cpu_s": 1.5, "loadgen_cpu_s": 0.1, "event": "send_end"},
    ]
    samples = [{k: v for k, v in s.items() if v is not None} for s in samples]
    s = summarise(sends, arrivals, samples, offered_tps=100.0, warmup_s=1.0, duration_s=2.0)
    assert s["sent"] == 200 and s["decided"] == 195 and s["lost"] == 5
    assert s["measured"] == 95  # sent after the 1 s warm-up, and decided
    assert s["latency_ms"]["p50"] == pytest.approx(20.0, abs=0.01)
    assert s["latency_ms"]["max"] == pytest.approx(20.0, abs=0.01)
    assert s["degraded"] == 1 and s["degraded_why"] == {"model over budget": 1}
    # Decided in the measured second (1001-1002), whenever sent: those sent
    # from 20 ms before it to 20 ms before its end, less the five never decided.
    assert s["achieved_rate"] == 97.0
    assert [e["t"] for e in s["timeline"]] == [0.5, 1.0, 2.0]
    # Half a second in: 51 sent, those sent over 20 ms before decided.
    assert s["timeline"][0]["in_flight"] == 2
    record = run_record(OUTSIDE, "rate", 100.0, s, worker="w")
    assert record["shape"] == "outside" and record["arrivals"] == "constant"
    assert record["cpu_pct"] == 50.0
    assert record["cpu_ms_per_decision"]["worker"] == pytest.approx(500 / 97, abs=0.001)  # half a core, 97/s


def test_the_outside_shape_reports_the_decisions_stages_and_the_time_after_them() -> None:
    """As the inside shape does, from the decisions the stamper read: each of
    their own stages, and ``after`` (the latency less the worker's total: the
    commit and the read back), of measured decisions only."""
    sends, arrivals = two_files(n=200, latency_s=0.02)
    for i, (tx, stamp) in enumerate(arrivals.items()):
        if tx == "unrelated":
            continue
        slow = i % 10 == 0  # one in ten waited 12 ms to be taken, decided 15 ms after its send
        stages = {"queue_wait": 12.0 if slow else 2.0, "model": 0.5, "total": 15.0 if slow else 5.0}
        stamp.append(stages)
    arrivals["tx-150"] = arrivals["tx-150"][:4]  # a stamp without stages: in the latency, not the split
    s = summarise(sends, arrivals, [], offered_tps=100.0, warmup_s=1.0, duration_s=2.0)
    stages = s["stages_ms"]
    assert set(stages) == {"queue_wait", "model", "total", "after"}
    assert stages["queue_wait"]["p50"] == pytest.approx(2.0) and stages["queue_wait"]["max"] == pytest.approx(12.0)
    # 20 ms in all: 15 after a 5 ms decision, 5 after the slow ones' 15.
    assert stages["after"]["p50"] == pytest.approx(15.0, abs=0.01)
    assert stages["after"]["p99"] == pytest.approx(15.0, abs=0.01)
    assert stage_percentiles([[0.0, None, False, "approve", {"total": 4.0}]], [10.0])["after"]["max"] == 6.0
    assert stage_percentiles([], []) == {}
    record = run_record(OUTSIDE, "rate", 100.0, s, worker="w")
    assert record["stages"]["queue_wait"]["p50"] == pytest.approx(2.0)


def test_in_flight_counts_sent_and_not_yet_decided() -> None:
    sent = np.array([0.0, 1.0, 2.0, 3.0])
    decided = np.array([0.5, np.nan, 2.1, 5.0])
    assert [in_flight_at(t, sent, decided) for t in (0.2, 0.6, 2.05, 3.5, 6.0)] == [1, 0, 2, 2, 1]


def test_first_seconds_after_ready_split_by_second() -> None:
    sends, arrivals = two_files(n=500, rate=100.0, latency_s=0.01, undecided=0)
    # The first second after Ready is slow: its decisions arrive 400 ms late.
    for i in range(100):
        arrivals[f"tx-{i}"][0] += 0.4
    # Two sent in the window were never decided.
    del arrivals["tx-200"], arrivals["tx-201"]
    f = first_seconds(sends, arrivals, ready=1000.0, seconds=4.0)
    assert f["undecided_at_end"] == 2 + 1  # and the one sent at the window's edge, decided after it
    p99 = f["p99_by_second"]
    assert len(p99) == 4 and p99[0] > 300 and all(p < 20 for p in p99[2:])
    assert f["latency_ms"]["max"] == pytest.approx(410.0, abs=0.5)


def test_first_seconds_say_where_a_slow_second_waited() -> None:
    """The worker's own clock in each decision splits a slow second: waiting to
    be taken, being scored, or after the decision (commit and read back)."""
    sends, arrivals = two_files(n=400, rate=100.0, latency_s=0.01)
    for i, (tx, stamp) in enumerate(arrivals.items()):
        if tx == "unrelated":
            continue
        slow = i < 100  # the first second: 300 ms before its batch began, then 10 ms after the decision
        stamp[0] += 0.31 if slow else 0.0
        stamp.append({"queue_wait": 300.0, "total": 302.0} if slow else {"queue_wait": 1.0, "total": 3.0})
    arrivals["tx-150"] = arrivals["tx-150"][:4]  # a stamp without the worker's clock: left out of the split
    f = first_seconds(sends, arrivals, ready=1000.0, seconds=3.0)
    assert f["p99_by_second_taken"][0] == pytest.approx(300.0) and f["p99_by_second_taken"][2] == pytest.approx(1.0)
    assert f["p99_by_second_scored"][0] == pytest.approx(2.0)
    assert f["p99_by_second_after"][0] == pytest.approx(18.0, abs=0.5)  # 320 ms in all, less the 302 in the worker
    assert f["p99_by_second"][0] == pytest.approx(320.0, abs=0.5)


# --- agreement, scaling, the report ------------------------------------------------------


def test_shapes_agree_within_ten_percent_only_when_every_figure_does() -> None:
    inside = {"max_tps": 3000.0, "p99_ms": {1000.0: 54.0}, "cpu_ms": {1000.0: {"worker": 0.40, "broker": 0.2}}}
    close = {"max_tps": 2800.0, "p99_ms": {1000.0: 58.0}, "cpu_ms": {1000.0: {"worker": 0.43, "broker": 0.21}}}
    far = {"max_tps": 1750.0, "p99_ms": {1000.0: 80.0}, "cpu_ms": {1000.0: {"worker": 0.55, "broker": 0.2}}}
    assert agreement(inside, close)["agree"]
    result = agreement(inside, far)
    assert not result["agree"]
    verdicts = {c["what"]: c["agree"] for c in result["checks"]}
    assert verdicts["max TPS at p99 < 200 ms"] is False
    assert verdicts["p99 ms @ 1,000"] is False
    assert verdicts["worker CPU ms/decision @ 1,000"] is False
    assert verdicts["broker CPU ms/decision @ 1,000"] is True
    assert verdicts["redis CPU ms/decision @ 1,000"] is None  # not measured: not compared
    assert not agreement({}, {})["agree"]  # nothing compared is no agreement


def test_a_max_rate_found_only_as_a_lower_bound_disagrees_only_when_above() -> None:
    def verdict(a: dict[str, Any], b: dict[str, Any]) -> bool | None:
        return agreement(a, b)["checks"][0]["agree"]

    at_least_1000 = {"max_tps": 1000.0, "max_tps_lower_bound": True}
    assert verdict({"max_tps": 2000.0}, at_least_1000) is None  # it may hold 2,000 too: not measured
    assert verdict(at_least_1000, {"max_tps": 1000.0, "max_tps_lower_bound": True}) is None
    assert verdict({"max_tps": 3000.0, "max_tps_lower_bound": True}, {"max_tps": 1750.0}) is False


def summary(rate: float, p99: float, achieved: float | None = None, cpu_s: float = 1.0) -> dict[str, Any]:
    lat = {"p50": p99 / 3, "p95": p99 / 2, "p99": p99, "p99.9": p99, "max": p99}
    return {
        "offered_rate": rate, "duration_s": 5.0, "warmup_s": 1.0, "sent": int(rate * 5), "sent_rate": rate,
        "decided": int(rate * 5), "measured": int(rate * 4), "lost": 0, "achieved_rate": achieved or rate,
        "latency_ms": lat, "generator_lag_ms": {"p99": 1.0}, "stages_ms": {}, "actions": {}, "cached": 0,
        "degraded": 0, "timeline": [
            {"t": 1.0, "in_flight": 5, "event": "measure_start", "cpu_s": 0.0, "loadgen_cpu_s": 0.0},
            {"t": 5.0, "in_flight": 5, "event": "send_end", "cpu_s": cpu_s * 4, "loadgen_cpu_s": 0.4},
        ],
    }  # fmt: skip


def doc_of(runs: list[dict[str, Any]]) -> dict[str, Any]:
    by: dict[str, list[dict[str, Any]]] = {}
    for r in runs:
        by.setdefault(r["variant"], []).append(r)
    max_sus = {v: {threshold_key(t): sustainable(rs, t) for t in THRESHOLDS_MS} for v, rs in by.items()}
    return {
        "quick": True, "started_at": "2026-12-05T20:00:00+00:00", "duration_s": 60.0,
        "machine": {"cores": 2, "cpu_model": "Test CPU", "python": "3.11"}, "runs": runs,
        "max_sustainable": max_sus, "ratios": {"threshold_ms": 200.0, "batched_over_unbatched": None,
                                               "batched_over_ceiling": None},
        "shapes": shapes_doc(runs, max_sus), "scaling": scaling_doc(max_sus),
    }  # fmt: skip


def test_report_says_whether_the_shapes_agree_and_what_two_workers_hold() -> None:
    runs = [
        run_record(BATCHED, "rate", 1000.0, summary(1000.0, 54.0, cpu_s=0.4), worker="a"),
        run_record(BATCHED, "rate", 2000.0, summary(2000.0, 62.0, cpu_s=0.6), worker="a"),
        run_record(BATCHED, "rate", 4000.0, summary(4000.0, 2000.0, achieved=3000.0), worker="a"),
        run_record(OUTSIDE, "rate", 1000.0, summary(1000.0, 80.0, cpu_s=0.55), worker="b"),
        run_record(OUTSIDE, "rate", 2000.0, summary(2000.0, 3000.0, achieved=1800.0), worker="b"),
        run_record(BATCHED_X2, "rate", 4000.0, summary(4000.0, 90.0), worker="c"),
    ]
    doc = doc_of(runs)
    pair = doc["shapes"]["batched vs outside"]
    assert pair["inside"]["max_tps"] == 2000.0 and pair["outside"]["max_tps"] == 1000.0
    assert pair["inside"]["cpu_ms"][1000.0]["worker"] == pytest.approx(0.4)
    assert not pair["agree"]
    scaling = doc["scaling"]
    assert (scaling["workers_1_tps"], scaling["workers_2_tps"], scaling["ratio"]) == (2000.0, 4000.0, 2.0)
    text = format_report(doc)
    assert "load shapes batched vs outside (within 10%): DISAGREE" in text
    assert "1 worker 2,000 TPS, 2 workers 4,000 TPS (x2.0)" in text


def test_a_knee_whose_search_was_cut_short_is_given_as_its_bracket() -> None:
    """The time budget stopped two workers' search between 2,000 (held) and
    4,000 (failed): no knee of 2,000, no ratio to one worker's."""
    from bench.figures import render_summary

    runs = [
        run_record(BATCHED, "rate", 2000.0, summary(2000.0, 62.0), worker="a"),
        run_record(BATCHED, "rate", 2600.0, summary(2600.0, 90.0), worker="a"),
        run_record(BATCHED, "rate", 4000.0, summary(4000.0, 2000.0, achieved=3000.0), worker="a"),
        run_record(BATCHED_X2, "rate", 2000.0, summary(2000.0, 80.0), worker="c"),
        run_record(BATCHED_X2, "rate", 4000.0, summary(4000.0, 800.0, achieved=3900.0), worker="c"),
    ]
    doc = doc_of(runs)
    doc["max_sustainable"]["batched-x2"][threshold_key(200.0)]["cut_short"] = True
    doc["scaling"] = scaling_doc(doc["max_sustainable"])
    assert doc["scaling"]["ratio"] is None and doc["scaling"]["cut_short"] == ["batched-x2"]
    text = format_report(doc)
    assert "2,000-4,000, cut short" in text and "x0.769" not in text
    assert "the search of batched-x2 was cut short" in text
    assert "`batched-x2` 2,000-4,000 (search cut short)" in render_summary(doc)
    # Results written before entries carried the flag: the run's truncated list says it.
    del doc["max_sustainable"]["batched-x2"][threshold_key(200.0)]["cut_short"]
    assert "`batched-x2` 2,000 " in render_summary(doc)
    doc["truncated"] = [f"batched-x2: search for {threshold_key(200.0)}"]
    assert "`batched-x2` 2,000-4,000 (search cut short)" in render_summary(doc)


def test_the_summary_splits_each_shapes_latency_by_stage() -> None:
    """Where the shapes' latencies part: one stage table, a row per shape and rate."""
    from bench.figures import render_summary

    def staged(rate: float, p99: float, after: float) -> dict[str, Any]:
        stages = {"queue_wait": {"p50": 9.0, "p99": 20.0}, "total": {"p50": 12.0, "p99": 25.0},
                  "after": {"p50": after, "p99": after * 2}}  # fmt: skip
        return summary(rate, p99) | {"stages_ms": stages}

    runs = [
        run_record(BATCHED, "rate", 1000.0, staged(1000.0, 40.0, 8.0), worker="a"),
        run_record(OUTSIDE, "rate", 1000.0, staged(1000.0, 70.0, 30.0), worker="b"),
        run_record(OUTSIDE, "rate", 4000.0, staged(4000.0, 900.0, 30.0), worker="b"),  # over 200 ms: no row
    ]
    text = render_summary(doc_of(runs))
    assert "| 1,000 | batched | 9.0 / 20.0 | - | - | - | - | - | 12.0 / 25.0 | 8.0 / 16.0 |" in text
    assert "| 1,000 | outside | 9.0 / 20.0 | - | - | - | - | - | 12.0 / 25.0 | 30.0 / 60.0 |" in text
    assert "| 4,000 | outside |" not in text


def test_latency_plot_draws_every_variant_in_its_own_colour(tmp_path: Path) -> None:
    from bench.plots import latency_vs_rate, variant_colors

    runs = [
        run_record(v, "rate", rate, summary(rate, 40.0), worker="w")
        for v in (BATCHED, OUTSIDE, BATCHED_X2)
        for rate in (500.0, 1000.0)
    ]
    for name in ("bare", "streams"):  # the transport and a peer of another kind
        for r in runs[:2]:
            runs.append(r | {"variant": name})
    doc = doc_of(runs)
    colors = variant_colors(doc)
    assert set(colors) == {"batched", "outside", "batched-x2", "bare", "streams"}
    assert len(set(colors.values())) == len(colors)
    assert latency_vs_rate(doc, tmp_path).stat().st_size > 10_000


def test_both_plans_measure_the_outside_shape() -> None:
    for plan in (QUICK_PLAN, FULL_PLAN):
        assert any(leg.variant.shape == "outside" for leg in plan.legs)
    full = {leg.variant.name: leg for leg in FULL_PLAN.legs}
    assert full["outside"].variant.arrivals == "constant" and full["outside-poisson"].variant.arrivals == "poisson"
    assert full["batched-x2"].variant.workers == 2 and FULL_PLAN.fresh_rate


def test_reading_a_new_topics_ends_waits_for_its_leaders() -> None:
    import confluent_kafka as kafka

    from tools.loadgen import partitions_at_end

    class JustCreated:
        """A topic of two partitions whose leaders are elected after two answers."""

        def __init__(self) -> None:
            self.answers = 0

        def list_topics(self, topic: str, timeout: float) -> Any:
            meta = type("Meta", (), {"partitions": {0: None, 1: None}})
            return type("Cluster", (), {"topics": {topic: meta}})

        def get_watermark_offsets(self, tp: Any, timeout: float) -> tuple[int, int]:
            self.answers += 1
            if self.answers <= 2:
                raise kafka.KafkaException(kafka.KafkaError(kafka.KafkaError.NOT_LEADER_FOR_PARTITION))
            return 0, 10 + tp.partition

    ends = partitions_at_end(JustCreated(), "decisions", wait_s=5.0)
    assert [(tp.partition, tp.offset) for tp in ends] == [(0, 10), (1, 11)]

    class Refused(JustCreated):
        def get_watermark_offsets(self, tp: Any, timeout: float) -> tuple[int, int]:
            raise kafka.KafkaException(kafka.KafkaError(kafka.KafkaError.TOPIC_AUTHORIZATION_FAILED))

    with pytest.raises(kafka.KafkaException):  # not a missing leader: no waiting
        partitions_at_end(Refused(), "decisions", wait_s=5.0)
