"""Read a topic from offset 0 up to its end: the feedback loop's history.

``report quality --replay``, ``train --from-feedback`` and ``rules backtest``
read ``feedback`` and ``labels`` this way: the topics are the record, so these
commands need no state of the running workers. A consumer without a group
(nothing committed, nothing shared with the workers) assigns every partition,
seeks to the beginning and stops once every partition is read up to its high
watermark.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import orjson
from aiokafka import AIOKafkaConsumer, TopicPartition

from app.settings import Settings
from app.topics import kafka_auth, partitions_of
from pipeline.labels import Label, parse_label

__all__ = ["read_feedback", "read_labels", "read_topic"]

T = TypeVar("T")


async def read_topic(settings: Settings, topic: str, *, timeout_s: float = 120.0) -> list[tuple[bytes | None, bytes, float]]:
    """Every record of ``topic`` as (key, value, record timestamp in seconds)."""
    consumer = AIOKafkaConsumer(
        bootstrap_servers=settings.kafka_bootstrap,
        enable_auto_commit=False,
        auto_offset_reset="earliest",
        fetch_max_wait_ms=50,
        isolation_level="read_committed",  # decisions are written in transactions
        max_partition_fetch_bytes=8 * 1024 * 1024,
        **kafka_auth(settings),
    )
    await consumer.start()
    try:
        partitions = (await partitions_of(consumer, [topic]))[topic] or set()
        parts = [TopicPartition(topic, p) for p in sorted(partitions)]
        if not parts:
            return []
        consumer.assign(parts)
        await consumer.seek_to_beginning(*parts)
        remaining = set(parts)
        out: list[tuple[bytes | None, bytes, float]] = []
        deadline = time.monotonic() + timeout_s
        while remaining:
            if time.monotonic() > deadline:
                raise TimeoutError(f"reading {topic}: {len(out)} records in {timeout_s:.0f} s, not at the end yet")
            batches = await consumer.getmany(*remaining, timeout_ms=200, max_records=5000)
            for records in batches.values():
                out.extend((r.key, r.value, (r.timestamp or 0) / 1000.0) for r in records)
            for tp in list(remaining):
                # read_committed: the end is the last stable offset (records past
                # it belong to a transaction still open, or are its marker).
                end = consumer.last_stable_offset(tp)
                if end is not None and await consumer.position(tp) >= end:
                    remaining.discard(tp)
        return out
    finally:
        await consumer.stop()


def _parsed(records: Iterable[tuple[bytes | None, bytes, float]], parse: Callable[[bytes, float], T | None]) -> list[T]:
    out = []
    for _, value, ts in records:
        item = parse(value, ts)
        if item is not None:
            out.append(item)
    return out


def _feedback(value: bytes, _: float) -> dict[str, Any] | None:
    try:
        doc = orjson.loads(value)
    except orjson.JSONDecodeError:
        return None
    return doc if isinstance(doc, dict) and isinstance(doc.get("decision"), dict) else None


def _label(value: bytes, ts: float) -> Label | None:
    label = parse_label(value)
    if isinstance(label, str):
        return None
    if not label.labeled_at:  # no labeled_at: the time it reached the topic is the next best
        label = Label(label.transaction_id, label.label, label.source, ts, label.merchant_id)
    return label


def read_feedback(settings: Settings) -> list[dict[str, Any]]:
    """Every feedback record, parsed, in topic order per partition."""
    return _parsed(asyncio.run(read_topic(settings, settings.topic_feedback)), _feedback)


def read_labels(settings: Settings) -> list[Label]:
    """Every well-formed label (malformed ones are skipped)."""
    return _parsed(asyncio.run(read_topic(settings, settings.topic_labels)), _label)


def latest_labels(labels: Iterable[Label]) -> dict[str, Label]:
    """The last verdict per transaction, by label time (a changed verdict replaces the first)."""
    out: dict[str, Label] = {}
    for label in sorted(labels, key=lambda lb: lb.labeled_at):
        out[label.transaction_id] = label
    return out
