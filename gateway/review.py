"""The analyst review queue: decisions in ``review``, and the labels analysts give them.

The worker writes one ``feedback`` record per scored transaction::

    {"decision": {...the decision...}, "transaction": {...the validated transaction...},
     "feature_set": "...", "features": {"<name>": value or null, ...}}

:class:`ReviewQueue` keeps the newest ``limit`` of those whose action is
``review`` (pure: records in, listing out), and marks the ones a label has
arrived for. :class:`ReviewReader` feeds it from ``feedback`` and ``labels``,
both read from the beginning (they are the history the page shows), with its
own consumer so a long backlog never delays the gateway's decision replies.
:func:`analyst_label` builds the label the page's buttons produce, in the
format of :mod:`pipeline.labels`.
"""

from __future__ import annotations

import logging
import math
from collections import OrderedDict
from datetime import UTC, datetime
from typing import Any

import orjson

from app.settings import Settings
from gateway.replies import TopicReader
from pipeline.decide import describe_reason
from pipeline.features import FEATURE_NAMES
from pipeline.labels import LABELS, Label, parse_label

__all__ = ["ReviewQueue", "ReviewReader", "analyst_label", "reason_features"]

log = logging.getLogger(__name__)

#: orjson writes no spaces, so a feedback record for a review decision holds
#: exactly this; checking for it first spares parsing the other ~95 % of feedback.
REVIEW_MARK = b'"action":"review"'


class ReviewQueue:
    """Newest-first review decisions, with their features and any label given."""

    def __init__(self, limit: int = 500) -> None:
        self.limit = limit
        self._items: OrderedDict[str, dict[str, Any]] = OrderedDict()
        self._labels: dict[str, dict[str, Any]] = {}

    def add_feedback(self, doc: Any) -> bool:
        """Keep a feedback record if its decision is a review; False otherwise."""
        if not isinstance(doc, dict):
            return False
        decision, tx = doc.get("decision"), doc.get("transaction")
        if not isinstance(decision, dict) or decision.get("action") != "review" or not isinstance(tx, dict):
            return False
        txid = decision.get("transaction_id")
        if not isinstance(txid, str):
            return False
        self._items.pop(txid, None)
        features = doc.get("features") or {}
        explanation = decision.get("explanation") or []
        self._items[txid] = {
            "transaction_id": txid,
            "decided_at": decision.get("decided_at") or 0.0,
            "fraud_score": decision.get("fraud_score"),
            "explanation": decision.get("explanation") or [],
            "degraded": bool(decision.get("degraded")),
            "model_version": decision.get("model_version"),
            "rules_version": decision.get("rules_version"),
            "transaction": tx,
            "features": features,
            "reason_features": reason_features(features, explanation),
        }
        while len(self._items) > self.limit:
            self._items.popitem(last=False)
        return True

    def add_label(self, label: Label) -> None:
        self._labels[label.transaction_id] = {
            "label": label.label, "source": label.source, "labeled_at": label.labeled_at,
        }  # fmt: skip
        # Bounded like the items: labels of transactions long gone from the queue are dropped.
        while len(self._labels) > 4 * self.limit:
            self._labels.pop(next(iter(self._labels)))

    def merchant_of(self, transaction_id: str) -> str | None:
        item = self._items.get(transaction_id)
        merchant = item["transaction"].get("merchant_id") if item else None
        return merchant if isinstance(merchant, str) else None

    def listing(self, limit: int | None = None) -> list[dict[str, Any]]:
        """Newest decision first, each with ``label`` (None until labelled)."""
        items: list[dict[str, Any]] = self.page(limit)["items"]
        return items

    def page(
        self,
        limit: int | None = None,
        offset: int = 0,
        *,
        min_score: float | None = None,
        max_age_s: float | None = None,
        now: float | None = None,
    ) -> dict[str, Any]:
        """One page of the queue, newest first, after the filters: ``items``,
        ``matching`` (how many pass the filters), ``total`` (how many are kept)
        and ``offset``. NOTE: the counts are what the page states as "N of M",
        so a queue longer than one page is never shown as if it were whole."""
        items = sorted(self._items.values(), key=lambda item: item["decided_at"], reverse=True)
        if min_score is not None:
            items = [i for i in items if isinstance(i["fraud_score"], (int, float)) and i["fraud_score"] >= min_score]
        if max_age_s is not None and now is not None:
            items = [i for i in items if now - i["decided_at"] <= max_age_s]
        offset = max(0, offset)
        end = None if limit is None else offset + limit
        return {
            "items": [{**item, "label": self._labels.get(item["transaction_id"])} for item in items[offset:end]],
            "matching": len(items),
            "total": len(self._items),
            "offset": offset,
        }

    def __len__(self) -> int:
        return len(self._items)


def reason_features(features: Any, explanation: list[Any]) -> list[str]:
    """The features behind the explanation's reasons: those whose value, in
    words (:func:`pipeline.decide.describe_reason`), is one of the reasons."""
    if not isinstance(features, dict) or not features:
        return []
    row = [_number(features.get(name)) for name in FEATURE_NAMES]
    words = set(w for w in explanation if isinstance(w, str))
    return [name for name in FEATURE_NAMES if name in features and describe_reason(name, row) in words]


def _number(value: Any) -> float:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else math.nan


def analyst_label(transaction_id: str, label: str, merchant_id: str | None, now: float) -> bytes:
    """A label as :func:`pipeline.labels.parse_label` reads it (source ``analyst``)."""
    if label not in LABELS:
        raise ValueError(f"label must be one of {LABELS}, got {label!r}")
    doc: dict[str, Any] = {
        "transaction_id": transaction_id,
        "label": label,
        "source": "analyst",
        "labeled_at": datetime.fromtimestamp(now, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z"),
    }
    if merchant_id is not None:
        doc["merchant_id"] = merchant_id  # feeds the live per-merchant tally
    return orjson.dumps(doc)


class ReviewReader(TopicReader):
    """Feeds a :class:`ReviewQueue` from ``feedback`` and ``labels``, from their beginnings."""

    task_name = "gateway-review"
    reads = "feedback/labels"

    def __init__(self, settings: Settings, queue: ReviewQueue) -> None:
        super().__init__(settings)
        self.queue = queue

    async def start(self) -> None:
        s = self.settings
        parts = await self._open(
            (s.topic_feedback, s.topic_labels),
            fetch_max_wait_ms=max(s.consumer_fetch_max_wait_ms, 100),  # a page refresh, not a checkout
        )
        assert self._consumer is not None
        await self._consumer.seek_to_beginning(*parts)
        self._follow()

    def read(self, topic: str, value: bytes, headers: Any = ()) -> None:
        if topic == self.settings.topic_labels:
            label = parse_label(value)
            if not isinstance(label, str):
                self.queue.add_label(label)
        elif REVIEW_MARK in value:
            try:
                self.queue.add_feedback(orjson.loads(value))
            except orjson.JSONDecodeError:
                log.warning("skipping a feedback record that is not JSON")
