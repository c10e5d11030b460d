"""Authentication, replay and rate limits inside the scoring flow (in-memory fakes)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import orjson

from pipeline.admission import Admission
from pipeline.auth import InMemoryReplayGuard, sign
from pipeline.cache import InMemoryDecisionCache
from pipeline.feature_store import InMemoryFeatureStore
from pipeline.ratelimit import InMemoryRateLimiter
from pipeline.scorer import Inbound, Scorer
from tests.factories import RULES, ConstantModel, tx_bytes

KEY = bytes(range(32))


def tx(i: int, user: str = "u-1") -> bytes:
    return tx_bytes(i, transaction_id=f"t-{i}", user_id=user, merchant_id="m-1")


def signed(value: bytes, offset: int, client: str = "pos-1", key: bytes = KEY, skew_ms: int = 0) -> Inbound:
    headers = sign(value, client, key, int(time.time() * 1000) + skew_ms)
    return Inbound(value, headers, time.time(), partition=0, offset=offset)


def scorer(cache: InMemoryDecisionCache | None = None, **admission: Any) -> Scorer:
    return Scorer(
        model=ConstantModel(0.05, version="low-1"), rules=RULES, store=InMemoryFeatureStore(),
        cache=cache or InMemoryDecisionCache(), admission=Admission(keys={"pos-1": KEY}, **admission),
    )


def run(s: Scorer, batch: list[Inbound]) -> tuple[list[dict], list[dict]]:
    async def score_and_remember() -> Any:
        out = await s.score_batch(batch)
        await s.cache.put_many(out.to_cache)  # what the agent does once decisions are delivered
        return out

    out = asyncio.run(score_and_remember())
    return [orjson.loads(v) for _, v, *_ in out.decisions], [orjson.loads(v) for _, v in out.dead_letters]


def test_signed_messages_are_scored_and_unsigned_ones_dead_lettered_without_a_decision() -> None:
    decisions, dlq = run(scorer(), [signed(tx(1), 1), Inbound(tx(2), {}, time.time(), 0, 2)])
    assert [d["transaction_id"] for d in decisions] == ["t-1"]
    assert decisions[0]["action"] == "approve"
    assert [r["error"]["code"] for r in dlq] == ["unauthenticated"]
    assert dlq[0]["transaction_id"] is None  # never answer for an unauthenticated sender


def test_bad_stale_and_unknown_signatures_say_which() -> None:
    tampered = signed(tx(1), 1)
    tampered = Inbound(tx(1).replace(b"11.0", b"99.0"), tampered.headers, time.time(), 0, 1)
    batch = [tampered, signed(tx(2), 2, skew_ms=-3_600_000), signed(tx(3), 3, client="pos-x")]
    decisions, dlq = run(scorer(), batch)
    assert decisions == []
    assert [r["error"]["code"] for r in dlq] == ["bad_signature", "stale_signature", "unauthenticated"]


def test_unsigned_traffic_only_when_allowed() -> None:
    decisions, dlq = run(scorer(allow_unsigned=True), [Inbound(tx(1), {}, time.time(), 0, 1)])
    assert len(decisions) == 1 and not dlq


def test_a_replay_is_refused_but_a_redelivery_is_not() -> None:
    # No cache: the guard alone must tell them apart.
    s = scorer(cache=InMemoryDecisionCache(ttl_s=0), replay=InMemoryReplayGuard())
    first = signed(tx(1), 10)
    run(s, [first])
    redelivered, _ = run(s, [Inbound(first.value, first.headers, time.time(), 0, 10)])
    replayed, dlq = run(s, [Inbound(first.value, first.headers, time.time(), 0, 11)])
    assert len(redelivered) == 1 and redelivered[0]["action"] == "approve"
    assert replayed == [] and dlq[0]["error"]["code"] == "replayed"


def test_over_the_rate_a_reject_decision_says_rate_limited_and_retry_can_pass() -> None:
    clock = [1000.0]
    limiter = InMemoryRateLimiter(100.0, 100.0, 1.0, 2.0, clock=lambda: clock[0])
    s = scorer(limiter=limiter)
    decisions, dlq = run(s, [signed(tx(i), i) for i in range(4)])
    actions = [d["action"] for d in decisions]
    assert actions.count("approve") == 2 and actions.count("reject") == 2
    limited = [d for d in decisions if d["action"] == "reject"]
    assert all(d["error"]["code"] == "rate_limited" for d in limited)
    assert {r["error"]["code"] for r in dlq} == {"rate_limited"}
    clock[0] += 5.0  # the bucket refills; the retried transaction is scored, not answered from cache
    retried, _ = run(s, [signed(tx(int(limited[0]["transaction_id"][2:])), 99)])
    assert retried[0]["action"] == "approve" and retried[0]["cached"] is False


def test_a_resend_is_answered_from_cache_without_spending_tokens() -> None:
    clock = [1000.0]
    s = scorer(limiter=InMemoryRateLimiter(100.0, 100.0, 0.001, 1.0, clock=lambda: clock[0]))
    first, _ = run(s, [signed(tx(1), 1)])
    again, _ = run(s, [signed(tx(1), 2)])
    assert first[0]["action"] == "approve" and again[0]["cached"] is True


def test_a_replay_of_a_decided_record_gets_a_copy_of_its_decision_and_no_dead_letter() -> None:
    s = scorer(replay=InMemoryReplayGuard())
    first = signed(tx(1), 10)
    decided, _ = run(s, [first])
    # The same signed bytes as another record (a replay, or a producer's retry), with another correlation id.
    replay = Inbound(first.value, {**first.headers, "correlation-id": b"replayer"}, time.time(), 0, 11)
    copies, dlq = run(s, [replay])
    assert dlq == []
    assert len(copies) == 1 and copies[0]["cached"] is True and copies[0]["correlation_id"] == "replayer"
    same = ("transaction_id", "action", "fraud_score", "explanation", "model_version", "decided_at")
    assert {k: copies[0][k] for k in same} == {k: decided[0][k] for k in same}


def test_rejects_with_a_readable_id_get_a_decision_and_a_dead_letter() -> None:
    """docs/contract.md, *Outcomes*: what each refusal produces, exactly."""
    limiter = InMemoryRateLimiter(100.0, 100.0, 1.0, 1.0, clock=lambda: 1000.0)
    s = scorer(limiter=limiter)
    bad = orjson.dumps({"transaction_id": "t-bad", "user_id": "u-2", "amount": "lots", "merchant_id": "m-1",
                        "timestamp": "2026-01-01T00:00:00Z"})  # fmt: skip
    unreadable = b"{not json"
    batch = [signed(tx(1), 1), signed(tx(2), 2), signed(bad, 3), signed(unreadable, 4), Inbound(tx(5), {}, 0.0, 0, 5)]
    decisions, dlq = run(s, batch)
    assert sorted((d["transaction_id"], d["action"]) for d in decisions) == [
        ("t-1", "approve"), ("t-2", "reject"), ("t-bad", "reject"),
    ]  # fmt: skip
    codes = sorted((r["transaction_id"], r["error"]["code"]) for r in dlq if r["transaction_id"])
    assert codes == [("t-2", "rate_limited"), ("t-bad", "wrong_type")]
    assert sorted(r["error"]["code"] for r in dlq if not r["transaction_id"]) == ["bad_json", "unauthenticated"]
    assert all("value_bytes" in r and "value_b64" in r for r in dlq)
