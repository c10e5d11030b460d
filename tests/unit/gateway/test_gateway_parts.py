"""The gateway's pure parts: API keys, signing, reply matching, the review queue, labels, OpenAPI."""

from __future__ import annotations

import asyncio
import base64
import time
from typing import Any

import orjson
import pytest

from app.contract import ACTIONS, OPTIONAL_FIELDS, REQUIRED_FIELDS
from app.settings import Settings
from gateway.openapi import openapi_document
from gateway.replies import Replies
from gateway.rest import ApiKeys, Signer, retry_after_header
from gateway.review import REVIEW_MARK, ReviewQueue, analyst_label
from pipeline.auth import verify
from pipeline.labels import parse_label
from pipeline.validate import ERROR_CODES

KEY = bytes(range(32))


# --- API keys --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "presented",
    [KEY.hex(), KEY.hex().upper(), base64.b64encode(KEY).decode(), base64.urlsafe_b64encode(KEY).decode().rstrip("=")],
)
def test_api_key_is_found_in_any_form_the_keys_file_accepts(presented: str) -> None:
    keys = ApiKeys({"acme": KEY, "other": bytes(32)})
    assert keys.client_of(presented) == "acme"
    assert keys.client_of(f"  {presented} ") == "acme"


@pytest.mark.parametrize("presented", [None, "", "not base64 !", KEY.hex()[:-2], (KEY + b"x").hex()])
def test_unknown_or_malformed_api_key_has_no_client(presented: str | None) -> None:
    assert ApiKeys({"acme": KEY}).client_of(presented) is None


def test_api_keys_load_from_env_spec() -> None:
    keys = ApiKeys.load(None, f"acme:{KEY.hex()},beta:{bytes(16).hex()}", "FRAUD_GATEWAY_KEYS")
    assert len(keys) == 2 and keys.client_of(bytes(16).hex()) == "beta"


# --- signing -------------------------------------------------------------------------------


def test_signed_messages_verify_as_the_gateway_and_never_share_a_signature() -> None:
    signer = Signer("gateway", KEY)
    value = b'{"transaction_id": "t-1"}'
    first, second = dict(signer.headers(value)), dict(signer.headers(value))  # same millisecond, likely
    for headers in (first, second):
        auth = verify(value, headers, {"gateway": KEY}, time.time(), 300.0)
        assert getattr(auth, "client_id", None) == "gateway", auth
    # Identical bodies must not look like a replay to the worker's guard.
    assert first["signature"] != second["signature"]
    assert int(second["signed-at"]) > int(first["signed-at"])


def test_signer_without_key_sends_no_auth_headers() -> None:
    assert Signer("gateway", None).headers(b"{}") == []


@pytest.mark.parametrize(("seconds", "header"), [(0.001, "1"), (1.0, "1"), (1.2, "2"), (19.99, "20")])
def test_retry_after_never_rounds_down(seconds: float, header: str) -> None:
    assert retry_after_header(seconds) == header


# --- reply matching -----------------------------------------------------------------------


def test_replies_resolve_the_request_with_the_same_correlation_id() -> None:
    settings = Settings(topic_decisions="dec", topic_dlq="dlq")

    async def scenario() -> None:
        replies = Replies(settings)
        waiting = replies.expect("c-1")
        other = replies.expect("c-2")
        # An old record, another producer's record and junk match nothing.
        assert not replies.deliver("dec", orjson.dumps({"transaction_id": "t-0", "correlation_id": "c-old"}))
        assert not replies.deliver("dec", orjson.dumps({"transaction_id": "t-0", "correlation_id": None}))
        assert not replies.deliver("dec", b"not json")
        assert replies.deliver("dec", orjson.dumps({"transaction_id": "t-1", "correlation_id": "c-1"}))
        outcome = await asyncio.wait_for(waiting, 1)
        assert (outcome.kind, outcome.record["transaction_id"]) == ("decision", "t-1")
        # A duplicate decision (a redelivery) finds nobody waiting any more.
        assert not replies.deliver("dec", orjson.dumps({"transaction_id": "t-1", "correlation_id": "c-1"}))
        dead = {"error": {"code": "bad_signature"}, "headers": {"correlation-id": base64.b64encode(b"c-2").decode()}}
        assert replies.deliver("dlq", orjson.dumps(dead))
        assert (await other).kind == "dead_letter"
        assert replies.pending == 0 and (replies.matched, replies.unmatched) == (2, 4)

    asyncio.run(scenario())


def test_a_forgotten_request_ignores_its_late_reply() -> None:
    async def scenario() -> None:
        replies = Replies(Settings(topic_decisions="dec"))
        replies.expect("c-1")
        replies.forget("c-1")
        assert not replies.deliver("dec", orjson.dumps({"correlation_id": "c-1"}))
        with pytest.raises(ValueError):
            replies.expect("c-2")
            replies.expect("c-2")

    asyncio.run(scenario())


# --- review queue and labels ---------------------------------------------------------------


def feedback(txid: str, action: str, decided_at: float, merchant: str = "m-1") -> dict[str, Any]:
    return {
        "decision": {"transaction_id": txid, "action": action, "fraud_score": 0.6, "decided_at": decided_at,
                     "explanation": ["score 0.600 at or above review threshold 0.5"]},
        "transaction": {"transaction_id": txid, "merchant_id": merchant, "amount": 10.0},
        "features": {"amount_usd": 10.0, "new_device": None},
    }  # fmt: skip


def test_review_queue_keeps_reviews_newest_first_and_bounded() -> None:
    queue = ReviewQueue(limit=2)
    assert not queue.add_feedback(feedback("t-approve", "approve", 5.0))
    assert not queue.add_feedback({"decision": "junk"})
    for txid, at in (("t-1", 1.0), ("t-3", 3.0), ("t-2", 2.0)):
        assert queue.add_feedback(feedback(txid, "review", at))
    listing = queue.listing()
    # Bounded by arrival: t-1 arrived first and was dropped; the rest newest first.
    assert [item["transaction_id"] for item in listing] == ["t-3", "t-2"]
    assert listing[0]["features"] == {"amount_usd": 10.0, "new_device": None}
    assert listing[0]["explanation"] and listing[0]["label"] is None


def test_review_pages_state_how_many_match_and_filter_by_score_and_age() -> None:
    queue = ReviewQueue(limit=500)
    for i in range(128):  # more than one page of the page's default 100
        doc = feedback(f"t-{i:03d}", "review", 1000.0 + i)
        doc["decision"]["fraud_score"] = 0.5 + i / 400
        queue.add_feedback(doc)
    first = queue.page(100, 0)
    assert (len(first["items"]), first["matching"], first["total"]) == (100, 128, 128)
    rest = queue.page(100, 100)
    assert len(rest["items"]) == 28 and rest["offset"] == 100
    seen = [item["transaction_id"] for item in first["items"] + rest["items"]]
    assert seen == [f"t-{i:03d}" for i in range(127, -1, -1)]  # every one, newest first, once
    risky = queue.page(100, 0, min_score=0.8)
    assert risky["matching"] == 8 and all(item["fraud_score"] >= 0.8 for item in risky["items"])
    recent = queue.page(100, 0, max_age_s=9.5, now=1127.0)
    assert [item["transaction_id"] for item in recent["items"]][-1] == "t-118" and recent["total"] == 128


def test_review_items_name_the_features_behind_their_reasons() -> None:
    doc = feedback("t-1", "review", 1.0)
    doc["decision"]["explanation"] = ["score 0.600 at or above review threshold 0.5", "no device_id sent",
                                      "amount 10.00 USD"]  # fmt: skip
    queue = ReviewQueue()
    queue.add_feedback(doc)
    assert queue.listing()[0]["reason_features"] == ["amount_usd", "new_device"]


def test_review_mark_matches_what_the_worker_writes() -> None:
    assert REVIEW_MARK in orjson.dumps(feedback("t-1", "review", 1.0))
    assert REVIEW_MARK not in orjson.dumps(feedback("t-1", "approve", 1.0))


def test_analyst_label_reads_back_as_agents_labels_parses_it() -> None:
    now = time.time()
    label = parse_label(analyst_label("t-9", "fraud", "m-7", now))
    assert not isinstance(label, str), label
    assert (label.transaction_id, label.label, label.source, label.merchant_id) == ("t-9", "fraud", "analyst", "m-7")
    assert label.labeled_at == pytest.approx(now, abs=0.001)
    assert set(orjson.loads(analyst_label("t-9", "legit", None, now))) == {
        "transaction_id", "label", "source", "labeled_at",
    }  # fmt: skip
    with pytest.raises(ValueError):
        analyst_label("t-9", "maybe", None, now)


def test_a_label_marks_its_review_item() -> None:
    queue = ReviewQueue()
    queue.add_feedback(feedback("t-1", "review", 1.0, merchant="m-42"))
    assert queue.merchant_of("t-1") == "m-42" and queue.merchant_of("t-x") is None
    label = parse_label(analyst_label("t-1", "legit", "m-42", 100.0))
    assert not isinstance(label, str)
    queue.add_label(label)
    assert queue.listing()[0]["label"] == {"label": "legit", "source": "analyst", "labeled_at": 100.0}


# --- OpenAPI ---------------------------------------------------------------------------------


def test_openapi_document_follows_the_contract() -> None:
    doc = orjson.loads(orjson.dumps(openapi_document("http://127.0.0.1:8080")))  # JSON-serialisable
    assert doc["openapi"] == "3.1.0"
    schemas = doc["components"]["schemas"]
    assert schemas["Transaction"]["required"] == list(REQUIRED_FIELDS)
    assert set(schemas["Transaction"]["properties"]) == set(REQUIRED_FIELDS) | set(OPTIONAL_FIELDS)
    assert schemas["Decision"]["properties"]["action"]["enum"] == list(ACTIONS)
    assert set(ERROR_CODES) | {"internal_error", "rate_limited"} <= set(schemas["ErrorDetail"]["properties"]["code"]["enum"])
    assert {"/v1/transactions", "/v1/review/decisions", "/v1/keys", "/healthz", "/openapi.json", "/review"} <= set(
        doc["paths"]
    )
    refs = {ref.split("/")[-1] for ref in _refs(doc)}
    assert refs <= set(schemas), refs - set(schemas)


def _refs(node: Any) -> list[str]:
    if isinstance(node, dict):
        return ([node["$ref"]] if "$ref" in node else []) + [r for v in node.values() for r in _refs(v)]
    if isinstance(node, list):
        return [r for v in node for r in _refs(v)]
    return []
