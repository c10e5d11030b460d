"""Rule backtest on stored feedback: flips per action and their labelled outcomes."""

from __future__ import annotations

from typing import Any

from app.contract import Transaction
from pipeline.backtest import backtest, format_backtest
from pipeline.labels import Label
from pipeline.rules import evaluate_rules, parse_rules

T0 = 1_790_000_000.0
BASE = {
    "version": "rules-a",
    "thresholds": {"review": 0.5, "decline": 0.9},
    "force_review_amount_usd": 10000,
    "degraded_review_amount_usd": 1000,
    "allow": {"user_id": [], "device_id": [], "merchant_id": []},
    "block": {"user_id": [], "device_id": [], "merchant_id": []},
}


def rules(**over: Any) -> Any:
    return parse_rules({**BASE, **over})


def feedback(txid: str, score: float, *, amount: float = 50.0, degraded: bool = False, at: float = T0,
             tally: dict[str, int] | None = None, device: str = "d-1") -> dict[str, Any]:  # fmt: skip
    """A feedback record as the scorer writes it, decided by the BASE rules."""
    tx = Transaction(txid, "u-1", amount, "m-1", at - 1.0, device_id=device)
    outcome = evaluate_rules(rules(), tx, None if degraded else score)
    return {
        "decision": {"transaction_id": txid, "fraud_score": score, "action": outcome.action, "degraded": degraded,
                     "rules_version": "rules-a", "decided_at": at, "model_version": None if degraded else "v1"},
        "transaction": {f: getattr(tx, f) for f in tx.__slots__},
        "rule": outcome.rule,
        "merchant_tally": tally,
    }  # fmt: skip


def test_the_same_rules_flip_nothing() -> None:
    records = [feedback(f"t{i}", i / 10) for i in range(10)]
    result = backtest(records, rules(), {})
    assert result.replayed == 10 and not result.flips
    assert "none: the proposal decides every replayed transaction as served" in format_backtest(result)


def test_a_lower_review_threshold_reports_flips_and_their_labelled_outcomes() -> None:
    # Scores 0.30..0.49 are approved today; a review threshold of 0.3 flags them.
    records = [feedback(f"t{i}", 0.30 + i / 100) for i in range(20)] + [feedback("high", 0.95)]
    labels = {f"t{i}": Label(f"t{i}", "fraud" if i < 3 else "legit", "chargeback", T0 + 86400) for i in range(8)}
    result = backtest(records, rules(thresholds={"review": 0.3, "decline": 0.9}), labels)
    assert result.flips == {("approve", "review"): 20}
    assert result.outcome("caught_fraud") == 3
    assert result.outcome("new_false_positives") == 5
    assert result.outcome("fraud_let_through") == 0
    assert (result.served["approve"], result.proposed["review"]) == (20, 20)
    text = format_backtest(result)
    assert "approve -> review       20   fraud    3  legit    5  unlabelled    12" in text


def test_raising_the_decline_threshold_lets_labelled_fraud_through_to_review() -> None:
    records = [feedback("a", 0.92), feedback("b", 0.95), feedback("c", 0.99)]
    labels = {"a": Label("a", "fraud", "analyst", T0), "b": Label("b", "legit", "analyst", T0)}
    result = backtest(records, rules(thresholds={"review": 0.5, "decline": 0.96}), labels)
    assert result.flips == {("decline", "review"): 2}
    assert result.flip_labels == {("decline", "review", "fraud"): 1, ("decline", "review", "legit"): 1}


def test_since_skips_older_decisions_and_duplicates_count_once() -> None:
    records = [feedback("old", 0.4, at=T0 - 86400), feedback("new", 0.4), feedback("new", 0.4)]
    result = backtest(records, rules(thresholds={"review": 0.3, "decline": 0.9}), {}, since=T0 - 3600)
    assert result.replayed == 1 and result.flips == {("approve", "review"): 1}


def test_degraded_decisions_replay_without_a_score_and_block_lists_apply() -> None:
    records = [feedback("deg", 0.0, amount=2000, degraded=True), feedback("dev", 0.1, device="d-bad")]
    proposal = rules(degraded_review_amount_usd=5000, block={"device_id": ["d-bad"]})
    result = backtest(records, proposal, {})
    assert result.flips == {("review", "approve"): 1, ("approve", "decline"): 1}


def test_the_merchant_tally_seen_at_decision_time_is_replayed() -> None:
    records = [feedback("m", 0.1, tally={"fraud": 4, "legit": 1})]
    result = backtest(records, rules(confirmed_fraud_merchant={"min_frauds": 3, "min_share": 0.5}), {})
    assert result.flips == {("approve", "review"): 1}
