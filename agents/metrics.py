"""Prometheus metrics of a worker, served at ``/metrics`` on its web server.

One :class:`WorkerMetrics` per faust app, with its own registry (two apps in
one process, as in tests, never share a metric). It holds:

- what the scoring agent observes after each batch (:meth:`observe_batch`),
  read from the :class:`~pipeline.scorer.BatchOutput` the scorer already returns:
  the batch's monitoring record (stage timings, counts, degraded reason, model
  version), its outcomes by (action, cached), and its dead letters' reasons;
- Redis round trips, as the scorer reports them (:meth:`observe_round_trip`:
  the worker builds its scorer with these metrics as its
  :class:`~pipeline.timing.RoundTrips` observer);
- values computed when scraped (:class:`_ScrapeTimeCollector`): consumer lag
  per partition from the consumer's fetch highwater minus the committed
  offset, and the worker's measured throughput and capacity, the autoscaling
  signal (``fraud-pipeline scale advise`` reads them).

NOTE: faust's own Prometheus sensor (``faust_*`` metrics: send latency,
rebalances, the other topics' messages) is served alongside only with
``FRAUD_FAUST_SENSORS=true``; it is off by default (it runs per message on the
event loop). It does not see ``transactions``, which the scoring loop consumes
through librdkafka and commits in its own Kafka transactions (:mod:`app.eos`):
batches and stages are timed here. Lag is computed here from the scoring
consumer's fetch highwaters and the offsets its transactions committed
(``WorkerMetrics.offsets``, set by agents/score.py).
"""

from __future__ import annotations

import gc
import logging
import math
import re
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import orjson
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    import faust

    from app.settings import Settings
    from pipeline.scorer import BatchOutput, Inbound

__all__ = ["THROUGHPUT_WINDOW_S", "WorkerMetrics", "consumer_lag", "reason_label"]

log = logging.getLogger(__name__)

#: Milliseconds-scale stages, in seconds (Prometheus convention).
STAGE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.035, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0)
#: Record timestamp to outcome: includes queueing, so a longer tail.
E2E_BUCKETS = (0.005, 0.01, 0.02, 0.035, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
REDIS_BUCKETS = (0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5)
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 128, 256, 512)
FILL_BUCKETS = (0.05, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0)
#: Stages of the scorer's monitoring record (``stage_ms``), in flow order.
STAGES = ("validate", "cache", "features", "model", "rules")
#: Throughput and capacity are measured over this trailing window.
THROUGHPUT_WINDOW_S = 30.0


class WorkerMetrics:
    """The metrics of one worker app, and the hooks that feed them."""

    def __init__(self, settings: Settings, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self.batch_capacity = settings.batch_size
        self.topic = settings.topic_transactions
        r = self.registry
        self.stage_seconds = Histogram(
            "fraud_stage_seconds", "Time a batch spent in each scoring stage", ["stage"],
            buckets=STAGE_BUCKETS, registry=r,
        )  # fmt: skip
        self.batch_seconds = Histogram(
            "fraud_batch_seconds", "A batch from taken to its outcomes delivered to the broker",
            buckets=STAGE_BUCKETS, registry=r,
        )  # fmt: skip
        self.end_to_end_seconds = Histogram(
            "fraud_end_to_end_seconds",
            "Per transaction: record timestamp (producer send time) to its outcome delivered to the broker",
            buckets=E2E_BUCKETS, registry=r,
        )  # fmt: skip
        self.batch_size = Histogram(
            "fraud_batch_size", "Messages per micro-batch", buckets=BATCH_SIZE_BUCKETS, registry=r
        )
        self.batch_fill = Histogram(
            "fraud_batch_fill_ratio", "Batch size over FRAUD_BATCH_SIZE (1 = full batch)",
            buckets=FILL_BUCKETS, registry=r,
        )  # fmt: skip
        self.messages = Counter("fraud_messages", "Messages taken from the transactions topic", registry=r)
        self.busy_seconds = Counter(
            "fraud_busy_seconds", "Seconds spent processing batches (for utilisation and capacity)", registry=r
        )
        self.decisions = Counter(
            "fraud_decisions", "Decisions produced, by action; cached=true for resends answered from the cache",
            ["action", "cached"], registry=r,
        )  # fmt: skip
        self.cache_hits = Counter("fraud_cache_hits", "Decisions answered from the decision cache", registry=r)
        self.degraded = Counter(
            "fraud_degraded_decisions", "Decisions made by rules alone, by reason", ["reason"], registry=r
        )
        self.dead_letters = Counter(
            "fraud_dead_letters", "Records written to the dead-letter topic, by error code", ["reason"], registry=r
        )
        self.rate_limited = Counter(
            "fraud_rate_limited", "Transactions rejected as over a client's or user's rate limit", registry=r
        )
        self.admission_unavailable = Counter(
            "fraud_admission_unavailable",
            "Batches admitted without a check because Redis could not answer it (fail open)", ["check"], registry=r,
        )  # fmt: skip
        self.redis_seconds = Histogram(
            "fraud_redis_round_trip_seconds", "One Redis round trip (a pipeline, MGET or script call), by operation",
            ["op"], buckets=REDIS_BUCKETS, registry=r,
        )  # fmt: skip
        self.redis_errors = Counter(
            "fraud_redis_errors", "Redis round trips that raised, by operation", ["op"], registry=r
        )
        self.transactions = Counter(
            "fraud_kafka_transactions",
            "Kafka transactions of the scoring loop (each spans the batches of FRAUD_COMMIT_INTERVAL_S), by result: "
            "'committed', 'aborted' (nothing visible; its records are taken again), "
            "'fenced' (the group moved on: the partitions' new owner decides the records)",
            ["result"], registry=r,
        )  # fmt: skip
        self.commit_seconds = Histogram(
            "fraud_kafka_commit_seconds",
            "One commit of the scoring loop's transaction (offsets with the group's metadata, then EndTxn)",
            buckets=REDIS_BUCKETS,
            registry=r,
        )
        self.loop_seconds = Histogram(
            "fraud_loop_seconds",
            "The scoring loop's time per step, by phase: take (waiting for records included), score (a batch "
            "scored, its records built and signed), send (produced into the open transaction), commit",
            ["phase"], buckets=REDIS_BUCKETS, registry=r,
        )  # fmt: skip
        self.index_restore_seconds = Histogram(
            "fraud_index_restore_seconds",
            "Restoring the resend index of newly assigned partitions from its changelog (app/changelog.py): "
            "their records wait for it",
            buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120), registry=r,
        )  # fmt: skip
        self.gc_pause_seconds = Histogram(
            "fraud_gc_pause_seconds", "Garbage collections of the worker process (the loop stops meanwhile)",
            ["generation"], buckets=REDIS_BUCKETS, registry=r,
        )  # fmt: skip
        self.model_info = Gauge(
            "fraud_model_info", "The model and rules versions deciding now (value 1)",
            ["model_version", "rules_version"], registry=r,
        )  # fmt: skip
        self._versions: tuple[str, str] | None = None
        #: Each operation's histogram and error counter, looked up once (``labels`` takes a lock).
        self._round_trips: dict[str, tuple[Histogram, Counter]] = {}
        self._window: deque[tuple[float, int, float]] = deque()  # (monotonic end, messages, busy s)
        #: (topic, partition, highwater, committed) per assigned partition of the
        #: scoring consumer (app/eos.py); None in a worker that does not score.
        self.offsets: Callable[[], list[tuple[str, int, int | None, int | None]]] | None = None
        self.registry.register(_ScrapeTimeCollector(self))
        # process_cpu_seconds_total: `scale advise` bounds a worker's capacity by its CPU per message.
        ProcessCollector(registry=self.registry)

    def watch_gc(self) -> None:
        """Time every garbage collection of this process (``fraud_gc_pause_seconds``).

        NOTE: a full collection stops the scoring loop for as long as it walks
        the heap; that is how a p99 tail of 60-180 ms was found
        (docs/performance.md). Once per process: the callback stays installed.
        """
        started = [0.0]
        pauses = {g: self.gc_pause_seconds.labels(str(g)) for g in range(3)}

        def timed(phase: str, info: dict[str, int]) -> None:
            if phase == "start":
                started[0] = time.perf_counter()
            else:
                pauses[info["generation"]].observe(time.perf_counter() - started[0])

        gc.callbacks.append(timed)

    # --- wiring -------------------------------------------------------------------

    @classmethod
    def install(cls, app: faust.App, settings: Settings, *, faust_sensors: bool = False) -> WorkerMetrics:
        """Create the app's metrics and serve them at ``/metrics`` (with faust's sensor when ``faust_sensors``)."""
        import prometheus_client
        from faust.sensors.prometheus import setup_prometheus_sensors

        # A `_created` series per counter doubles the scrape for nothing Prometheus uses.
        # (Typed here: prometheus_client leaves this function unannotated.)
        disable_created_metrics: Callable[[], None] = prometheus_client.disable_created_metrics
        disable_created_metrics()
        metrics = cls(settings)
        if faust_sensors:
            setup_prometheus_sensors(app, pattern="/metrics", registry=metrics.registry, name_prefix="faust")
        else:
            _serve(app, metrics.registry)
        return metrics

    def set_versions(self, model_version: str | None, rules_version: str | None) -> None:
        versions = (model_version or "none", rules_version or "none")
        if versions != self._versions:
            self.model_info.clear()
            self.model_info.labels(*versions).set(1)
            self._versions = versions

    def observe_round_trip(self, op: str, seconds: float, failed: bool) -> None:
        """One Redis round trip of the scorer's (``batch_lookup``, ``cache_get``,
        ``replay_guard``, ``rate_limit``, ``enrich``) or of the loop's
        (``cache_put``): the :class:`~pipeline.timing.RoundTrips` observer."""
        metrics = self._round_trips.get(op)
        if metrics is None:
            metrics = self._round_trips[op] = (self.redis_seconds.labels(op), self.redis_errors.labels(op))
        histogram, errors = metrics
        histogram.observe(seconds)
        if failed:
            errors.inc()

    # --- per batch ----------------------------------------------------------------

    def observe_batch(self, batch: Sequence[Inbound], output: BatchOutput, started: float) -> None:
        """After a batch's outcomes were delivered. ``started``: ``time.perf_counter()``
        when the batch was taken. Never raises: metrics must not cost a batch."""
        try:
            self._observe(batch, output, started)
        except Exception:
            log.exception("recording a batch's metrics failed")

    def _observe(self, batch: Sequence[Inbound], output: BatchOutput, started: float) -> None:
        busy = time.perf_counter() - started
        now_wall = time.time()
        n = len(batch)
        self.messages.inc(n)
        self.busy_seconds.inc(busy)
        now = time.monotonic()
        self._window.append((now, n, busy))
        self._trim(now)  # NOTE: here too, not only at scrape time: unscraped, it grew without bound
        self.batch_seconds.observe(busy)
        self.batch_size.observe(n)
        self.batch_fill.observe(min(1.0, n / self.batch_capacity) if self.batch_capacity else 1.0)
        for msg in batch:
            if msg.timestamp:
                self.end_to_end_seconds.observe(max(0.0, now_wall - msg.timestamp))
        record = output.monitoring or {}
        for stage, ms in (record.get("stage_ms") or {}).items():
            self.stage_seconds.labels(stage).observe(ms / 1000.0)
        counts = record.get("counts") or {}
        for name, count in counts.items():
            if name.endswith("_unavailable") and count:
                self.admission_unavailable.labels(name.removesuffix("_unavailable")).inc(count)
        if counts.get("degraded"):
            self.degraded.labels(reason_label(record.get("degraded_reason") or "")).inc(counts["degraded"])
        if counts.get("rejected_rate_limited"):
            self.rate_limited.inc(counts["rejected_rate_limited"])
        if record:
            self.set_versions(record.get("model_version"), record.get("rules_version"))
        for (action, cached), count in output.outcomes.items():
            self.decisions.labels(action, "true" if cached else "false").inc(count)
        if cached_count := sum(c for (_, cached), c in output.outcomes.items() if cached):
            self.cache_hits.inc(cached_count)
        for _, value in output.dead_letters:  # rare: parsed in full
            code = (orjson.loads(value).get("error") or {}).get("code") or "unknown"
            self.dead_letters.labels(code).inc()

    # --- at scrape time -------------------------------------------------------------

    def _trim(self, now: float) -> None:
        while self._window and self._window[0][0] < now - THROUGHPUT_WINDOW_S:
            self._window.popleft()

    def throughput(self, now: float | None = None) -> tuple[float, float, float]:
        """(messages per second, busy fraction, capacity in messages per second)
        over the trailing window. Capacity is messages per *busy* second: what
        this worker would process if it never waited for input."""
        now = time.monotonic() if now is None else now
        self._trim(now)
        messages = sum(n for _, n, _ in self._window)
        busy = sum(b for _, _, b in self._window)
        tps = messages / THROUGHPUT_WINDOW_S
        capacity = messages / busy if busy > 0 else math.nan
        return tps, min(1.0, busy / THROUGHPUT_WINDOW_S), capacity


#: A number with the words that only qualify it ("its 50 ms" in "model over its 50 ms budget").
_NUMBER = re.compile(r"\b(?:its\s+)?\d[\d.,]*\s*(?:ms|s)?(?=\s|$)")


def reason_label(why: str) -> str:
    """A degraded reason without its numbers, so the label set stays small.
    NOTE: the number goes with its unit and "its": "model over its 50 ms
    budget" is labelled "model over budget", not "model over its ms budget"."""
    return " ".join(_NUMBER.sub(" ", why).split()) or "unknown"


def consumer_lag(highwater: int | None, committed: int | None) -> int | None:
    """Messages not yet committed in one partition; None before the first fetch.

    The highwater is the one the consumer's fetch responses carry (the next
    offset to be written): no extra request per scrape. A partition never
    committed counts from offset 0.
    """
    if highwater is None:
        return None
    return max(0, highwater - (committed or 0))


class _ScrapeTimeCollector(Collector):
    """Lag per assigned partition and the worker's throughput, computed when scraped.

    Computed at scrape time, not kept in gauges: a partition that moved to
    another worker in a rebalance simply stops being reported here.
    """

    def __init__(self, metrics: WorkerMetrics) -> None:
        self.metrics = metrics

    def describe(self) -> Iterable[Any]:
        return []  # unchecked: the families depend on the assignment

    def collect(self) -> Iterable[Any]:
        tps, busy, capacity = self.metrics.throughput()
        window = f"{THROUGHPUT_WINDOW_S:.0f} s"
        yield _gauge("fraud_worker_throughput_tps", f"Messages per second over the last {window}", tps)
        yield _gauge("fraud_worker_busy_ratio", f"Fraction of the last {window} spent on batches", busy)
        yield _gauge(
            "fraud_worker_capacity_tps",
            "Measured messages per busy second: what this worker sustains when never idle (NaN before traffic)",
            capacity,
        )
        lag = GaugeMetricFamily(
            "fraud_consumer_lag", "Fetch highwater minus committed offset, per assigned partition",
            labels=["topic", "partition"],
        )  # fmt: skip
        highwater = GaugeMetricFamily(
            "fraud_consumer_highwater", "Next offset to be written, from fetch responses", labels=["topic", "partition"]
        )
        committed = GaugeMetricFamily(
            "fraud_consumer_committed_offset", "Committed offset (next to read) of this group",
            labels=["topic", "partition"],
        )  # fmt: skip
        assigned = 0
        for topic, partition, hw, done in self._offsets():
            assigned += 1
            labels = [topic, str(partition)]
            if done is not None:
                committed.add_metric(labels, done)
            value = consumer_lag(hw, done)
            if hw is not None and value is not None:
                highwater.add_metric(labels, hw)
                lag.add_metric(labels, value)
        yield lag
        yield highwater
        yield committed
        yield _gauge("fraud_assigned_partitions", "Partitions of `transactions` assigned to this worker", assigned)

    def _offsets(self) -> list[tuple[str, int, int | None, int | None]]:
        offsets = self.metrics.offsets
        return offsets() if offsets is not None else []


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


def _serve(app: faust.App, registry: CollectorRegistry) -> None:
    from aiohttp.web import Response
    from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

    @app.page("/metrics")
    async def metrics_page(self: Any, request: Any) -> Any:
        return Response(body=generate_latest(registry), headers={"Content-Type": CONTENT_TYPE_LATEST})
