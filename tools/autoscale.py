"""How many workers the load needs: from consumer lag and measured throughput.

Scaling follows queue depth, not CPU: a worker that waits on Redis or the
broker looks idle to a CPU autoscaler while its partitions fall behind.

:func:`advise` is the arithmetic (pure). The workers needed are those whose
combined capacity, kept under ``target_utilization``, covers the arrival rate
plus draining the current lag within ``drain_s``:

    needed TPS  = arrival TPS + lag / drain_s
    per worker  = measured capacity x target utilisation
    workers     = ceil(needed / per worker), at least 1, at most the partition count

The measured capacity is messages per busy second, scaled to full batches
when the batches were part-empty and bounded by the CPU seconds per message
(:func:`_at_full_batches` says why).

A worker beyond the partition count would own no partition and do nothing, so
past that cap the answer is "more partitions", which the advice says.

:func:`measure` takes two scrapes of the workers' ``/metrics`` ``interval_s``
apart: throughput and busy time from the counters' increase, lag from the
per-partition gauges (fetch highwater minus committed offset), and the arrival
rate as throughput plus the lag's growth. :func:`measure_broker` reads the same
lag from the broker (end offsets, the group's committed offsets) when the
workers cannot be reached; it sees no per-worker capacity.
"""

from __future__ import annotations

import asyncio
import math
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from app.errors import ConfigError

__all__ = [
    "Advice",
    "Measurement",
    "PartitionOffsets",
    "WorkerScrape",
    "advise",
    "broker_offsets",
    "combine",
    "combine_broker",
    "measure",
    "measure_broker",
    "parse_scrape",
]


@dataclass(frozen=True)
class Advice:
    workers: int
    """Recommended worker count."""
    needed_tps: float
    per_worker_tps: float
    capped: bool
    """The load needs more workers than there are partitions."""
    reasons: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def advise(
    *,
    lag: float,
    arrival_tps: float,
    capacity_per_worker_tps: float | None,
    partitions: int,
    current_workers: int,
    drain_s: float = 60.0,
    target_utilization: float = 0.7,
) -> Advice:
    """The worker count for this load (see the module docstring for the formula)."""
    if partitions < 1:
        raise ConfigError(f"partitions must be >= 1, got {partitions}")
    if not 0 < target_utilization <= 1:
        raise ConfigError(f"target utilisation must be in (0, 1], got {target_utilization}")
    if not drain_s > 0:
        raise ConfigError(f"drain time must be > 0 s, got {drain_s}")
    lag = max(0.0, lag)
    arrival_tps = max(0.0, arrival_tps)
    needed = arrival_tps + lag / drain_s
    reasons = [
        f"arrival {arrival_tps:.1f} TPS + lag {lag:.0f} / {drain_s:.0f} s drain = {needed:.1f} TPS needed"
    ]
    if capacity_per_worker_tps is None or not capacity_per_worker_tps > 0 or math.isnan(capacity_per_worker_tps):
        keep = min(max(1, current_workers), partitions)
        reasons.append(
            f"no measured per-worker capacity yet (no traffic in the window): keep {keep} "
            "(give --capacity-tps from `make bench` to decide without traffic)"
        )
        return Advice(keep, round(needed, 3), 0.0, False, reasons)
    per_worker = capacity_per_worker_tps * target_utilization
    raw = max(1, math.ceil(needed / per_worker - 1e-9))
    reasons.append(
        f"each worker sustains {capacity_per_worker_tps:.1f} TPS when busy; at {target_utilization:.0%} "
        f"utilisation {per_worker:.1f} TPS: ceil({needed:.1f} / {per_worker:.1f}) = {raw}"
    )
    workers = min(raw, partitions)
    capped = raw > partitions
    if capped:
        reasons.append(
            f"capped at {partitions} (one worker per partition at most): {partitions} workers give "
            f"{partitions * per_worker:.1f} TPS; add partitions to `transactions` to go further"
        )
    change = workers - current_workers
    if current_workers > 0:
        verb = "scale up" if change > 0 else ("scale down" if change < 0 else "keep")
        reasons.append(f"{verb}: {current_workers} -> {workers} workers")
    return Advice(workers, round(needed, 3), round(per_worker, 3), capped, reasons)


# --- measuring from the workers' /metrics ------------------------------------------


@dataclass(frozen=True)
class WorkerScrape:
    """The numbers the advice needs from one worker's ``/metrics``."""

    url: str
    messages: float
    busy_seconds: float
    capacity_tps: float
    lag: dict[tuple[str, str], float]
    """(topic, partition) -> lag, for the partitions this worker holds."""
    cpu_seconds: float = math.nan
    """The worker process's CPU time (``process_cpu_seconds_total``)."""
    fill_sum: float = math.nan
    """Sum of the batches' fill ratios (size over ``FRAUD_BATCH_SIZE``) ..."""
    batches: float = math.nan
    """... over this many batches (the ``fraud_batch_fill_ratio`` histogram)."""


def parse_scrape(url: str, text: str) -> WorkerScrape:
    values: dict[str, float] = {}
    lag: dict[tuple[str, str], float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == "fraud_consumer_lag":
                lag[(s.labels["topic"], s.labels["partition"])] = s.value
            elif s.name in _SCRAPED:
                values[s.name] = s.value
    if "fraud_messages_total" not in values:
        raise ConfigError(f"{url} serves no fraud_messages_total: is it a fraud-pipeline worker's /metrics?")
    return WorkerScrape(
        url,
        values["fraud_messages_total"],
        values.get("fraud_busy_seconds_total", 0.0),
        values.get("fraud_worker_capacity_tps", math.nan),
        lag,
        values.get("process_cpu_seconds_total", math.nan),
        values.get("fraud_batch_fill_ratio_sum", math.nan),
        values.get("fraud_batch_fill_ratio_count", math.nan),
    )


_SCRAPED = (
    "fraud_messages_total", "fraud_busy_seconds_total", "fraud_worker_capacity_tps", "process_cpu_seconds_total",
    "fraud_batch_fill_ratio_sum", "fraud_batch_fill_ratio_count",
)  # fmt: skip
#: Batches at least this full on average: the worker is saturated, and messages
#: per busy second is its capacity as measured.
FULL_BATCHES = 0.9


def _metrics_url(url: str) -> str:
    url = url.rstrip("/")
    if "://" not in url:
        url = f"http://{url}"
    return url if url.endswith("/metrics") else f"{url}/metrics"


def scrape(url: str, timeout_s: float = 5.0) -> WorkerScrape:
    full = _metrics_url(url)
    try:
        with urllib.request.urlopen(full, timeout=timeout_s) as reply:
            return parse_scrape(full, reply.read().decode())
    except OSError as exc:
        raise ConfigError(f"cannot scrape {full}: {exc}") from None


@dataclass(frozen=True)
class Measurement:
    workers: int
    partitions_seen: int
    lag: float
    processed_tps: float
    arrival_tps: float
    capacity_per_worker_tps: float | None
    interval_s: float
    reasons: list[str] = field(default_factory=list)


def combine(first: Sequence[WorkerScrape], second: Sequence[WorkerScrape], interval_s: float) -> Measurement:
    """Rates from two scrapes of the same workers ``interval_s`` apart (pure)."""
    by_url = {w.url: w for w in first}
    processed = busy = cpu = fill = batches = 0.0
    for w in second:
        before = by_url.get(w.url)
        if before is not None and w.messages >= before.messages:  # a restarted worker's counters reset
            processed += w.messages - before.messages
            busy += w.busy_seconds - before.busy_seconds
            cpu += w.cpu_seconds - before.cpu_seconds  # NaN when a worker does not export it
            fill += w.fill_sum - before.fill_sum
            batches += w.batches - before.batches
    lag_before = _total_lag(first)
    lag_now = _total_lag(second)
    processed_tps = processed / interval_s
    growth = (lag_now - lag_before) / interval_s
    workers = f"{len(second)} worker{'' if len(second) == 1 else 's'}"
    reasons = [f"{workers} processed {processed_tps:.1f} TPS; lag went {lag_before:.0f} -> {lag_now:.0f}"]
    if busy > 0:
        capacity: float | None = processed / busy
        reasons.append(f"{processed:.0f} messages in {busy:.2f} busy seconds: {capacity:.1f} TPS per busy worker")
        capacity = _at_full_batches(processed / busy, processed, cpu, fill, batches, reasons)
    else:
        gauges = [w.capacity_tps for w in second if not math.isnan(w.capacity_tps)]
        capacity = sum(gauges) / len(gauges) if gauges else None
        if capacity is not None:
            reasons.append(f"idle in the interval: capacity from the workers' 30 s gauge, {capacity:.1f} TPS")
    parts = {p for w in second for p in w.lag}
    return Measurement(
        len(second), len(parts), lag_now, processed_tps, max(0.0, processed_tps + growth), capacity, interval_s, reasons
    )


def _at_full_batches(
    per_busy_s: float, processed: float, cpu: float, fill: float, batches: float, reasons: list[str]
) -> float:
    """Capacity from messages per busy second, corrected for part-empty batches.

    NOTE: a batch's busy time is mostly a fixed cost (a Kafka transaction per
    input partition, a Redis round trip, waiting on the broker) paid however
    few messages it holds. Below saturation batches hold one or two messages, so
    messages per busy second understates what the worker does when loaded and
    its batches fill: 30 TPS on a worker using 19 % of a core measured 37 TPS.
    At full batches the same busy time would carry up to ``1 / fill`` times the
    messages; the CPU seconds per message measured now (the per-batch CPU
    included, so conservative) bound that to one core's worth, since a worker
    is one Python process. Unknown fill or CPU: messages per busy second as is.
    """
    if not (batches > 0 and processed > 0 and cpu > 0) or math.isnan(fill + cpu):
        return per_busy_s
    mean_fill = fill / batches
    if not 0 < mean_fill < FULL_BATCHES:
        return per_busy_s
    per_cpu_s = processed / cpu
    capacity = max(per_busy_s, min(per_busy_s / mean_fill, per_cpu_s))
    reasons.append(
        f"batches {mean_fill:.0%} full: busy time is mostly the fixed cost per batch; at full batches "
        f"up to {per_busy_s / mean_fill:.0f} TPS, and {cpu:.2f} CPU s for {processed:.0f} messages "
        f"({per_cpu_s:.0f} per CPU second) bound it: {capacity:.1f} TPS per worker"
    )
    return capacity


def _total_lag(scrapes: Sequence[WorkerScrape]) -> float:
    # NOTE: during a rebalance two workers may both report a partition: count it once.
    merged: dict[tuple[str, str], float] = {}
    for w in scrapes:
        for part, value in w.lag.items():
            merged[part] = max(value, merged.get(part, 0.0))
    return sum(merged.values())


async def measure(urls: Sequence[str], interval_s: float) -> Measurement:
    if not urls:
        raise ConfigError("no workers to measure: give --worker URL (one per worker)")
    first = await asyncio.gather(*(asyncio.to_thread(scrape, u) for u in urls))
    start = time.monotonic()
    await asyncio.sleep(interval_s)
    second = await asyncio.gather(*(asyncio.to_thread(scrape, u) for u in urls))
    return combine(first, second, time.monotonic() - start)


# --- measuring from the broker ------------------------------------------------------


@dataclass(frozen=True)
class PartitionOffsets:
    """One partition of ``transactions`` as the broker sees the consumer group."""

    highwater: int
    committed: int | None

    @property
    def lag(self) -> int:
        return max(0, self.highwater - (self.committed or 0))


async def broker_offsets(settings: Any, timeout_s: float = 10.0) -> dict[int, PartitionOffsets]:
    """Highwater and the scoring group's committed offset for every partition of ``transactions``.

    The highwater is the partition's end offset (ListOffsets, read_uncommitted:
    the high watermark a fetch would report), the committed offsets come from
    the group coordinator (OffsetFetch). Neither reads a record, so the caller
    needs only Describe on the topic and the group (the ``operator`` role of
    ``tools/kafka_acls.py``); the consumer never joins the group, so the
    workers are not rebalanced.
    """
    from aiokafka import AIOKafkaConsumer, TopicPartition

    from agents.wiring import scoring_group
    from app.topics import kafka_auth, partitions_of

    topic = settings.topic_transactions
    consumer = AIOKafkaConsumer(
        bootstrap_servers=settings.kafka_bootstrap, group_id=scoring_group(settings), enable_auto_commit=False,
        request_timeout_ms=int(timeout_s * 1000), **kafka_auth(settings),
    )  # fmt: skip
    await consumer.start()
    try:
        partitions = (await partitions_of(consumer, [topic]))[topic]
        if not partitions:
            raise ConfigError(f"topic {topic!r} does not exist on {settings.kafka_bootstrap}")
        tps = [TopicPartition(topic, p) for p in sorted(partitions)]
        consumer.assign(tps)
        async with asyncio.timeout(timeout_s):
            committed = {tp: await consumer.committed(tp) for tp in tps}
            ends = await consumer.end_offsets(tps)
        return {tp.partition: PartitionOffsets(ends[tp], committed[tp]) for tp in tps}
    finally:
        await consumer.stop()


def combine_broker(
    first: dict[int, PartitionOffsets], second: dict[int, PartitionOffsets], interval_s: float, workers: int
) -> Measurement:
    """Rates from two broker samples (pure). Arrival is the highwaters' growth,
    throughput the committed offsets' growth; per-worker capacity is not
    visible from the broker (give --capacity-tps, or scrape the workers)."""
    arrived = sum(second[p].highwater - first[p].highwater for p in second if p in first)
    committed = sum((second[p].committed or 0) - (first[p].committed or 0) for p in second if p in first)
    lag = float(sum(o.lag for o in second.values()))
    reasons = [
        f"broker: {len(second)} partitions, lag {lag:.0f}; {arrived / interval_s:.1f} TPS arrived and "
        f"{committed / interval_s:.1f} TPS committed over {interval_s:.1f} s"
    ]
    return Measurement(
        workers, len(second), lag, committed / interval_s, arrived / interval_s, None, interval_s, reasons
    )


async def measure_broker(settings: Any, interval_s: float, workers: int) -> Measurement:
    first = await broker_offsets(settings)
    start = time.monotonic()
    await asyncio.sleep(interval_s)
    second = await broker_offsets(settings)
    return combine_broker(first, second, time.monotonic() - start, workers)
