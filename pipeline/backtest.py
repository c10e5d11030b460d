"""Rule backtest: what a proposed rules file would have decided on past traffic.

Each ``feedback`` record holds the decision as served, the transaction, its
score and the merchant's live tally at decision time — all
that :func:`pipeline.rules.evaluate_rules` reads. Re-evaluating a proposed
:class:`RuleSet` on them is therefore exact: the same function, the same
inputs, only the rules differ. Degraded decisions are re-evaluated without a
score, as they were served.

Flips are counted per (served action -> proposed action) and, where a label is
known, split by it. In words:

* **caught fraud**: approve -> review/decline on a transaction labelled fraud;
* **new false positives**: approve -> review/decline on one labelled legit;
* **fraud let through**: review/decline -> approve, labelled fraud;
* **false positives removed**: review/decline -> approve, labelled legit.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from app.contract import Transaction
from pipeline.labels import Label, MerchantTally
from pipeline.rules import RuleSet, evaluate_rules

__all__ = ["BacktestResult", "backtest", "format_backtest"]

FLAGGING = ("review", "decline")
ACTION_ORDER = ("approve", "review", "decline")


@dataclass
class BacktestResult:
    rules_version: str
    since: float | None
    replayed: int = 0
    skipped: int = 0
    """Records without a transaction (older feedback) or before ``since``."""
    served_rules: Counter[str] = field(default_factory=Counter)
    served: Counter[str] = field(default_factory=Counter)
    proposed: Counter[str] = field(default_factory=Counter)
    flips: Counter[tuple[str, str]] = field(default_factory=Counter)
    """(served action, proposed action) -> count, only where they differ."""
    flip_labels: Counter[tuple[str, str, str]] = field(default_factory=Counter)
    """(served, proposed, label) for labelled flips."""
    labelled: Counter[tuple[str, str]] = field(default_factory=Counter)
    """(proposed action, label) over every labelled record: the proposal's quality."""
    labelled_served: Counter[tuple[str, str]] = field(default_factory=Counter)

    def outcome(self, name: str) -> int:
        def flagged(action: str) -> bool:
            return action in FLAGGING

        picks: dict[str, tuple[Callable[[str, str], bool], str]] = {
            "caught_fraud": (lambda s, p: not flagged(s) and flagged(p), "fraud"),
            "new_false_positives": (lambda s, p: not flagged(s) and flagged(p), "legit"),
            "fraud_let_through": (lambda s, p: flagged(s) and not flagged(p), "fraud"),
            "false_positives_removed": (lambda s, p: flagged(s) and not flagged(p), "legit"),
        }
        test, label = picks[name]
        counts = [n for (s, p, lb), n in self.flip_labels.items() if lb == label and test(s, p)]
        return sum(counts, 0)

    def to_dict(self) -> dict[str, Any]:
        return {
            "rules_version": self.rules_version,
            "since": self.since,
            "replayed": self.replayed,
            "skipped": self.skipped,
            "served": dict(self.served),
            "proposed": dict(self.proposed),
            "flips": {f"{s}->{p}": n for (s, p), n in sorted(self.flips.items())},
            "outcomes": {k: self.outcome(k) for k in
                         ("caught_fraud", "new_false_positives", "fraud_let_through", "false_positives_removed")},
        }  # fmt: skip


def backtest(
    feedback: Iterable[Mapping[str, Any]],
    rules: RuleSet,
    labels: Mapping[str, Label],
    since: float | None = None,
) -> BacktestResult:
    result = BacktestResult(rules.version, since)
    seen: set[str] = set()
    for doc in feedback:
        decision, txdoc = doc.get("decision") or {}, doc.get("transaction")
        txid = decision.get("transaction_id")
        if not isinstance(txdoc, dict) or not txid or txid in seen:
            result.skipped += txid not in seen
            continue
        seen.add(txid)
        if since is not None and float(decision.get("decided_at") or 0.0) < since:
            result.skipped += 1
            continue
        tx = Transaction(**txdoc)
        score = None if decision.get("degraded") else float(decision["fraud_score"])
        tally = doc.get("merchant_tally")
        merchant = MerchantTally(int(tally["fraud"]), int(tally["legit"])) if tally else None
        served, proposed = decision["action"], evaluate_rules(rules, tx, score, merchant).action
        result.replayed += 1
        result.served_rules[str(decision.get("rules_version"))] += 1
        result.served[served] += 1
        result.proposed[proposed] += 1
        label = labels.get(txid)
        if proposed != served:
            result.flips[(served, proposed)] += 1
            if label is not None:
                result.flip_labels[(served, proposed, label.label)] += 1
        if label is not None:
            result.labelled[(proposed, label.label)] += 1
            result.labelled_served[(served, label.label)] += 1
    return result


def _pr(labelled: Counter[tuple[str, str]]) -> tuple[str, str]:
    flagged = [lb for (a, lb), n in labelled.items() for _ in range(n) if a in FLAGGING]
    frauds = sum(n for (_, lb), n in labelled.items() if lb == "fraud")
    caught = flagged.count("fraud")
    precision = f"{caught / len(flagged):.3f}" if flagged else "-"
    recall = f"{caught / frauds:.3f}" if frauds else "-"
    return precision, recall


def format_backtest(result: BacktestResult) -> str:
    served_rules = ", ".join(f"{v} ({n})" for v, n in result.served_rules.most_common())
    lines = [
        f"Backtest of rules {result.rules_version} on {result.replayed} replayed decisions "
        f"(served with {served_rules or 'nothing'}; {result.skipped} skipped)",
        "",
        f"{'action':<10} {'served':>8} {'proposed':>9} {'change':>8}",
    ]
    for action in ACTION_ORDER:
        s, p = result.served[action], result.proposed[action]
        lines.append(f"{action:<10} {s:>8} {p:>9} {p - s:>+8}")
    lines += ["", "Flips (served -> proposed): count, then labelled fraud / legit / unlabelled"]
    if not result.flips:
        lines.append("  none: the proposal decides every replayed transaction as served")
    for (served, proposed), n in sorted(result.flips.items(), key=lambda kv: (-kv[1], kv[0])):
        fraud = result.flip_labels[(served, proposed, "fraud")]
        legit = result.flip_labels[(served, proposed, "legit")]
        lines.append(f"  {served:>8} -> {proposed:<8} {n:>6}   fraud {fraud:>4}  legit {legit:>4}  unlabelled {n - fraud - legit:>5}")
    lines += [
        "",
        "Labelled outcomes of the flips:",
        f"  caught fraud (approve -> flagged, fraud):           {result.outcome('caught_fraud')}",
        f"  new false positives (approve -> flagged, legit):    {result.outcome('new_false_positives')}",
        f"  fraud let through (flagged -> approve, fraud):      {result.outcome('fraud_let_through')}",
        f"  false positives removed (flagged -> approve, legit): {result.outcome('false_positives_removed')}",
    ]
    sp, sr = _pr(result.labelled_served)
    pp, pr = _pr(result.labelled)
    n_lab = sum(result.labelled.values())
    lines += ["", f"On the {n_lab} labelled decisions, flagged = review or decline:",
              f"  served:   precision {sp}  recall {sr}", f"  proposed: precision {pp}  recall {pr}"]  # fmt: skip
    return "\n".join(lines)
