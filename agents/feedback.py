"""The feedback loop's agents: live quality from labels joined with feedback.

Two plain agents (``take`` batches, no scoring work) feed
:class:`pipeline.quality.RedisQualityStore`: one reads ``feedback`` (one record
per fresh decision), one reads ``labels``. The group leader publishes a
``quality`` record to ``monitoring`` every ``quality_every_s``. Kept out of the
scoring agent: nothing here is on the decision path, and a Redis hiccup here
costs a few quality counts, never a decision.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import faust
import orjson

from app import redis_client, redis_keys
from app.faust_app import RAW, base_app
from app.retry import retry
from app.settings import Settings
from pipeline.labels import Label, parse_label
from pipeline.quality import RedisQualityStore, quality_report, served_from_feedback

__all__ = ["create_feedback_app", "install_feedback_loop", "quality_store"]

log = logging.getLogger(__name__)

BATCH = 500
WITHIN_S = 1.0
ATTEMPTS = 3
#: Off the decision path: a slow Redis may take this long per command before a
#: batch is retried (ATTEMPTS), far past the scoring budget.
REDIS_TIMEOUT_S = 2.0


def create_feedback_app(settings: Settings) -> faust.App:
    """The feedback loop alone (``fraud-pipeline worker --role feedback``).

    Its own consumer group, ``<app_id>-feedback``: scoring workers
    (``--role score``) and these never share partitions, and either kind
    scales without rebalancing the other. The Redis keys stay those of the
    deployment's app id, so ``report quality`` reads the same figures.
    """
    app = base_app(settings.model_copy(update={"app_id": f"{settings.app_id}-feedback"}))
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


def install_feedback_loop(app: faust.App, settings: Settings) -> None:
    """Adds the feedback loop's agents (and its quality timer) to ``app``."""
    if not settings.quality_enabled:
        return
    feedback = app.topic(settings.topic_feedback, **RAW)
    labels = app.topic(settings.topic_labels, **RAW)
    monitoring = app.topic(settings.topic_monitoring, **RAW)
    state: dict[str, RedisQualityStore] = {}

    def store() -> RedisQualityStore:
        # The client needs the running loop: made on first use, inside an agent.
        if "store" not in state:
            state["store"] = quality_store(settings)
        return state["store"]

    async def retried(what: str, call: Any, items: list[Any]) -> None:
        # NOTE: nothing may escape a take() body (faust would ack the batches
        # behind it unprocessed); after the retries the batch is given up, loudly.
        try:
            await retry(lambda: call(items), first_s=0.2, attempts=ATTEMPTS)
        except Exception as exc:
            log.warning("quality: %d %s not recorded (%r)", len(items), what, exc)

    @app.agent(feedback, name="quality-feedback")
    async def quality_feedback(stream: faust.StreamT[bytes]) -> None:
        async for values in stream.take(BATCH, within=WITHIN_S):
            served = []
            for raw in values:
                try:
                    item = served_from_feedback(orjson.loads(raw))
                except (orjson.JSONDecodeError, TypeError, ValueError):
                    item = None
                if item is not None:
                    served.append(item)
            await retried("decisions", store().add_served, served)

    @app.agent(labels, name="quality-labels")
    async def quality_labels(stream: faust.StreamT[bytes]) -> None:
        async for values in stream.take(BATCH, within=WITHIN_S):
            now = time.time()
            parsed = []
            for raw in values:
                label = parse_label(raw)
                if isinstance(label, str):
                    log.warning("quality: label ignored: %s", label)
                    continue
                if not label.labeled_at:  # no time given: when it reached us
                    label = Label(label.transaction_id, label.label, label.source, now, label.merchant_id)
                parsed.append(label)
            await retried("labels", store().add_labels, parsed)

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

    # Registered by a call: faust's decorator is annotated as a bare Callable (agents/wiring.py).
    app.timer(settings.quality_every_s, on_leader=True)(publish_quality)
