"""The pure parts of the benchmark harness: readings, pass/fail, the search, the results."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from bench.criteria import THRESHOLDS_MS
from bench.plan import BATCHED, CEILING, UNBATCHED
from bench.procs import parse_stat_cpu_s, parse_status_rss_mb
from bench.report import format_report
from bench.verdicts import (
    bracket,
    cpu_pct_between,
    cpu_per_decision_by_variant,
    needs_repeat,
    next_probe,
    passes,
    ratios,
    run_record,
    saturated_tps,
    sustainable,
    threshold_key,
    validate_results,
    verdicts,
)
from tools.loadgen import percentiles

# --- synthetic inputs ------------------------------------------------------------------


def summary(rate: float = 1000.0, *, p99: float | None = 40.0, lost: int = 0, degraded: int = 0,
            gen_lag: float = 2.0, decided: int = 5000) -> dict[str, Any]:  # fmt: skip
    """What tools.loadgen.run_load returns for a bench run (warm-up 1 s, 5 s in all)."""
    lat = None if p99 is None else {"p50": p99 / 4, "p95": p99 / 2, "p99": p99, "p99.9": p99 * 1.5, "max": p99 * 2}
    return {
        "offered_rate": rate,
        "duration_s": 5.0,
        "warmup_s": 1.0,
        "sent": int(rate * 5),
        "sent_rate": rate * 0.97,  # Poisson: the count sent is a sample, not a test of the generator
        "decided": decided,
        "measured": decided - int(rate),
        "lost": lost,
        "achieved_rate": rate,
        "latency_ms": lat or percentiles([]),
        "generator_lag_ms": {"p50": 0.5, "p95": 1.0, "p99": gen_lag, "p99.9": gen_lag, "max": gen_lag},
        "stages_ms": {
            "queue_wait": {"p50": 8.0, "p95": 15.0, "p99": 20.0, "p99.9": 22.0, "max": 25.0},
            "model": {"p50": 1.0, "p95": 2.0, "p99": 3.0, "p99.9": 4.0, "max": 5.0},
            "total": {"p50": 10.0, "p95": 18.0, "p99": 25.0, "p99.9": 27.0, "max": 30.0},
        },
        "actions": {"approve": decided},
        "cached": 0,
        "degraded": degraded,
        "timeline": [
            {"t": 0.5, "in_flight": 12, "decided": 480, "cpu_s": 10.0, "rss_mb": 250.0, "loadgen_cpu_s": 3.0},
            {"t": 1.0, "in_flight": 10, "decided": 990, "event": "measure_start", "cpu_s": 10.2,
             "rss_mb": 251.0, "loadgen_cpu_s": 3.2},
            {"t": 3.0, "in_flight": 11, "decided": 2990, "cpu_s": 11.0, "rss_mb": 260.0, "loadgen_cpu_s": 3.6},
            {"t": 5.0, "in_flight": 9, "decided": 4990, "event": "send_end", "cpu_s": 11.8,
             "rss_mb": 255.0, "loadgen_cpu_s": 4.0},
            {"t": 5.2, "in_flight": 0, "decided": 5000, "event": "drained", "cpu_s": 11.9,
             "rss_mb": 400.0, "loadgen_cpu_s": 4.1},
        ],
    }  # fmt: skip


def record(variant=BATCHED, rate: float = 1000.0, **kw: Any) -> dict[str, Any]:
    return run_record(variant, "rate", rate, summary(rate, **kw), worker=f"{variant.name}-x")


def results_doc(runs: list[dict[str, Any]]) -> dict[str, Any]:
    by_variant: dict[str, list[dict[str, Any]]] = {}
    for r in runs:
        by_variant.setdefault(r["variant"], []).append(r)
    max_sus = {v: {threshold_key(t): sustainable(rs, t) for t in THRESHOLDS_MS} for v, rs in by_variant.items()}
    return {
        "schema": "fraud-pipeline-bench/1",
        "quick": True,
        "started_at": "2026-12-02T12:00:00+00:00",
        "duration_s": 90.0,
        "machine": {"cores": 2, "cpu_model": "Test CPU", "python": "3.11.7"},
        "settings": {"partitions": 8},
        "runs": runs,
        "max_sustainable": max_sus,
        "ratios": ratios(max_sus),
    }


# --- percentiles and /proc readings --------------------------------------------------------


def test_percentiles_of_a_known_distribution() -> None:
    p = percentiles(np.arange(1, 1001, dtype=float))
    assert p == {"p50": 500.5, "p95": 950.0, "p99": 990.0, "p99.9": 999.0, "max": 1000.0}


def test_percentiles_of_nothing_are_none() -> None:
    assert set(percentiles([]).values()) == {None}


def test_stat_cpu_counts_from_the_last_paren() -> None:
    # comm with a space and a parenthesis; utime 250, stime 50 ticks (fields 14, 15).
    fields = ["S", "1", "2", "3", "0", "-1", "4194560", "10", "0", "0", "0", "250", "50"] + ["0"] * 30
    line = "4242 (fraud (pipe) x) " + " ".join(fields)
    assert parse_stat_cpu_s(line, 100) == pytest.approx(3.0)


def test_status_rss_in_mib() -> None:
    status = "Name:\tpython\nVmPeak:\t 999999 kB\nVmRSS:\t  262144 kB\nThreads:\t9\n"
    assert parse_status_rss_mb(status) == 256.0
    assert parse_status_rss_mb("Name:\tzombie\n") is None


def test_cpu_pct_uses_the_measured_window_only() -> None:
    timeline = summary()["timeline"]
    # 11.8 - 10.2 CPU seconds over 5.0 - 1.0 s: 40 % of one core; warm-up and drain left out.
    assert cpu_pct_between(timeline, "cpu_s") == 40.0
    assert cpu_pct_between(timeline, "loadgen_cpu_s") == 20.0
    assert cpu_pct_between(timeline, "broker_cpu_s") is None
    assert cpu_pct_between([e for e in timeline if e.get("event") != "send_end"], "cpu_s") is None


def test_run_record_fields() -> None:
    r = record(CEILING, 2500.0, p99=80.0)
    assert r["variant"] == "ceiling" and r["offered_tps"] == 2500.0
    assert (r["p50_ms"], r["p95_ms"], r["p99_ms"], r["p999_ms"]) == (20.0, 40.0, 80.0, 120.0)
    assert r["cpu_pct"] == 40.0
    assert r["rss_mb"] == 260.0  # the drain's 400 MiB is outside the window
    assert r["measure_s"] == 4.0
    assert r["stages"]["model"] == {"p50": 1.0, "p99": 3.0}
    assert r["lag"][0] == [0.5, 12] and len(r["lag"]) == 5
    assert r["batch_size"] == CEILING.batch_size and r["batch_window_ms"] == CEILING.batch_window_s * 1000


# --- pass/fail and the search ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("kw", "threshold", "expected"),
    [
        ({"p99": 40.0}, 50.0, True),
        ({"p99": 50.0}, 50.0, False),  # strictly under
        ({"p99": 150.0}, 200.0, True),
        ({"p99": 40.0, "lost": 1}, 200.0, False),
        ({"p99": 40.0, "degraded": 50}, 200.0, True),  # 1 % of 5,000
        ({"p99": 40.0, "degraded": 51}, 200.0, False),
        ({"p99": 40.0, "gen_lag": 100.0}, 200.0, True),
        ({"p99": 40.0, "gen_lag": 150.0}, 200.0, False),  # the generator fell behind
        ({"p99": None, "decided": 0}, 200.0, False),
    ],
)
def test_passes(kw: dict[str, Any], threshold: float, expected: bool) -> None:
    assert passes(record(**kw), threshold) is expected


def test_a_run_with_an_error_never_passes() -> None:
    r = record(p99=10.0)
    r["error"] = "worker exited"
    assert not passes(r, 200.0)


def test_bracket_does_not_believe_a_pass_above_a_failure() -> None:
    assert bracket({1000.0: True, 2500.0: False, 3000.0: True, 5000.0: False}) == (1000.0, 2500.0)
    assert bracket({1000.0: True, 2500.0: True}) == (2500.0, None)
    assert bracket({1000.0: False}) == (0.0, 1000.0)


def test_next_probe_doubles_until_something_fails() -> None:
    assert next_probe({1000.0: True, 2500.0: True}, floor=100, cap=40000) == 5000.0
    assert next_probe({40000.0: True}, floor=100, cap=40000) is None
    assert next_probe({30000.0: True}, floor=100, cap=40000) == 40000.0
    assert next_probe({}, floor=100, cap=40000) == 100


def test_next_probe_bisects_and_stops_at_the_resolution() -> None:
    assert next_probe({1000.0: True, 2500.0: False}, floor=100, cap=40000) == 1750.0
    assert next_probe({2300.0: True, 2500.0: False}, floor=100, cap=40000) is None  # within 10 %
    assert next_probe({1000.0: False}, floor=100, cap=40000) == 500.0
    assert next_probe({100.0: False}, floor=100, cap=40000) is None  # even the floor fails


def test_next_probe_searches_below_a_saturated_variants_throughput() -> None:
    """A variant that fails at 1,000 TPS offered having delivered only 80 is
    searched between 0 and 80, in steps fine enough to give it a figure."""
    assert next_probe({1000.0: False}, floor=10, cap=40000, saturated_tps=80.0) == 40.0
    assert next_probe({1000.0: False, 40.0: True}, floor=10, cap=40000, saturated_tps=80.0) == 60.0
    # a saturation figure above the lowest failure changes nothing
    assert next_probe({1000.0: False}, floor=10, cap=40000, saturated_tps=1500.0) == 500.0
    # within the resolution of the saturation figure: done
    assert next_probe({1000.0: False, 75.0: True}, floor=10, cap=40000, saturated_tps=80.0) is None


def test_saturated_tps_reads_only_failing_runs_that_fell_behind() -> None:
    saturated = record(UNBATCHED, 1000.0, p99=1800.0)
    saturated["achieved_tps"] = 83.0
    kept_up_but_slow = record(UNBATCHED, 250.0, p99=400.0)  # delivered its rate, failed on p99
    passing = record(UNBATCHED, 50.0, p99=120.0)
    assert saturated_tps([saturated, kept_up_but_slow, passing], 200.0) == 83.0
    assert saturated_tps([kept_up_but_slow, passing], 200.0) is None


def test_search_gives_a_slow_variant_a_sustainable_rate() -> None:
    """Unbatched scoring saturating at ~80 TPS used to end the search at the
    100 TPS floor with no figure (and no batched/unbatched ratio)."""
    capacity = 64.0
    runs = []
    for rate in (1000.0, 2500.0, 5000.0):
        run = record(UNBATCHED, rate, p99=1800.0)
        run["achieved_tps"] = 80.0
        runs.append(run)
    for _ in range(3):
        outcomes = {r["offered_tps"]: passes(r, 200.0) for r in runs}
        rate = next_probe(outcomes, floor=10, cap=40000, saturated_tps=saturated_tps(runs, 200.0))
        if rate is None:
            break
        runs.append(record(UNBATCHED, rate, p99=100.0 if rate < capacity else 900.0))
    found = sustainable(runs, 200.0)["tps"]
    assert found is not None and 0.75 * capacity <= found < capacity


@pytest.mark.parametrize("capacity", [180.0, 700.0, 3300.0, 4999.0, 12000.0])
def test_search_converges_on_a_synthetic_system(capacity: float) -> None:
    """A system that passes below ``capacity``: the search brackets it within 10 %."""
    outcomes = {1000.0: 1000.0 < capacity, 2500.0: 2500.0 < capacity, 5000.0: 5000.0 < capacity}
    tried = list(outcomes)
    for _ in range(20):
        rate = next_probe(outcomes, floor=100, cap=40000)
        if rate is None:
            break
        assert rate not in tried
        tried.append(rate)
        outcomes[rate] = rate < capacity
    lo, hi = bracket(outcomes)
    assert hi is not None and lo < capacity <= hi
    assert hi - lo <= max(50.0, 0.1 * hi)
    assert len(tried) <= 3 + 8


def test_sustainable_and_ratios() -> None:
    runs = [
        record(CEILING, 1000.0, p99=20.0), record(CEILING, 2500.0, p99=30.0), record(CEILING, 5000.0, p99=120.0),
        record(UNBATCHED, 1000.0, p99=150.0), record(UNBATCHED, 2500.0, p99=900.0, lost=3),
        record(BATCHED, 1000.0, p99=30.0), record(BATCHED, 2500.0, p99=60.0), record(BATCHED, 5000.0, p99=400.0),
    ]  # fmt: skip
    doc = results_doc(runs)
    ms = doc["max_sustainable"]
    assert ms["ceiling"][threshold_key(200)] | {"probes": None, "repeated": None} == {
        "tps": 5000.0, "bracket": [5000.0, None], "lower_bound": True, "probes": None, "repeated": None,
    }  # fmt: skip
    assert ms["ceiling"][threshold_key(50)]["tps"] == 2500.0
    assert ms["unbatched"][threshold_key(200)]["bracket"] == [1000.0, 2500.0]
    assert ms["unbatched"][threshold_key(50)]["tps"] == 0.0
    assert ms["batched"][threshold_key(200)]["tps"] == 2500.0
    # No bare-client run here: its ratio is unknown, not zero.
    assert doc["ratios"] == {
        "threshold_ms": 200.0, "batched_over_unbatched": 2.5, "batched_over_ceiling": 0.5, "batched_over_bare": None,
    }  # fmt: skip
    assert ratios(ms, 50.0)["batched_over_unbatched"] is None  # unbatched sustained nothing


def test_sustainable_of_no_runs() -> None:
    assert sustainable([], 200.0)["tps"] is None


# --- the results document ----------------------------------------------------------------------


def test_results_document_schema() -> None:
    doc = results_doc([record(CEILING), record(UNBATCHED), record(BATCHED)])
    assert validate_results(doc) == []


def test_schema_problems_are_named() -> None:
    doc = results_doc([record(BATCHED)])
    del doc["machine"]["cores"]
    del doc["runs"][0]["p99_ms"]
    doc["runs"][0]["lost"] = "none"
    doc["max_sustainable"]["batched"].pop(threshold_key(50))
    del doc["ratios"]["batched_over_ceiling"]
    problems = validate_results(doc)
    assert "machine: missing 'cores'" in problems
    assert "runs[0]: missing 'p99_ms'" in problems
    assert "runs[0].lost: str" in problems
    assert "max_sustainable.batched: missing p99_under_50ms" in problems
    assert "ratios: missing 'batched_over_ceiling'" in problems


def test_report_and_plots(tmp_path: Path) -> None:
    from bench.plots import plot_all

    runs = [record(v, rate, p99=p99) for v in (CEILING, UNBATCHED, BATCHED) for rate, p99 in ((1000.0, 30.0), (2500.0, 90.0))]
    sweep = run_record(BATCHED, "sweep", 2500.0, summary(2500.0, p99=70.0), worker="s")
    sweep["variant"], sweep["batch_size"] = "sweep-16-10", 16
    doc = results_doc([*runs, sweep])
    text = format_report(doc)
    assert "batched/unbatched 1.0" in text and "ceiling" in text
    names = sorted(p.name for p in plot_all(doc, tmp_path))
    assert names == ["lag.png", "latency_vs_rate.png", "stages.png", "sweep.png"]
    assert all((tmp_path / n).stat().st_size > 10_000 for n in names)


def test_throughput_ratios_use_each_variants_best_achieved_rate() -> None:
    from bench.verdicts import throughput_ratios

    runs = [
        {"variant": "ceiling", "achieved_tps": 900.0}, {"variant": "ceiling", "achieved_tps": 1100.0},
        {"variant": "unbatched", "achieved_tps": 40.0},
        {"variant": "batched", "achieved_tps": 250.0}, {"variant": "sweep-8-5", "achieved_tps": 5000.0},
    ]
    got = throughput_ratios(runs)
    assert got["max_achieved_tps"] == {"batched": 250.0, "ceiling": 1100.0, "unbatched": 40.0}
    assert got["batched_over_unbatched"] == 6.25
    assert got["batched_over_ceiling"] == round(250 / 1100, 3)
    assert throughput_ratios([{"variant": "batched", "achieved_tps": 1.0}])["batched_over_unbatched"] is None


def test_knobs_plot_draws_each_row(tmp_path: Path) -> None:
    """An A/B from ``bench.knobs --label`` becomes a PNG beside its JSON."""
    from bench.plots import knobs_plot

    rows = [
        {"label": label, "knob": "role_score", "offered_tps": 400.0, "cpu_ms_per_tx": cpu, "p99_ms": p99}
        for label, cpu, p99 in (("before", 1.33, 71.5), ("after", 1.16, 67.0), ("broken run", None, None))
    ]
    path = knobs_plot({"machine": "2 cores", "rows": rows}, tmp_path / "ab.png")
    assert path.exists() and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_memory_per_minute_says_which_process_slowed() -> None:
    """Three minutes at 100 decisions/s; the broker's CPU per decision doubles in the last."""
    from bench.memory import per_minute

    timeline, broker = [], 0.0
    for i in range(361):
        t = i * 0.5
        broker += 0.5 * (0.2 if t <= 120 else 0.4)  # CPU seconds per second of load
        timeline.append({"t": t, "decided": int(100 * t), "cpu_s": 0.05 * t, "broker_cpu_s": broker,
                         "loadgen_cpu_s": 0.1 * t, "in_flight": 5, "rss_mb": 300.0})  # fmt: skip
    rows = per_minute(timeline)
    assert [r["minute"] for r in rows] == [1.0, 2.0, 3.0]
    assert all(r["decided_per_s"] == 100.0 and r["worker_cpu_ms_per_decision"] == 0.5 for r in rows)
    assert [r["broker_cpu_ms_per_decision"] for r in rows] == pytest.approx([2.0, 2.0, 4.0], abs=0.05)


def _probe(rate: float, p99: float, achieved: float | None = None) -> dict[str, Any]:
    return {
        "offered_tps": rate, "achieved_tps": rate if achieved is None else achieved, "p99_ms": p99,
        "lost": 0, "degraded": 0, "decided": 1000, "generator_lag_p99_ms": 1.0,
    }  # fmt: skip


def test_one_spike_at_a_low_rate_does_not_decide_the_search() -> None:
    """The failure mode that once reported 50 TPS for a pipeline sustaining 750:
    a single 223 ms p99 at 100 TPS. Repeated on a fresh worker it passed; the
    search then believes the higher passes."""
    spike, repeat = _probe(100.0, 223.0), _probe(100.0, 80.0)
    runs = [spike, _probe(195.0, 120.0), _probe(290.0, 150.0)]
    assert needs_repeat(spike, runs, 200.0)
    runs.append(repeat)
    assert not needs_repeat(repeat, runs, 200.0)  # once is enough
    assert verdicts(runs, 200.0) == {100.0: True, 195.0: True, 290.0: True}
    assert sustainable(runs, 200.0)["tps"] == 290.0
    assert sustainable(runs, 200.0)["repeated"] == [100.0]


def test_a_failure_that_reproduces_or_saturates_stands() -> None:
    runs = [_probe(100.0, 223.0), _probe(100.0, 240.0), _probe(50.0, 90.0)]
    assert sustainable(runs, 200.0)["tps"] == 50.0
    overrun = _probe(1000.0, 900.0, achieved=600.0)  # saturated: no repeat, it cannot pass
    assert not needs_repeat(overrun, [overrun], 200.0)


def test_cpu_per_decision_is_taken_at_the_lowest_passing_rate() -> None:
    runs = [
        {**_probe(500.0, 300.0), "variant": "batched", "cpu_ms_per_decision": {"worker": 9.0}},  # fails
        {**_probe(250.0, 90.0), "variant": "batched", "cpu_ms_per_decision": {"worker": 1.2, "broker": 0.5}},
        {**_probe(1000.0, 40.0), "variant": "ceiling", "cpu_ms_per_decision": {"worker": 0.3}},
    ]
    assert cpu_per_decision_by_variant(runs) == {
        "batched": {"offered_tps": 250.0, "worker": 1.2, "broker": 0.5},
        "ceiling": {"offered_tps": 1000.0, "worker": 0.3},
    }


def test_on_the_secure_stack_each_bench_process_gets_its_roles_credentials(tmp_path: Path) -> None:
    """bench.security's "on" mode: the worker as scoring/worker, the load generator as
    payments, materialize as materialize; the plaintext stack gets no credentials."""
    from bench.workers import Services

    secure = Services("127.0.0.1:1", "redis://127.0.0.1:2/0", secure_dir=tmp_path)
    worker = secure.env()
    assert worker["FRAUD_KAFKA_SASL_USERNAME"] == "scoring" and worker["FRAUD_REDIS_USERNAME"] == "worker"
    assert worker["FRAUD_KAFKA_SASL_PASSWORD_FILE"].startswith(str(tmp_path))
    assert secure.client_env()["FRAUD_KAFKA_SASL_USERNAME"] == "payments"
    assert "FRAUD_REDIS_USERNAME" not in secure.client_env()
    assert secure.role_env(None, "materialize") == {
        "FRAUD_REDIS_USERNAME": "materialize",
        "FRAUD_REDIS_PASSWORD_FILE": str(tmp_path / "redis-users" / "materialize.password"),
    }
    plain = Services("127.0.0.1:1", "redis://127.0.0.1:2/0")
    assert not any(k.startswith(("FRAUD_KAFKA_SASL", "FRAUD_REDIS_USERNAME")) for k in plain.env())
    assert plain.client_env() == {} and plain.admin_options() == {}


def test_cpu_by_rate_has_every_rate_once_and_marks_the_knee() -> None:
    from bench.verdicts import cpu_by_rate

    runs = [record(BATCHED, 500.0, p99=80.0), record(BATCHED, 1000.0, p99=150.0), record(BATCHED, 2000.0, p99=900.0)]
    repeat = record(BATCHED, 1000.0, p99=120.0)
    runs.append(repeat)
    for run in runs:
        run["cpu_ms_per_decision"] = {"worker": 0.5, "broker": 0.3}
    rows = cpu_by_rate(runs)["batched"]
    assert [r["offered_tps"] for r in rows] == [500.0, 1000.0, 2000.0]  # the first run of each rate
    assert [r["passes"] for r in rows] == [True, True, False]
    assert [r["knee"] for r in rows] == [False, True, False]  # the highest passing rate
    assert rows[0]["worker"] == 0.5 and rows[0]["broker"] == 0.3


def test_the_report_quotes_the_run_that_held_a_knee_reached_on_a_repeat() -> None:
    from bench import figures

    def run(p99: float, lost: int = 0) -> dict[str, Any]:
        return {"variant": "batched", "offered_tps": 4000.0, "p50_ms": p99 / 2, "p99_ms": p99, "lost": lost,
                "degraded": 0, "decided": 1000}  # fmt: skip

    doc = {"runs": [run(224.0), run(150.0, lost=3), run(128.0)]}
    held = figures._held_run(doc, "batched", 4000.0)
    assert held is not None and held["p99_ms"] == 128.0  # not the slow first run, nor the one that lost records
    only = figures._held_run({"runs": [run(224.0)]}, "batched", 4000.0)
    assert only is not None and only["p99_ms"] == 224.0  # none held: the first, as before


def test_the_summary_names_the_machines_speed_over_the_run_when_recorded() -> None:
    # The machine's speed moves by up to 2x in a day: a run's figures are read beside it.
    from bench import figures

    timed = {"machine": {"cores": 2, "cpu_model": "AMD EPYC", "python_loop_ms_at_start": 69.6,
                         "python_loop_ms_at_end": 88.2}}  # fmt: skip
    assert figures._speed(timed) == (
        " A fixed pure-Python loop took 70 ms at the run's start, 88 ms at its end: compare runs by it."
    )
    assert figures._speed({"machine": {"cores": 2, "cpu_model": "AMD EPYC"}}) == ""  # an older run's



def test_a_rate_goal_is_met_only_when_both_load_shapes_reach_it() -> None:
    from bench.figures import _goal_rate

    def doc(**knees: float) -> dict[str, Any]:
        return {"max_sustainable": {
            v: {"p99_under_200ms": {"bracket": [k, k * 1.5], "lower_bound": False}} for v, k in knees.items()
        }}  # fmt: skip

    goal = _goal_rate(5000.0, workers=2)
    # Two workers reach it inside; the outside shape (one worker) does not: not met.
    text, met = goal(doc(batched=4800.0, **{"batched-x2": 5300.0}, outside=4000.0))
    assert met is False and "`batched-x2` 5,300" in text and "outside: `outside` 4,000" in text
    assert goal(doc(batched=4800.0, **{"batched-x2": 5300.0}, outside=5100.0))[1] is True
    assert goal(doc(batched=4800.0, **{"batched-x2": 5300.0}, outside=4000.0, **{"outside-x2": 5200.0}))[1] is True
    assert goal(doc(batched=5200.0))[1] is False  # the outside shape not measured is not a pass
    assert goal(doc()) == ("not measured", None)
    # One worker each: two workers' knees do not count.
    one = _goal_rate(2000.0, workers=1)
    assert one(doc(batched=1500.0, **{"batched-x2": 3000.0}, outside=2500.0))[1] is False
    assert one(doc(batched=2500.0, outside=2100.0, **{"outside-x2": 1000.0})) == (
        "inside: `batched` 2,500; outside: `outside` 2,100", True
    )
