"""Hostile input at the validation stage: any bytes give a Transaction or a Rejection."""

from __future__ import annotations

import orjson
from hypothesis import given, settings
from hypothesis import strategies as st

from app.contract import Transaction
from pipeline.validate import ERROR_CODES, Limits, Rejection, validate

NOW = 1_800_000_000.0
LIMITS = Limits(max_message_bytes=64 * 1024)

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=50),
    lambda children: st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=10), children, max_size=5),
    max_leaves=30,
)
field_values = (
    st.none() | st.booleans() | st.integers(min_value=-(10**30), max_value=10**30)
    | st.floats() | st.text() | st.lists(st.integers(), max_size=3) | st.just("9999-12-31T23:59:59Z")
    | st.just("2027-01-15T08:00:00+00:00") | st.just("\u202e\u0000\ud7ff") | st.just("x" * 200)
)
fields = ("transaction_id", "user_id", "amount", "currency", "merchant_id", "merchant_category",
          "device_id", "lat", "lon", "country", "timestamp")


def outcome_is_well_formed(result: object) -> None:
    assert isinstance(result, (Transaction, Rejection))
    if isinstance(result, Rejection):
        assert result.code in ERROR_CODES and result.reason
    else:
        assert result.amount > 0 and result.transaction_id


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=2048))
def test_any_bytes(raw: bytes) -> None:
    outcome_is_well_formed(validate(raw, NOW, LIMITS))


@settings(max_examples=300, deadline=None)
@given(json_values)
def test_any_json(doc: object) -> None:
    outcome_is_well_formed(validate(orjson.dumps(doc), NOW, LIMITS))


@settings(max_examples=500, deadline=None)
@given(st.fixed_dictionaries({}, optional={f: field_values for f in fields}))
def test_any_mix_of_field_values(doc: dict) -> None:
    try:
        raw = orjson.dumps(doc)
    except (TypeError, orjson.JSONEncodeError):
        raw = repr(doc).encode("utf-8", "surrogatepass")  # NaN, huge ints, lone surrogates: not JSON
    outcome_is_well_formed(validate(raw, NOW, LIMITS))


def test_numbers_json_cannot_hold() -> None:
    for raw in (b'{"amount": 1e400}', b'{"amount": 123456789012345678901234567890}', b'{"amount": -Infinity}'):
        outcome_is_well_formed(validate(raw, NOW, LIMITS))


def test_deep_nesting_and_megabyte_strings() -> None:
    deep = b"[" * 100_000 + b"]" * 100_000
    assert validate(deep, NOW, Limits(max_message_bytes=10**6)).code in ("bad_json", "not_an_object")  # type: ignore[union-attr]
    huge = orjson.dumps({"transaction_id": "t", "user_id": "u" * 1_000_000})
    assert validate(huge, NOW, LIMITS).code == "too_large"  # type: ignore[union-attr]
    big_but_allowed = orjson.dumps(
        {"transaction_id": "t", "user_id": "u" * 500_000, "amount": 1, "merchant_id": "m",
         "timestamp": "2027-01-15T08:00:00Z"}
    )
    result = validate(big_but_allowed, NOW, Limits(max_message_bytes=10**6))
    assert isinstance(result, Rejection) and (result.code, result.field) == ("out_of_range", "user_id")
