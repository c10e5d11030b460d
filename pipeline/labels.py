"""Labels from analysts, chargebacks and customers, and the live merchant tally.

A label (topic ``labels``, JSON)::

    {"transaction_id": "t-1", "label": "fraud", "source": "chargeback",
     "labeled_at": "2026-12-02T11:00:00Z", "merchant_id": "m-000123"}

``merchant_id`` is optional; with it, the label feeds a per-merchant tally of
confirmed fraud that rules can act on within seconds, instead of waiting for the
nightly materialization of merchant risk. The tally is kept idempotent: the
same label delivered twice counts once, and a changed verdict moves the count.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import orjson

__all__ = [
    "LABELS", "SOURCES", "Label", "MerchantTally", "TallyView", "parse_label", "parse_tally_key", "tally_key",
    "tally_writes",
]  # fmt: skip

LABELS = ("fraud", "legit")
SOURCES = ("analyst", "chargeback", "customer")
#: Verdicts remembered per merchant for de-duplication; bounds the table value.
RECENT_LIMIT = 256


@dataclass(frozen=True, slots=True)
class Label:
    transaction_id: str
    label: str
    source: str
    labeled_at: float
    merchant_id: str | None = None


def parse_label(raw: bytes) -> Label | str:
    """A :class:`Label`, or the reason it is not one."""
    try:
        doc = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        return f"not valid JSON: {exc}"
    if not isinstance(doc, dict):
        return "a label is a JSON object"
    txid, label, source = doc.get("transaction_id"), doc.get("label"), doc.get("source", "analyst")
    if not isinstance(txid, str) or not txid:
        return "transaction_id must be a non-empty string"
    if label not in LABELS:
        return f"label must be one of {LABELS}"
    if source not in SOURCES:
        return f"source must be one of {SOURCES}"
    try:
        labeled_at = datetime.fromisoformat(doc["labeled_at"]).timestamp() if doc.get("labeled_at") else 0.0
    except (TypeError, ValueError):
        return "labeled_at must be ISO-8601"
    merchant = doc.get("merchant_id")
    if merchant is not None and not isinstance(merchant, str):
        return "merchant_id must be a string"
    return Label(txid, label, source, labeled_at, merchant)


@dataclass
class MerchantTally:
    """Confirmed labels of one merchant's transactions (a table value)."""

    fraud: int = 0
    legit: int = 0
    recent: dict[str, str] | None = None

    def apply(self, label: Label) -> bool:
        """Count ``label``; False when it changes nothing (a redelivery)."""
        recent = dict(self.recent or {})
        before = recent.get(label.transaction_id)
        if before == label.label:
            return False
        if before is not None:  # a changed verdict moves the count
            setattr(self, before, getattr(self, before) - 1)
        setattr(self, label.label, getattr(self, label.label) + 1)
        recent.pop(label.transaction_id, None)
        recent[label.transaction_id] = label.label
        while len(recent) > RECENT_LIMIT:
            recent.pop(next(iter(recent)))
        self.recent = recent
        return True

    @property
    def fraud_share(self) -> float:
        total = self.fraud + self.legit
        return self.fraud / total if total else 0.0

    def to_json(self) -> dict[str, Any]:
        return {"fraud": self.fraud, "legit": self.legit, "recent": self.recent or {}}

    @classmethod
    def from_json(cls, doc: dict[str, Any] | None) -> MerchantTally:
        if not doc:
            return cls()
        return cls(int(doc.get("fraud", 0)), int(doc.get("legit", 0)), dict(doc.get("recent") or {}))


def tally_key(merchant_id: str, part: int) -> bytes:
    """The tally topic's key of one merchant's labels read from one partition of ``labels``."""
    return orjson.dumps([merchant_id, part])


def parse_tally_key(key: bytes) -> tuple[str, int] | None:
    """``(merchant_id, part)`` of a tally key, or None when it is not one."""
    try:
        merchant, part = orjson.loads(key)
    except (orjson.JSONDecodeError, TypeError, ValueError):
        return None
    if not isinstance(merchant, str) or not isinstance(part, int):
        return None
    return merchant, part


class TallyView:
    """The whole merchant tally as every worker holds it: per merchant, one
    :class:`MerchantTally` per partition of ``labels``, and their sum.

    Why per partition: labels are keyed by transaction id, so one merchant's
    labels arrive on several partitions, each counted by its one owner in the
    tally group. Each owner writes only its own partition's share, so no two
    workers ever write the same key, and the rules read the sum. A
    transaction's labels (its verdict changed, a redelivery) share its
    partition, so each share's ``recent`` ids keep counting them once.
    """

    def __init__(self) -> None:
        self._shares: dict[str, dict[int, MerchantTally]] = {}
        self._sums: dict[str, MerchantTally] = {}

    def share(self, merchant_id: str, part: int) -> MerchantTally:
        """A copy of what partition ``part`` of ``labels`` counted for the merchant."""
        held = self._shares.get(merchant_id, {}).get(part)
        return MerchantTally.from_json(held.to_json()) if held is not None else MerchantTally()

    def put(self, merchant_id: str, part: int, tally: MerchantTally | None) -> None:
        """A share as the tally topic holds it now (None: deleted)."""
        shares = self._shares.setdefault(merchant_id, {})
        if tally is None:
            shares.pop(part, None)
        else:
            shares[part] = tally
        if not shares:
            self._shares.pop(merchant_id, None)
            self._sums.pop(merchant_id, None)
            return
        # Replaced whole, never changed in place: the scoring loop reads it from another thread.
        self._sums[merchant_id] = MerchantTally(sum(t.fraud for t in shares.values()),
                                                sum(t.legit for t in shares.values()))  # fmt: skip

    def get(self, merchant_id: str) -> MerchantTally | None:
        """The merchant's tally over every partition of ``labels``; None before its first label."""
        return self._sums.get(merchant_id)

    def __len__(self) -> int:
        return len(self._sums)


def tally_writes(view: TallyView, labels: Sequence[tuple[int, Label]]) -> dict[tuple[str, int], MerchantTally]:
    """What a batch of ``(partition, label)`` changes in the tally: the new value
    of each share it moved. Labels without a merchant, and labels counted
    already (a batch read again), change nothing."""
    changed: dict[tuple[str, int], MerchantTally] = {}
    for part, label in labels:
        if label.merchant_id is None:
            continue
        key = (label.merchant_id, part)
        tally = changed.get(key) or view.share(*key)
        if tally.apply(label):
            changed[key] = tally
    return changed
