"""Business rules from a versioned JSON file, evaluated in a fixed order.

Evaluation order (first match decides, except where noted):

1. **block lists** (user, device, merchant) → ``decline``;
2. **amount** in USD above ``force_review_amount_usd`` → at least ``review``
   (``decline`` if the score reaches the decline threshold);
3. **allow lists** (user, device, merchant) → ``approve``;
4. **score thresholds**: ``>= decline`` → ``decline``, ``>= review`` → ``review``,
   else ``approve``.

When the model gave no score (budget missed, feature store down: a *degraded*
decision), step 4 is replaced by: amount above ``degraded_review_amount_usd``
→ ``review``, else ``approve``.

A file is validated completely before it is used: a bad file raises
:class:`RulesError` and whatever was in force stays in force.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from app.contract import Transaction
from app.errors import RulesError

__all__ = ["RuleOutcome", "RuleSet", "evaluate_rules", "load_rules", "parse_rules"]

LIST_FIELDS = ("user_id", "device_id", "merchant_id")


@dataclass(frozen=True)
class RuleSet:
    version: str
    review_threshold: float
    decline_threshold: float
    force_review_amount_usd: float
    degraded_review_amount_usd: float
    allow: dict[str, frozenset[str]]
    block: dict[str, frozenset[str]]


@dataclass(frozen=True, slots=True)
class RuleOutcome:
    action: str
    hits: tuple[str, ...]
    """Rules that decided or shaped the action, in words."""


def load_rules(path: Path) -> RuleSet:
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise RulesError(path, f"cannot read it: {exc}") from None
    return parse_rules(doc, path)


def parse_rules(doc: Any, source: object = "<rules>") -> RuleSet:
    if not isinstance(doc, dict):
        raise RulesError(source, "must be a JSON object")
    version = doc.get("version")
    if not isinstance(version, str) or not version:
        raise RulesError(source, "'version' must be a non-empty string")
    thresholds = doc.get("thresholds")
    if not isinstance(thresholds, dict):
        raise RulesError(source, "'thresholds' must be an object with 'review' and 'decline'")
    review = _probability(thresholds.get("review"), "thresholds.review", source)
    decline = _probability(thresholds.get("decline"), "thresholds.decline", source)
    if review > decline:
        raise RulesError(source, f"review threshold {review} is above decline threshold {decline}")
    return RuleSet(
        version=version,
        review_threshold=review,
        decline_threshold=decline,
        force_review_amount_usd=_positive(doc.get("force_review_amount_usd"), "force_review_amount_usd", source),
        degraded_review_amount_usd=_positive(
            doc.get("degraded_review_amount_usd"), "degraded_review_amount_usd", source
        ),
        allow=_lists(doc.get("allow", {}), "allow", source),
        block=_lists(doc.get("block", {}), "block", source),
    )


def _probability(value: Any, name: str, source: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
        raise RulesError(source, f"'{name}' must be a number in [0, 1], got {value!r}")
    return float(value)


def _positive(value: Any, name: str, source: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
        raise RulesError(source, f"'{name}' must be a positive number, got {value!r}")
    return float(value)


def _lists(value: Any, name: str, source: object) -> dict[str, frozenset[str]]:
    if not isinstance(value, dict):
        raise RulesError(source, f"'{name}' must be an object of lists")
    unknown = set(value) - set(LIST_FIELDS)
    if unknown:
        raise RulesError(source, f"'{name}' has unknown keys {sorted(unknown)}; allowed: {list(LIST_FIELDS)}")
    out = {}
    for field in LIST_FIELDS:
        items = value.get(field, [])
        if not isinstance(items, list) or not all(isinstance(i, str) for i in items):
            raise RulesError(source, f"'{name}.{field}' must be a list of strings")
        out[field] = frozenset(items)
    return out


def evaluate_rules(rules: RuleSet, tx: Transaction, score: float | None) -> RuleOutcome:
    """The action for one transaction given its score (None when degraded)."""
    for field in LIST_FIELDS:
        value = getattr(tx, field)
        if value is not None and value in rules.block[field]:
            return RuleOutcome("decline", (f"blocked {field.removesuffix('_id')} {value}",))
    amount = tx.amount_usd
    if amount > rules.force_review_amount_usd:
        hit = f"amount {amount:,.2f} USD over {rules.force_review_amount_usd:,.0f}: forced review"
        if score is not None and score >= rules.decline_threshold:
            return RuleOutcome("decline", (hit,))
        return RuleOutcome("review", (hit,))
    for field in LIST_FIELDS:
        value = getattr(tx, field)
        if value is not None and value in rules.allow[field]:
            return RuleOutcome("approve", (f"allowed {field.removesuffix('_id')} {value}",))
    if score is None:
        if amount > rules.degraded_review_amount_usd:
            return RuleOutcome(
                "review", (f"no model score: amount {amount:,.2f} USD over {rules.degraded_review_amount_usd:,.0f}",)
            )
        return RuleOutcome("approve", ())
    if score >= rules.decline_threshold:
        return RuleOutcome("decline", (f"score {score:.3f} at or above decline threshold {rules.decline_threshold}",))
    if score >= rules.review_threshold:
        return RuleOutcome("review", (f"score {score:.3f} at or above review threshold {rules.review_threshold}",))
    return RuleOutcome("approve", ())
