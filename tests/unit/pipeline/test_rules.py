"""Business rules: evaluation order and file validation."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from app.contract import Transaction
from app.errors import RulesError
from pipeline.labels import Label, MerchantTally
from pipeline.rules import evaluate_rules, load_rules, parse_rules

RULES = {
    "version": "r1",
    "thresholds": {"review": 0.5, "decline": 0.9},
    "force_review_amount_usd": 10000,
    "degraded_review_amount_usd": 1000,
    "allow": {"user_id": ["u-vip"], "device_id": [], "merchant_id": []},
    "block": {"user_id": [], "device_id": ["d-bad"], "merchant_id": ["m-bad"]},
}


def tx(amount: float = 50.0, **kw: object) -> Transaction:
    base = dict(transaction_id="t", user_id="u-1", amount=amount, merchant_id="m-1", timestamp=0.0, device_id="d-1")
    base.update(kw)
    return Transaction(**base)  # type: ignore[arg-type]


rules = parse_rules(RULES)


@pytest.mark.parametrize(
    ("t", "score", "action"),
    [
        (tx(), 0.1, "approve"),
        (tx(), 0.6, "review"),
        (tx(), 0.95, "decline"),
        (tx(15000), 0.01, "review"),  # amount over 10,000 forces review
        (tx(15000), 0.95, "decline"),  # ...but a decline-level score still declines
        (tx(9000, currency="EUR"), 0.01, "approve"),  # 9,720 USD: under the limit
        (tx(9500, currency="GBP"), 0.01, "review"),  # 12,065 USD: over it
        (tx(device_id="d-bad"), 0.0, "decline"),  # block beats everything
        (tx(merchant_id="m-bad", user_id="u-vip"), 0.0, "decline"),  # block beats allow
        (tx(user_id="u-vip"), 0.99, "approve"),  # allow beats the score
        (tx(15000, user_id="u-vip"), 0.0, "review"),  # the amount rule beats allow
        (tx(50), None, "approve"),  # degraded: small amounts pass
        (tx(2000), None, "review"),  # degraded: larger amounts go to review
    ],
)
def test_evaluation_order(t: Transaction, score: float | None, action: str) -> None:
    assert evaluate_rules(rules, t, score).action == action


def test_a_decline_on_score_names_the_threshold_not_the_floor() -> None:
    for merchant_rule in (False, True):
        with_rule = parse_rules({**RULES, "confirmed_fraud_merchant": {"min_frauds": 1, "min_share": 0.5}})
        tally = _fraud_tally(2)
        outcome = (
            evaluate_rules(with_rule, tx(), 0.986, tally) if merchant_rule else evaluate_rules(rules, tx(15000), 0.986)
        )
        assert outcome.action == "decline" and outcome.rule == "score"
        assert outcome.hits[0] == "score 0.986 at or above decline threshold 0.9"
        assert outcome.hits[1].endswith(": at least review")
        assert not any("forced review" in hit for hit in outcome.hits)
    low = evaluate_rules(rules, tx(15000), 0.6)  # the floor set the action: its reason first
    assert (low.action, low.rule, low.hits) == ("review", "amount", ("amount 15,000.00 USD over 10,000: forced review",))


def _fraud_tally(frauds: int) -> MerchantTally:
    tally = MerchantTally()
    for i in range(frauds):
        tally.apply(Label(f"t{i}", "fraud", "analyst", 0.0, "m-1"))
    return tally


def test_rule_hits_are_in_words() -> None:
    outcome = evaluate_rules(rules, tx(15000), 0.1)
    assert outcome.hits and "15,000.00 USD" in outcome.hits[0]
    assert "blocked device d-bad" in evaluate_rules(rules, tx(device_id="d-bad"), 0.0).hits


@pytest.mark.parametrize(
    "change",
    [
        {"version": ""},
        {"thresholds": {"review": 0.9, "decline": 0.5}},
        {"thresholds": {"review": 1.5, "decline": 2}},
        {"force_review_amount_usd": -1},
        {"block": {"card": ["x"]}},
        {"allow": {"user_id": "u-1"}},
    ],
)
def test_bad_rules_are_refused_with_a_reason(change: dict[str, object]) -> None:
    with pytest.raises(RulesError) as err:
        parse_rules({**RULES, **change})
    assert err.value.reason


def test_the_shipped_rules_file_is_valid(tmp_path: Path) -> None:
    shipped = load_rules(Path(__file__).parents[3] / "config" / "rules.json")
    assert shipped.version and shipped.review_threshold <= shipped.decline_threshold
    broken = tmp_path / "rules.json"
    broken.write_text(json.dumps(RULES)[:-3])
    with pytest.raises(RulesError):
        load_rules(broken)


def test_a_merchant_with_confirmed_fraud_forces_review() -> None:
    from pipeline.labels import Label, MerchantTally

    with_rule = parse_rules({**RULES, "confirmed_fraud_merchant": {"min_frauds": 2, "min_share": 0.5}})
    tally = MerchantTally()
    for i, verdict in enumerate(["fraud", "legit", "fraud"]):
        tally.apply(Label(f"t{i}", verdict, "analyst", 0.0, "m-1"))
    assert (tally.fraud, tally.legit) == (2, 1)
    outcome = evaluate_rules(with_rule, tx(), 0.01, tally)
    assert outcome.action == "review" and "2 confirmed frauds" in outcome.hits[0]
    assert evaluate_rules(with_rule, tx(), 0.95, tally).action == "decline"
    assert evaluate_rules(rules, tx(), 0.01, tally).action == "approve"  # rule off without the setting
    one = MerchantTally()
    one.apply(Label("t", "fraud", "analyst", 0.0))
    assert evaluate_rules(with_rule, tx(), 0.01, one).action == "approve"  # below min_frauds


def test_a_redelivered_label_counts_once_and_a_changed_verdict_moves() -> None:
    from pipeline.labels import Label, MerchantTally, parse_label

    tally = MerchantTally()
    assert tally.apply(Label("t1", "fraud", "analyst", 0.0))
    assert not tally.apply(Label("t1", "fraud", "chargeback", 0.0))
    assert tally.apply(Label("t1", "legit", "analyst", 0.0))
    assert (tally.fraud, tally.legit) == (0, 1)
    assert MerchantTally.from_json(tally.to_json()) == tally
    assert isinstance(parse_label(b'{"transaction_id": "t", "label": "maybe"}'), str)
    parsed = parse_label(b'{"transaction_id": "t", "label": "fraud", "source": "customer", "merchant_id": "m"}')
    assert not isinstance(parsed, str) and parsed.merchant_id == "m"
