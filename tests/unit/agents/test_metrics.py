"""Worker metrics from real scorer batches (in-memory fakes), parsed as Prometheus text."""

from __future__ import annotations

import asyncio
import math
import time
from typing import Any

import orjson
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from agents.metrics import WorkerMetrics, consumer_lag, reason_label
from app.settings import Settings
from pipeline.admission import Admission
from pipeline.auth import InMemoryReplayGuard
from pipeline.cache import InMemoryDecisionCache
from pipeline.feature_store import InMemoryFeatureStore
from pipeline.ratelimit import InMemoryRateLimiter
from pipeline.scorer import Inbound, Scorer
from tests.factories import ConstantModel, rules, tx_doc

RULES = rules("rules-metrics-1")
VERSION = "const-metrics-1"


def _tx(i: int, now: float) -> dict[str, Any]:
    return tx_doc(i, now, transaction_id=f"t-metrics-{i:04d}")


def _inbound(doc: dict[str, Any] | bytes, offset: int, sent: float) -> Inbound:
    value = doc if isinstance(doc, bytes) else orjson.dumps(doc)
    return Inbound(value=value, timestamp=sent, partition=0, offset=offset)


def _samples(metrics: WorkerMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = generate_latest(metrics.registry).decode()
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _run_batch(scorer: Scorer, metrics: WorkerMetrics, batch: list[Inbound]) -> None:
    async def go() -> None:
        started = time.perf_counter()
        output = await scorer.score_batch(batch)
        await scorer.cache.put_many(output.to_cache)
        metrics.observe_batch(batch, output, started)

    asyncio.run(go())


def test_counters_follow_batches() -> None:
    """Decisions by action, cache hits, dead letters by reason, rate limits, stages,
    batch fill and end-to-end latency move with the batches that were scored."""
    metrics = WorkerMetrics(Settings(batch_size=8))
    admission = Admission(
        keys={}, allow_unsigned=True, replay=InMemoryReplayGuard(),
        limiter=InMemoryRateLimiter(1000, 1000, 1, 2),  # 2 per user, then rate limited
    )  # fmt: skip
    scorer = Scorer(
        model=ConstantModel(0.95, version=VERSION), rules=RULES, store=InMemoryFeatureStore(),
        cache=InMemoryDecisionCache(), admission=admission, round_trips=metrics,
    )  # fmt: skip
    now = time.time()
    first = [_tx(i, now) for i in range(4)]  # four users, one each: all declined (score 0.95)
    batch = [_inbound(d, i, now - 0.25) for i, d in enumerate(first)]
    batch.append(_inbound(b"{not json", 99, now - 0.25))  # dead letter, no decision
    _run_batch(scorer, metrics, batch)
    # Second batch: two resends (cache hits), three new for a fourth user (its third is rate limited).
    again = [_inbound(first[0], 10, now), _inbound(first[1], 11, now)]
    same_user = [_inbound(_tx(104 + 7 * k, now), 12 + k, now) for k in range(3)]
    _run_batch(scorer, metrics, again + same_user)

    s = _samples(metrics)
    assert s[("fraud_messages_total", ())] == 10
    assert s[("fraud_decisions_total", (("action", "decline"), ("cached", "false")))] == 4 + 2
    assert s[("fraud_decisions_total", (("action", "decline"), ("cached", "true")))] == 2
    assert s[("fraud_decisions_total", (("action", "reject"), ("cached", "false")))] == 1
    assert s[("fraud_cache_hits_total", ())] == 2
    assert s[("fraud_rate_limited_total", ())] == 1
    assert s[("fraud_dead_letters_total", (("reason", "bad_json"),))] == 1
    assert s[("fraud_dead_letters_total", (("reason", "rate_limited"),))] == 1
    assert s[("fraud_batch_size_count", ())] == 2
    assert s[("fraud_batch_size_sum", ())] == 10
    # A batch of 5 of 8 fills 0.625 (<= 0.75); a batch of 5 again: both in the 0.75 bucket, neither in 0.5.
    assert s[("fraud_batch_fill_ratio_bucket", (("le", "0.5"),))] == 0
    assert s[("fraud_batch_fill_ratio_bucket", (("le", "0.75"),))] == 2
    for stage in ("validate", "cache", "features", "model", "rules"):
        assert s[("fraud_stage_seconds_count", (("stage", stage),))] == 2, stage
    # End to end per message, from its record timestamp: the first batch's were sent 0.25 s before.
    assert s[("fraud_end_to_end_seconds_count", ())] == 10
    assert s[("fraud_end_to_end_seconds_bucket", (("le", "0.2"),))] <= 5
    # Redis round trips (here the fakes), one per batch per operation.
    assert s[("fraud_redis_round_trip_seconds_count", (("op", "enrich"),))] == 2
    assert s[("fraud_redis_round_trip_seconds_count", (("op", "cache_get"),))] == 2
    assert s[("fraud_redis_round_trip_seconds_count", (("op", "rate_limit"),))] == 2
    assert s[("fraud_model_info", (("model_version", VERSION), ("rules_version", "rules-metrics-1")))] == 1
    assert s[("fraud_worker_throughput_tps", ())] > 0
    assert s[("fraud_worker_capacity_tps", ())] > s[("fraud_worker_throughput_tps", ())]


def test_degraded_by_reason_and_redis_errors() -> None:
    """A model past its budget degrades the batch: counted with the reason, without the number."""
    metrics = WorkerMetrics(Settings())
    store = InMemoryFeatureStore()
    scorer = Scorer(
        model=ConstantModel(0.1, sleep_s=0.2, version=VERSION), rules=RULES, store=store,
        cache=InMemoryDecisionCache(), model_budget_s=0.01, round_trips=metrics,
    )  # fmt: skip
    now = time.time()
    _run_batch(scorer, metrics, [_inbound(_tx(i, now), i, now) for i in range(3)])
    store.fail = RuntimeError("down")
    _run_batch(scorer, metrics, [_inbound(_tx(10 + i, now), 10 + i, now) for i in range(2)])
    s = _samples(metrics)
    assert s[("fraud_degraded_decisions_total", (("reason", "model over budget"),))] == 3
    assert s[("fraud_degraded_decisions_total", (("reason", "feature store unavailable"),))] == 2
    assert s[("fraud_redis_errors_total", (("op", "enrich"),))] == 1


def test_degraded_reason_label() -> None:
    assert reason_label("model over its 50 ms budget") == "model over budget"
    assert reason_label("model over its 12.5 ms budget") == "model over budget"  # one label, any budget
    assert reason_label("model failed: ValueError") == "model failed: ValueError"
    assert reason_label("") == "unknown"


def test_consumer_lag_from_highwater_and_committed() -> None:
    assert consumer_lag(120, 100) == 20
    assert consumer_lag(120, None) == 120  # never committed: from offset 0
    assert consumer_lag(None, 5) is None  # no fetch response yet: unknown, not 0
    assert consumer_lag(100, 100) == 0


def test_throughput_window() -> None:
    metrics = WorkerMetrics(Settings())
    assert math.isnan(metrics.throughput()[2])  # no traffic: capacity unknown
    t0 = time.monotonic()
    metrics._window.extend([(t0 - 40, 1000, 1.0), (t0 - 5, 300, 0.5), (t0 - 1, 300, 0.5)])
    tps, busy, capacity = metrics.throughput(t0)
    assert tps == 600 / 30 and busy == 1.0 / 30 and capacity == 600.0  # the 40 s old batch is out


def test_the_throughput_window_stays_bounded_when_nobody_scrapes() -> None:
    """A worker without a Prometheus scraping it must not keep every batch ever seen."""
    from pipeline.scorer import BatchOutput, Inbound

    metrics = WorkerMetrics(Settings())
    old = time.monotonic() - 3600
    metrics._window.extend([(old, 32, 0.01)] * 1000)
    metrics.observe_batch([Inbound(value=b"{}")], BatchOutput(), time.perf_counter())
    assert len(metrics._window) == 1


def test_a_scrape_carries_what_scale_advise_needs() -> None:
    from tools.autoscale import parse_scrape

    metrics = WorkerMetrics(Settings())
    w = parse_scrape("w", generate_latest(metrics.registry).decode())
    assert w.cpu_seconds > 0 and w.batches == 0.0 and w.fill_sum == 0.0


def test_garbage_collections_are_timed_by_generation() -> None:
    """A full collection stops the scoring loop: ``fraud_gc_pause_seconds`` shows each one."""
    import gc

    metrics = WorkerMetrics(Settings())
    metrics.watch_gc()
    try:
        gc.collect()
        gc.collect(0)
    finally:
        gc.callbacks.pop()
    count = metrics.registry.get_sample_value
    assert (count("fraud_gc_pause_seconds_count", {"generation": "2"}) or 0) >= 1
    assert (count("fraud_gc_pause_seconds_count", {"generation": "0"}) or 0) >= 1
