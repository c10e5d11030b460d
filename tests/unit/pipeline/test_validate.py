"""Validation: every error code, with the field and a reason a person can act on."""

from __future__ import annotations

import orjson
import pytest

from app.contract import Transaction
from pipeline.validate import ERROR_CODES, Limits, Rejection, validate

NOW = 1_764_633_600.0  # 2025-12-02T00:00:00Z
STAMP = "2025-12-01T23:59:00Z"


def good(**changes: object) -> dict[str, object]:
    doc: dict[str, object] = {
        "transaction_id": "t-1",
        "user_id": "u-1",
        "amount": 42.5,
        "currency": "EUR",
        "merchant_id": "m-1",
        "merchant_category": "grocery",
        "device_id": "d-1",
        "lat": 48.1,
        "lon": 11.5,
        "country": "DE",
        "timestamp": STAMP,
    }
    doc.update(changes)
    return {k: v for k, v in doc.items() if v is not ...}


def check(doc: object) -> Transaction | Rejection:
    raw = doc if isinstance(doc, bytes) else orjson.dumps(doc)
    return validate(raw, NOW, Limits(max_message_bytes=4096))


def test_a_valid_transaction_parses_every_field() -> None:
    tx = check(good())
    assert isinstance(tx, Transaction)
    assert (tx.transaction_id, tx.user_id, tx.amount, tx.currency) == ("t-1", "u-1", 42.5, "EUR")
    assert tx.timestamp == NOW - 60
    assert tx.amount_usd == pytest.approx(42.5 * 1.08)


def test_optional_fields_may_be_absent() -> None:
    tx = check(good(currency=..., merchant_category=..., device_id=..., lat=..., lon=..., country=...))
    assert isinstance(tx, Transaction)
    assert tx.currency == "USD" and tx.device_id is None and tx.lat is None


@pytest.mark.parametrize(
    ("doc", "code", "field"),
    [
        (b"x" * 5000, "too_large", None),
        (b"{not json", "bad_json", None),
        (b'{"amount": NaN}', "bad_json", None),
        (b"[1, 2]", "not_an_object", None),
        (good(user_id=...), "missing_field", "user_id"),
        (good(amount=None), "missing_field", "amount"),
        (good(amount="12"), "wrong_type", "amount"),
        (good(amount=True), "wrong_type", "amount"),
        (good(user_id=7), "wrong_type", "user_id"),
        (good(device_id=["d"]), "wrong_type", "device_id"),
        (good(timestamp=1764633600), "wrong_type", "timestamp"),
        (good(amount=0), "out_of_range", "amount"),
        (good(amount=-5), "out_of_range", "amount"),
        (good(amount=1e300), "out_of_range", "amount"),
        (good(lat=91.0), "out_of_range", "lat"),
        (good(user_id="u" * 500), "out_of_range", "user_id"),
        (good(currency="XXX"), "unknown_currency", "currency"),
        (good(timestamp="yesterday"), "bad_timestamp", "timestamp"),
        (good(timestamp="2025-12-01T23:59:00"), "bad_timestamp", "timestamp"),
        (good(timestamp="9999-12-31T23:59:59Z"), "timestamp_out_of_window", "timestamp"),
        (good(timestamp="2025-11-20T00:00:00Z"), "timestamp_out_of_window", "timestamp"),
        (good(lon=...), "inconsistent", "lon"),
    ],
)
def test_each_problem_has_a_code_field_and_reason(doc: object, code: str, field: str | None) -> None:
    result = check(doc)
    assert isinstance(result, Rejection)
    assert (result.code, result.field) == (code, field)
    assert result.reason and len(result.reason) < 200


def test_every_error_code_is_covered_above() -> None:
    # Keeps the table in validate's docstring, the codes and these tests in step.
    import inspect

    source = inspect.getsource(test_each_problem_has_a_code_field_and_reason)
    params = inspect.getsource(__import__(__name__))
    assert all(f'"{code}"' in params for code in ERROR_CODES), source[:0]


def test_a_rejection_keeps_the_transaction_id_when_it_can_be_read() -> None:
    result = check(good(amount="lots"))
    assert isinstance(result, Rejection)
    assert result.transaction_id == "t-1" and result.user_id == "u-1"
    unreadable = check(good(transaction_id=12))
    assert isinstance(unreadable, Rejection) and unreadable.transaction_id is None
