"""Live quality: labels joined with the decisions they judge.

Every fresh decision leaves a ``feedback`` record (keyed by transaction id) with
the model and rules versions, the rule that decided and the action. Labels
(``pipeline.labels``) arrive minutes to months later, on the ``labels`` topic.
This module joins the two by transaction id — either may arrive first — and
turns the joined rows into quality figures:

* per **model version** (``degraded`` for decisions without a score): decisions,
  alert rate (review + decline over all decisions), and over the labelled ones
  precision and recall at ``decline``, at ``review`` and at ``flagged``
  (review or decline), plus label delay percentiles;
* per **rule and action**: decided, labelled, frauds, precision (flagging
  actions) or the share of frauds let through (``approve``);
* per **shadow model**: the same precision/recall for what the shadow would
  have decided on the same transactions.

Precision at an action is the share of fraud among the labelled transactions
given that action; recall is the share of all labelled frauds of that model
version that got it. Only labelled transactions count in either: an unlabelled
approve is not assumed legit (chargebacks arrive late).

Pure logic here (:class:`JoinLedger`, :func:`quality_report`,
:func:`format_quality`); :class:`RedisQualityStore` keeps the same join in
Redis for the running workers, so every worker shares it and it survives
restarts.
"""

from __future__ import annotations

import math
import time
from collections import Counter, OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import orjson

from app.redis_keys import (
    QUALITY_PREFIX,
    quality_decided_key,
    quality_joined_at_key,
    quality_joined_key,
    quality_label_key,
    quality_served_key,
)
from pipeline.labels import Label

__all__ = [
    "Joined",
    "JoinLedger",
    "RedisQualityStore",
    "Served",
    "format_quality",
    "quality_report",
    "served_from_feedback",
]

FLAGGING = ("review", "decline")
DEGRADED = "degraded"
#: A decided-count key: (model version or "degraded", rule, action).
DecidedKey = tuple[str, str, str]


@dataclass(frozen=True, slots=True)
class Served:
    """What quality needs of one ``feedback`` record."""

    transaction_id: str
    model_version: str
    """The model that scored it, or ``degraded`` when no model score was used."""
    rules_version: str | None
    rule: str
    action: str
    fraud_score: float
    decided_at: float
    shadow_version: str | None = None
    shadow_action: str | None = None

    def to_json(self) -> bytes:
        return orjson.dumps(asdict(self))

    @classmethod
    def from_json(cls, raw: bytes | str) -> Served:
        return cls(**orjson.loads(raw))


def served_from_feedback(doc: Mapping[str, Any]) -> Served | None:
    """The :class:`Served` of a parsed feedback record; None when it is not one."""
    decision = doc.get("decision")
    if not isinstance(decision, dict) or not isinstance(decision.get("transaction_id"), str):
        return None
    shadow = doc.get("shadow") or {}
    return Served(
        transaction_id=decision["transaction_id"],
        model_version=decision.get("model_version") or DEGRADED,
        rules_version=decision.get("rules_version"),
        rule=str(doc.get("rule") or "unknown"),
        action=str(decision.get("action")),
        fraud_score=float(decision.get("fraud_score") or 0.0),
        decided_at=float(decision.get("decided_at") or 0.0),
        shadow_version=shadow.get("model_version"),
        shadow_action=shadow.get("action"),
    )


@dataclass(frozen=True, slots=True)
class Joined:
    served: Served
    label: str
    source: str
    delay_s: float | None
    """labeled_at - decided_at; None when the label carried no time."""

    @classmethod
    def of(cls, served: Served, label: Label) -> Joined:
        delay = label.labeled_at - served.decided_at if label.labeled_at and served.decided_at else None
        return cls(served, label.label, label.source, delay)

    def to_json(self) -> bytes:
        return orjson.dumps({"served": asdict(self.served), "label": self.label, "source": self.source,
                             "delay_s": self.delay_s})  # fmt: skip

    @classmethod
    def from_json(cls, raw: bytes | str) -> Joined:
        doc = orjson.loads(raw)
        return cls(Served(**doc["served"]), doc["label"], doc["source"], doc["delay_s"])


def decided_key(served: Served) -> DecidedKey:
    return (served.model_version, served.rule, served.action)


class JoinLedger:
    """The join, in memory and bounded: a decision waits for its label at most
    ``window_s`` (by decision time) and at most ``max_waiting`` decisions wait;
    a label that arrives before its decision waits the same way. A second label
    for a transaction replaces the first (a changed verdict)."""

    def __init__(self, window_s: float = 120 * 86400.0, max_waiting: int = 500_000) -> None:
        self.window_s = window_s
        self.max_waiting = max_waiting
        self.served: OrderedDict[str, Served] = OrderedDict()
        self.early_labels: OrderedDict[str, tuple[float, Label]] = OrderedDict()
        self.joined: dict[str, Joined] = {}
        self.decided: Counter[DecidedKey] = Counter()

    def add_served(self, served: Served, now: float | None = None) -> Joined | None:
        if served.transaction_id in self.served:
            return None  # a redelivered feedback record: counted once
        self.decided[decided_key(served)] += 1
        self.served[served.transaction_id] = served
        self._expire(now if now is not None else served.decided_at)
        waiting = self.early_labels.pop(served.transaction_id, None)
        if waiting is None:
            return None
        joined = Joined.of(served, waiting[1])
        self.joined[served.transaction_id] = joined
        return joined

    def add_label(self, label: Label, now: float | None = None) -> Joined | None:
        served = self.served.get(label.transaction_id)
        if served is None:
            self.early_labels.pop(label.transaction_id, None)
            self.early_labels[label.transaction_id] = (now if now is not None else time.time(), label)
            while len(self.early_labels) > self.max_waiting:
                self.early_labels.popitem(last=False)
            return None
        joined = Joined.of(served, label)
        self.joined[label.transaction_id] = joined
        return joined

    def _expire(self, now: float) -> None:
        horizon = now - self.window_s
        while self.served and (
            len(self.served) > self.max_waiting or next(iter(self.served.values())).decided_at < horizon
        ):
            self.served.popitem(last=False)
        while self.early_labels and next(iter(self.early_labels.values()))[0] < horizon:
            self.early_labels.popitem(last=False)


# --- the figures ------------------------------------------------------------------------------


def _ratio(num: int, den: int) -> float | None:
    return round(num / den, 4) if den else None


def _percentiles(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    p = np.percentile(np.asarray(values, dtype=np.float64), [50, 90, 99])
    return {"p50": round(float(p[0]), 1), "p90": round(float(p[1]), 1), "p99": round(float(p[2]), 1)}


def _at_actions(rows: list[tuple[str, str]]) -> dict[str, dict[str, Any]]:
    """Precision/recall per action from (action, label) pairs."""
    frauds = sum(1 for _, label in rows if label == "fraud")
    out: dict[str, dict[str, Any]] = {}
    for name, actions in (("decline", ("decline",)), ("review", ("review",)), ("flagged", FLAGGING)):
        labelled = [label for action, label in rows if action in actions]
        caught = labelled.count("fraud")
        out[name] = {
            "labelled": len(labelled),
            "fraud": caught,
            "precision": _ratio(caught, len(labelled)),
            "recall": _ratio(caught, frauds),
        }
    return out


def quality_report(joined: Iterable[Joined], decided: Mapping[DecidedKey, int]) -> dict[str, Any]:
    """Quality per model version, per rule/action and per shadow model (see the module doc)."""
    rows = list(joined)
    models: dict[str, dict[str, Any]] = {}
    versions = sorted({k[0] for k in decided} | {j.served.model_version for j in rows})
    for version in versions:
        total = sum(n for k, n in decided.items() if k[0] == version)
        alerts = sum(n for k, n in decided.items() if k[0] == version and k[2] in FLAGGING)
        mine = [j for j in rows if j.served.model_version == version]
        models[version] = {
            "decisions": total,
            "alert_rate": _ratio(alerts, total),
            "labelled": len(mine),
            "fraud": sum(1 for j in mine if j.label == "fraud"),
            "actions": _at_actions([(j.served.action, j.label) for j in mine]),
            "label_delay_s": _percentiles([j.delay_s for j in mine if j.delay_s is not None]),
        }
    all_frauds = sum(1 for j in rows if j.label == "fraud")
    rules: dict[str, dict[str, Any]] = {}
    keys = sorted({(k[1], k[2]) for k in decided} | {(j.served.rule, j.served.action) for j in rows})
    for rule, action in keys:
        mine = [j for j in rows if (j.served.rule, j.served.action) == (rule, action)]
        fraud = sum(1 for j in mine if j.label == "fraud")
        rules[f"{rule}/{action}"] = {
            "rule": rule,
            "action": action,
            "decided": sum(n for k, n in decided.items() if (k[1], k[2]) == (rule, action)),
            "labelled": len(mine),
            "fraud": fraud,
            "legit": len(mine) - fraud,
            # For a flagging action the fraud share is its precision; for approve
            # it is the share of what it let through that was fraud.
            "fraud_share": _ratio(fraud, len(mine)),
            "share_of_frauds": _ratio(fraud, all_frauds),
        }
    shadows: dict[str, dict[str, Any]] = {}
    for version in sorted({j.served.shadow_version for j in rows if j.served.shadow_version}):
        mine = [j for j in rows if j.served.shadow_version == version and j.served.shadow_action]
        shadows[version] = {
            "labelled": len(mine),
            "actions": _at_actions([(j.served.shadow_action or "", j.label) for j in mine]),
            "served_actions": _at_actions([(j.served.action, j.label) for j in mine]),
            "agreement": _ratio(sum(1 for j in mine if j.served.shadow_action == j.served.action), len(mine)),
        }
    return {"models": models, "rules": rules, "shadows": shadows}


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def format_quality(report: Mapping[str, Any]) -> str:
    """The report as text tables (``fraud-pipeline report quality``)."""
    lines = ["Quality per model version (precision / recall over labelled decisions)"]
    head = f"{'model':<20} {'decisions':>9} {'alert%':>7} {'labelled':>8} {'fraud':>6}"
    head += "".join(f" {a + ' P':>10} {a + ' R':>10}" for a in ("decline", "review", "flagged"))
    head += f" {'delay p50/p90 (h)':>18}"
    lines.append(head)
    for version, m in report["models"].items():
        alert = "-" if m["alert_rate"] is None else f"{m['alert_rate'] * 100:.2f}"
        row = f"{version:<20} {m['decisions']:>9} {alert:>7} {m['labelled']:>8} {m['fraud']:>6}"
        for a in ("decline", "review", "flagged"):
            row += f" {_fmt(m['actions'][a]['precision']):>10} {_fmt(m['actions'][a]['recall']):>10}"
        delay = m["label_delay_s"]
        hours = "-" if not delay else f"{delay['p50'] / 3600:.1f}/{delay['p90'] / 3600:.1f}"
        row += f" {hours:>18}"
        lines.append(row)
    lines += ["", "Per rule and action (fraud share = precision for review/decline, misses for approve)"]
    lines.append(f"{'rule':<26} {'action':<8} {'decided':>8} {'labelled':>8} {'fraud':>6} {'legit':>6} "
                 f"{'fraud share':>11} {'of frauds':>9}")  # fmt: skip
    for r in report["rules"].values():
        lines.append(
            f"{r['rule']:<26} {r['action']:<8} {r['decided']:>8} {r['labelled']:>8} {r['fraud']:>6} "
            f"{r['legit']:>6} {_fmt(r['fraud_share']):>11} {_fmt(r['share_of_frauds']):>9}"
        )
    if report.get("shadows"):
        lines += ["", "Shadow models on the same labelled decisions (flagged = review or decline)"]
        lines.append(f"{'shadow':<20} {'labelled':>8} {'agree':>6} {'shadow P':>9} {'shadow R':>9} "
                     f"{'served P':>9} {'served R':>9}")  # fmt: skip
        for version, s in report["shadows"].items():
            sa, va = s["actions"]["flagged"], s["served_actions"]["flagged"]
            lines.append(
                f"{version:<20} {s['labelled']:>8} {_fmt(s['agreement']):>6} {_fmt(sa['precision']):>9} "
                f"{_fmt(sa['recall']):>9} {_fmt(va['precision']):>9} {_fmt(va['recall']):>9}"
            )
    return "\n".join(lines)


# --- the shared state of the running workers ------------------------------------------------------


class RedisQualityStore:
    """The join in Redis, shared by every worker and kept across restarts.

    Keys (app/redis_keys.py, under ``prefix``): ``fb:<txid>`` a decision
    waiting for its label, ``lab:<txid>`` a label waiting for its decision (both
    expire after the join window), ``decided`` a hash of decision counts per
    model/rule/action, ``joined`` a hash txid -> joined row, ``joined-at`` a
    sorted set by decision time that bounds ``joined`` to ``max_joined`` rows.

    NOTE: each side writes itself, then reads the other (:meth:`_set_then_get`):
    of two concurrent arrivals at least one sees the other (both writes cannot
    come after both reads), and writing a joined row twice is harmless.
    """

    def __init__(self, client: Any, *, ttl_s: int = 120 * 86400, max_joined: int = 200_000,
                 prefix: str = QUALITY_PREFIX, cluster: bool = False) -> None:  # fmt: skip
        """``cluster``: ``client`` is a ``RedisCluster`` (decided once from
        settings: app.redis_client.is_cluster)."""
        self.client = client
        self.ttl_s = int(ttl_s)
        self.max_joined = max_joined
        self.prefix = prefix
        self._cluster = cluster

    async def _set_then_get(
        self, sets: list[tuple[str, bytes]], gets: list[str], *, nx: bool
    ) -> tuple[list[Any], list[Any]]:
        """SET each of ``sets`` (with the TTL), then GET each of ``gets``: the SET replies and the values.

        One server: one MULTI. NOTE: a Redis Cluster refuses a MULTI over
        several slots, and these keys carry no hash tag (their bytes stay those
        of the figures already stored), so there the writes are acknowledged
        before the reads are sent: two round trips, and still no read can come
        before its own side's write.
        """
        if self._cluster:
            pipe = self.client.pipeline(transaction=False)
            for key, value in sets:
                pipe.set(key, value, nx=nx, ex=self.ttl_s)
            written = await pipe.execute()
            pipe = self.client.pipeline(transaction=False)
            for key in gets:
                pipe.get(key)
            return written, await pipe.execute()
        pipe = self.client.pipeline(transaction=True)
        for (key, value), other in zip(sets, gets, strict=True):
            pipe.set(key, value, nx=nx, ex=self.ttl_s)
            pipe.get(other)
        results = await pipe.execute()
        return results[0::2], results[1::2]

    async def add_served(self, served: list[Served]) -> int:
        """Record decisions; returns how many joined a waiting label."""
        if not served:
            return 0
        written, waiting_labels = await self._set_then_get(
            [(quality_served_key(self.prefix, s.transaction_id), s.to_json()) for s in served],
            [quality_label_key(self.prefix, s.transaction_id) for s in served],
            nx=True,
        )
        pipe = self.client.pipeline(transaction=False)
        joined = 0
        for s, new, waiting in zip(served, written, waiting_labels, strict=True):
            if new:  # NX: a redelivered record is counted once
                pipe.hincrby(quality_decided_key(self.prefix), "|".join(decided_key(s)), 1)
            if waiting is not None:
                self._write_joined(pipe, Joined.of(s, _label_from_json(waiting)))
                joined += 1
        await pipe.execute()
        return joined

    async def add_labels(self, labels: list[Label]) -> int:
        """Record labels; returns how many joined a decision."""
        if not labels:
            return 0
        _, waiting_decisions = await self._set_then_get(
            [(quality_label_key(self.prefix, label.transaction_id), _label_to_json(label)) for label in labels],
            [quality_served_key(self.prefix, label.transaction_id) for label in labels],
            nx=False,
        )
        pipe = self.client.pipeline(transaction=False)
        joined = 0
        for label, served in zip(labels, waiting_decisions, strict=True):
            if served is not None:
                self._write_joined(pipe, Joined.of(Served.from_json(served), label))
                joined += 1
        if joined:
            await pipe.execute()
            await self._trim()
        return joined

    def _write_joined(self, pipe: Any, joined: Joined) -> None:
        txid = joined.served.transaction_id
        pipe.hset(quality_joined_key(self.prefix), txid, joined.to_json())
        pipe.zadd(quality_joined_at_key(self.prefix), {txid: joined.served.decided_at})

    async def _trim(self) -> None:
        excess = await self.client.zcard(quality_joined_at_key(self.prefix)) - self.max_joined
        if excess > 0:
            oldest = await self.client.zpopmin(quality_joined_at_key(self.prefix), excess)
            await self.client.hdel(quality_joined_key(self.prefix), *[m for m, _ in oldest])

    async def snapshot(self) -> tuple[list[Joined], Counter[DecidedKey]]:
        rows = await self.client.hgetall(quality_joined_key(self.prefix))
        counts = await self.client.hgetall(quality_decided_key(self.prefix))
        decided: Counter[DecidedKey] = Counter()
        for field, n in counts.items():
            key = (field.decode() if isinstance(field, bytes) else field).split("|")
            if len(key) == 3:
                decided[(key[0], key[1], key[2])] += int(n)
        return [Joined.from_json(v) for v in rows.values()], decided


def _label_to_json(label: Label) -> bytes:
    return orjson.dumps({"transaction_id": label.transaction_id, "label": label.label, "source": label.source,
                         "labeled_at": label.labeled_at, "merchant_id": label.merchant_id})  # fmt: skip


def _label_from_json(raw: bytes | str) -> Label:
    doc = orjson.loads(raw)
    labeled_at = doc.get("labeled_at") or 0.0
    if isinstance(labeled_at, float) and math.isnan(labeled_at):
        labeled_at = 0.0
    return Label(doc["transaction_id"], doc["label"], doc["source"], float(labeled_at), doc.get("merchant_id"))
