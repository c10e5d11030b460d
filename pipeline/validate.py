"""Validate raw message bytes into a :class:`Transaction` or a :class:`Rejection`.

Pure: no I/O, the clock is an argument. Every problem has a named code, the
field it concerns and a reason a person can act on. Codes:

============================  ==================================================
``too_large``                 the message exceeds ``max_message_bytes``
``bad_json``                  not valid UTF-8 JSON (NaN/Infinity are not JSON)
``not_an_object``             valid JSON, but not an object
``missing_field``             a required field is absent or null
``wrong_type``                a field has the wrong JSON type
``out_of_range``              a number or string is outside its allowed range
``unknown_currency``          ``currency`` is not in the supported list
``bad_timestamp``             ``timestamp`` is not ISO-8601 with a time zone
``timestamp_out_of_window``   ``timestamp`` is too far in the future or past
``inconsistent``              fields that go together disagree (lat without lon)
============================  ==================================================
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import orjson

from app.contract import CURRENCY_TO_USD, REQUIRED_FIELDS, Transaction

__all__ = ["ERROR_CODES", "Limits", "Rejection", "validate"]

ERROR_CODES: tuple[str, ...] = (
    "too_large",
    "bad_json",
    "not_an_object",
    "missing_field",
    "wrong_type",
    "out_of_range",
    "unknown_currency",
    "bad_timestamp",
    "timestamp_out_of_window",
    "inconsistent",
)

MAX_ID_LEN = 128
MAX_AMOUNT = 1_000_000_000.0
_ID_FIELDS = ("transaction_id", "user_id", "merchant_id")
_OPTIONAL_STR_FIELDS = ("merchant_category", "device_id", "country")


@dataclass(frozen=True, slots=True)
class Limits:
    max_message_bytes: int = 64 * 1024
    max_future_skew_s: float = 300.0
    max_age_s: float = 86400.0


@dataclass(frozen=True, slots=True)
class Rejection:
    """Why a message was refused. ``transaction_id`` is set when it could be read,
    so the payment system still gets a ``reject`` decision for it."""

    code: str
    field: str | None
    reason: str
    transaction_id: str | None = None
    user_id: str | None = None

    def to_dict(self) -> dict[str, str | None]:
        return {"code": self.code, "field": self.field, "reason": self.reason}


class _Invalid(Exception):
    def __init__(self, code: str, field: str | None, reason: str) -> None:
        self.code, self.field, self.reason = code, field, reason


def validate(raw: bytes, now: float, limits: Limits = Limits()) -> Transaction | Rejection:
    """Parse and check one message. ``now`` is epoch seconds."""
    if len(raw) > limits.max_message_bytes:
        return Rejection(
            "too_large", None, f"message is {len(raw)} bytes; the limit is {limits.max_message_bytes}"
        )
    try:
        doc = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        return Rejection("bad_json", None, f"not valid JSON: {exc}")
    if not isinstance(doc, dict):
        return Rejection("not_an_object", None, f"expected a JSON object, got {_json_type(doc)}")
    txid = _readable_id(doc.get("transaction_id"))
    user = _readable_id(doc.get("user_id"))
    try:
        return _check(doc, now, limits)
    except _Invalid as bad:
        return Rejection(bad.code, bad.field, bad.reason, txid, user)


def _check(doc: dict[str, Any], now: float, limits: Limits) -> Transaction:
    for name in REQUIRED_FIELDS:
        if doc.get(name) is None:
            raise _Invalid("missing_field", name, f"required field {name!r} is missing")
    ids = {name: _id(doc, name) for name in _ID_FIELDS}
    amount = _number(doc, "amount")
    if not (0 < amount <= MAX_AMOUNT):
        raise _Invalid("out_of_range", "amount", f"amount must be > 0 and <= {MAX_AMOUNT:,.0f}, got {amount}")
    currency = doc.get("currency", "USD")
    if currency is None:
        currency = "USD"
    if not isinstance(currency, str):
        raise _Invalid("wrong_type", "currency", f"currency must be a string, got {_json_type(currency)}")
    if currency not in CURRENCY_TO_USD:
        raise _Invalid("unknown_currency", "currency", f"currency {currency[:16]!r} is not supported")
    timestamp = _timestamp(doc.get("timestamp"))
    if timestamp > now + limits.max_future_skew_s:
        raise _Invalid(
            "timestamp_out_of_window", "timestamp",
            f"timestamp is {timestamp - now:,.0f} s in the future (limit {limits.max_future_skew_s:,.0f} s)",
        )
    if timestamp < now - limits.max_age_s:
        raise _Invalid(
            "timestamp_out_of_window", "timestamp",
            f"timestamp is {now - timestamp:,.0f} s old (limit {limits.max_age_s:,.0f} s)",
        )
    lat, lon = doc.get("lat"), doc.get("lon")
    if (lat is None) != (lon is None):
        raise _Invalid("inconsistent", "lat" if lat is None else "lon", "lat and lon must be given together")
    if lat is not None:
        lat = _number(doc, "lat")
        lon = _number(doc, "lon")
        if not -90.0 <= lat <= 90.0:
            raise _Invalid("out_of_range", "lat", f"lat must be in [-90, 90], got {lat}")
        if not -180.0 <= lon <= 180.0:
            raise _Invalid("out_of_range", "lon", f"lon must be in [-180, 180], got {lon}")
    optional = {name: _optional_str(doc, name) for name in _OPTIONAL_STR_FIELDS}
    return Transaction(
        transaction_id=ids["transaction_id"],
        user_id=ids["user_id"],
        amount=amount,
        merchant_id=ids["merchant_id"],
        timestamp=timestamp,
        currency=currency,
        lat=lat,
        lon=lon,
        **optional,
    )


def _json_type(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    return {str: "string", list: "array", dict: "object", type(None): "null"}.get(type(value), "value")


def _readable_id(value: Any) -> str | None:
    if isinstance(value, str) and 0 < len(value) <= MAX_ID_LEN and value.isprintable():
        return value
    return None


def _id(doc: dict[str, Any], name: str) -> str:
    value = doc[name]
    if not isinstance(value, str):
        raise _Invalid("wrong_type", name, f"{name} must be a string, got {_json_type(value)}")
    if not value or len(value) > MAX_ID_LEN or not value.isprintable():
        raise _Invalid("out_of_range", name, f"{name} must be 1-{MAX_ID_LEN} printable characters")
    return value


def _optional_str(doc: dict[str, Any], name: str) -> str | None:
    value = doc.get(name)
    if value is None:
        return None
    if not isinstance(value, str):
        raise _Invalid("wrong_type", name, f"{name} must be a string, got {_json_type(value)}")
    if len(value) > MAX_ID_LEN or not value.isprintable():
        raise _Invalid("out_of_range", name, f"{name} must be at most {MAX_ID_LEN} printable characters")
    return value


def _number(doc: dict[str, Any], name: str) -> float:
    value = doc[name]
    # bool is an int subclass in Python; true is not an amount.
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _Invalid("wrong_type", name, f"{name} must be a number, got {_json_type(value)}")
    number = float(value)
    if not math.isfinite(number):
        raise _Invalid("out_of_range", name, f"{name} must be finite")
    return number


def _timestamp(value: Any) -> float:
    if not isinstance(value, str):
        raise _Invalid("wrong_type", "timestamp", f"timestamp must be an ISO-8601 string, got {_json_type(value)}")
    try:
        parsed = datetime.fromisoformat(value)
    except ValueError:
        raise _Invalid("bad_timestamp", "timestamp", f"timestamp {value[:40]!r} is not ISO-8601") from None
    if parsed.tzinfo is None:
        raise _Invalid("bad_timestamp", "timestamp", "timestamp needs a time zone, e.g. a trailing 'Z'")
    return parsed.timestamp()
