"""The feedback loop: live quality from labels joined with feedback.

:class:`FeedbackLoop` reads ``feedback`` (one record per fresh decision) and
``labels`` in its own consumer group, ``<app_id>-feedback``, and writes both
sides of the join to :class:`pipeline.quality.RedisQualityStore`. The group
leader of the hosting faust app publishes a ``quality`` record to
``monitoring`` every ``quality_every_s``. Kept out of the scoring loop:
nothing here is on the decision path.

The records move through librdkafka at least once (:mod:`app.at_least_once`),
not through faust's stream: a batch's offsets are committed only once the
store has taken it. A Redis that fails or stalls holds the loop (retried,
logged, the group's lag growing) and loses nothing: the store's writes are
idempotent, so a batch written twice counts once.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Sequence

import faust
import orjson
from redis.exceptions import RedisError

from agents.watchdog import exit_on_failure
from app import redis_client, redis_keys
from app.at_least_once import AtLeastOnce
from app.faust_app import RAW, base_app
from app.librdkafka import client_config
from app.retry import retry
from app.settings import Settings
from pipeline.labels import Label, parse_label
from pipeline.quality import RedisQualityStore, Served, quality_report, served_from_feedback

__all__ = [
    "FeedbackLoop",
    "create_feedback_app",
    "feedback_group",
    "feedback_host",
    "install_feedback_loop",
    "parse_batch",
    "quality_store",
]

log = logging.getLogger(__name__)

BATCH = 500
WITHIN_S = 1.0
#: Off the decision path: a slow Redis may take this long per command before
#: the batch is tried again, far past the scoring budget.
REDIS_TIMEOUT_S = 2.0
#: A batch the store refused is tried again after 0.2 s, doubling up to this.
RETRY_CAP_S = 5.0


def feedback_group(settings: Settings) -> str:
    """The feedback loop's consumer group, in every role that runs it."""
    return f"{settings.app_id}-feedback"


def feedback_host(settings: Settings) -> str:
    """The app id (and so the faust group) of a ``--role feedback`` worker's faust app."""
    return f"{feedback_group(settings)}-host"


def create_feedback_app(settings: Settings) -> faust.App:
    """The feedback loop alone (``fraud-pipeline worker --role feedback``).

    Its records are read in the group ``<app_id>-feedback``
    (:func:`feedback_group`): scoring workers (``--role score``) and these
    never share partitions, and either kind scales without rebalancing the
    other. The hosting faust app (web server, the quality timer's leader) is
    ``<app_id>-feedback-host``: a group of its own, as librdkafka's and faust's
    members cannot share one. The Redis keys stay those of the deployment's
    app id, so ``report quality`` reads the same figures.
    """
    app = base_app(settings.model_copy(update={"app_id": feedback_host(settings)}))
    install_feedback_loop(app, settings)
    return app


def quality_store(settings: Settings) -> RedisQualityStore:
    """The feedback loop's store, over a client of its own: one server or a
    Redis Cluster, as the scoring agents'. Make it inside the running loop."""
    client = redis_client.async_client(settings, timeout_s=REDIS_TIMEOUT_S, connect_timeout_s=REDIS_TIMEOUT_S)
    return RedisQualityStore(
        client, ttl_s=settings.quality_join_window_s, max_joined=settings.quality_max_joined,
        prefix=redis_keys.quality_prefix(settings.app_id), cluster=redis_client.is_cluster(settings),
    )  # fmt: skip


def parse_batch(
    records: Sequence[tuple[str, bytes | None]], feedback_topic: str, now: float
) -> tuple[list[Served], list[Label]]:
    """The decisions and labels of a batch of (topic, value): what is neither is
    logged and left out (it would fail the same way every time it is read)."""
    served: list[Served] = []
    labels: list[Label] = []
    for topic, raw in records:
        if raw is None:
            continue
        if topic == feedback_topic:
            try:
                item = served_from_feedback(orjson.loads(raw))
            except (orjson.JSONDecodeError, TypeError, ValueError):
                item = None
            if item is not None:
                served.append(item)
            continue
        label = parse_label(raw)
        if isinstance(label, str):
            log.warning("quality: label ignored: %s", label)
            continue
        if not label.labeled_at:  # no time given: when it reached us
            label = Label(label.transaction_id, label.label, label.source, now, label.merchant_id)
        labels.append(label)
    return served, labels


class FeedbackLoop:
    """Take a batch of feedback and labels, write it to the quality store
    (again and again until the store takes it), then commit its offsets."""

    def __init__(self, reader: AtLeastOnce, store: RedisQualityStore, feedback_topic: str) -> None:
        self.reader, self.store, self.feedback_topic = reader, store, feedback_topic

    async def run(self) -> None:
        while True:
            await self.step()

    async def step(self) -> None:
        records = await self.reader.take(BATCH, WITHIN_S)
        if not records:
            return
        served, labels = parse_batch([(r.topic(), r.value()) for r in records], self.feedback_topic, time.time())
        # Redis away or slow: held and tried again. Anything else is a bug, and
        # the worker exits (the batch is read again after the restart).
        await retry(lambda: self._write(served, labels), first_s=0.2, cap_s=RETRY_CAP_S,
                    retry_on=(RedisError, OSError, TimeoutError), on_retry=self._retrying(len(records)))  # fmt: skip
        await self.reader.done(records)

    async def _write(self, served: list[Served], labels: list[Label]) -> None:
        await self.store.add_served(served)
        await self.store.add_labels(labels)

    @staticmethod
    def _retrying(n: int) -> Callable[[Exception, float], None]:
        def log_it(exc: Exception, sleep_s: float) -> None:
            log.warning("quality: a batch of %d records not recorded (%r); again in %.1f s", n, exc, sleep_s)

        return log_it


def install_feedback_loop(app: faust.App, settings: Settings) -> None:
    """Adds the feedback loop (and its quality timer) to ``app``."""
    if not settings.quality_enabled:
        return
    monitoring = app.topic(settings.topic_monitoring, **RAW)
    state: dict[str, RedisQualityStore] = {}

    def store() -> RedisQualityStore:
        # The client needs the running loop: made on first use, inside the loop.
        if "store" not in state:
            state["store"] = quality_store(settings)
        return state["store"]

    async def feedback_loop() -> None:
        reader = AtLeastOnce(
            topics=[settings.topic_feedback, settings.topic_labels], group_id=feedback_group(settings),
            client_config=client_config(settings, feedback_group(settings)),
            session_timeout_ms=int(settings.session_timeout_s * 1000),
            heartbeat_interval_ms=int(settings.heartbeat_interval_s * 1000),
        )  # fmt: skip
        try:
            # What it had not committed is read again, by this worker restarted or another.
            with exit_on_failure("the feedback loop"):
                await reader.start()
                await FeedbackLoop(reader, store(), settings.topic_feedback).run()
        finally:
            with contextlib.suppress(BaseException):
                await reader.close()  # commits what was processed, leaves the group

    async def publish_quality() -> None:
        try:
            joined, decided = await store().snapshot()
        except Exception as exc:
            log.warning("quality: reading the live figures failed (%r)", exc)
            return
        if not decided and not joined:
            return
        record = {"kind": "quality", "at": time.time(), **quality_report(joined, decided)}
        await monitoring.send(value=orjson.dumps(record))

    # Registered by calls: faust's decorators are annotated as a bare Callable (agents/wiring.py).
    app.task(feedback_loop)
    app.timer(settings.quality_every_s, on_leader=True)(publish_quality)
