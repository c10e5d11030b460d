"""Business rules from a versioned JSON file, evaluated in a fixed order.

Evaluation order (first match decides, except where noted):

1. **block lists** (user, device, merchant) → ``decline``;
2. **amount** in USD above ``force_review_amount_usd`` → at least ``review``
   (``decline`` if the score reaches the decline threshold: then the score
   decided, and the explanation says so first);
3. **confirmed-fraud merchant**: analysts/chargebacks confirmed at least
   ``confirmed_fraud_merchant.min_frauds`` frauds there, making at least
   ``min_share`` of its labels → at least ``review`` (the live tally from the
   ``labels`` topic: faster than the nightly merchant-risk feature);
4. **allow lists** (user, device, merchant) → ``approve``;
5. **score thresholds**: ``>= decline`` → ``decline``, ``>= review`` → ``review``,
   else ``approve``.

When the model gave no score (budget missed, feature store down: a *degraded*
decision), step 5 is replaced by: amount above ``degraded_review_amount_usd``
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
from pipeline.labels import MerchantTally

__all__ = ["RULE_IDS", "RuleOutcome", "RuleSet", "evaluate_rules", "load_rules", "parse_rules"]

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
    merchant_min_frauds: int = 0
    """0 turns the confirmed-fraud merchant rule off."""
    merchant_min_share: float = 1.0


@dataclass(frozen=True, slots=True)
class RuleOutcome:
    action: str
    hits: tuple[str, ...]
    """Rules that decided or shaped the action, in words."""
    rule: str = "score"
    """Which rule decided, as a stable id (one of :data:`RULE_IDS`): live quality
    and backtests are counted per rule."""


#: The rule that decided, per evaluation step (quality is kept per rule).
RULE_IDS = (
    "block_list", "amount", "confirmed_fraud_merchant", "allow_list", "degraded_amount", "score",
)  # fmt: skip


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
        **_merchant_rule(doc.get("confirmed_fraud_merchant"), source),
    )


def _merchant_rule(value: Any, source: object) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise RulesError(source, "'confirmed_fraud_merchant' must be an object")
    frauds = value.get("min_frauds")
    if isinstance(frauds, bool) or not isinstance(frauds, int) or frauds < 1:
        raise RulesError(source, f"'confirmed_fraud_merchant.min_frauds' must be an integer >= 1, got {frauds!r}")
    share = _probability(value.get("min_share"), "confirmed_fraud_merchant.min_share", source)
    return {"merchant_min_frauds": frauds, "merchant_min_share": share}


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


def evaluate_rules(
    rules: RuleSet, tx: Transaction, score: float | None, merchant: MerchantTally | None = None
) -> RuleOutcome:
    """The action for one transaction given its score (None when degraded) and
    its merchant's live label tally."""
    for field in LIST_FIELDS:
        value = getattr(tx, field)
        if value is not None and value in rules.block[field]:
            return RuleOutcome("decline", (f"blocked {field.removesuffix('_id')} {value}",), "block_list")
    amount = tx.amount_usd
    if amount > rules.force_review_amount_usd:
        hit = f"amount {amount:,.2f} USD over {rules.force_review_amount_usd:,.0f}"
        return _at_least_review(rules, score, hit, "amount")
    if (
        rules.merchant_min_frauds
        and merchant is not None
        and merchant.fraud >= rules.merchant_min_frauds
        and merchant.fraud_share >= rules.merchant_min_share
    ):
        hit = f"merchant {tx.merchant_id} has {merchant.fraud} confirmed frauds ({merchant.fraud_share:.0%} of its labels)"
        return _at_least_review(rules, score, hit, "confirmed_fraud_merchant")
    for field in LIST_FIELDS:
        value = getattr(tx, field)
        if value is not None and value in rules.allow[field]:
            return RuleOutcome("approve", (f"allowed {field.removesuffix('_id')} {value}",), "allow_list")
    if score is None:
        if amount > rules.degraded_review_amount_usd:
            return RuleOutcome(
                "review",
                (f"no model score: amount {amount:,.2f} USD over {rules.degraded_review_amount_usd:,.0f}",),
                "degraded_amount",
            )
        return RuleOutcome("approve", (), "degraded_amount")
    if score >= rules.decline_threshold:
        return RuleOutcome("decline", (f"score {score:.3f} at or above decline threshold {rules.decline_threshold}",))
    if score >= rules.review_threshold:
        return RuleOutcome("review", (f"score {score:.3f} at or above review threshold {rules.review_threshold}",))
    return RuleOutcome("approve", (f"score {score:.3f} below review threshold {rules.review_threshold}",))


def _at_least_review(rules: RuleSet, score: float | None, hit: str, rule: str) -> RuleOutcome:
    """A rule that puts a floor of ``review`` under the action. NOTE: when the
    score declines anyway, the score decided: its reason comes first and the
    decline is counted for ``score``, and the rule's hit is worded as the floor
    it is, so no explanation of a decline reads "forced review"."""
    if score is not None and score >= rules.decline_threshold:
        decided = f"score {score:.3f} at or above decline threshold {rules.decline_threshold}"
        return RuleOutcome("decline", (decided, f"{hit}: at least review"), "score")
    return RuleOutcome("review", (f"{hit}: forced review",), rule)
