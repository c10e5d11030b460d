"""Reasons in words, from the transaction's own feature values."""

from __future__ import annotations

import math

import pytest

from pipeline.decide import describe_reason, explain
from pipeline.features import FEATURE_NAMES


def row(**values: float) -> list[float]:
    out = [0.0] * len(FEATURE_NAMES)
    for name, value in values.items():
        out[FEATURE_NAMES.index(name)] = value
    return out


@pytest.mark.parametrize(
    ("name", "values", "words"),
    [
        ("amount_ratio_30d", {"amount_ratio_30d": 8.2}, "amount 8.2x the 30-day average"),
        ("new_device", {"new_device": 1.0}, "new device"),
        ("distance_from_home_km", {"distance_from_home_km": 2300.4}, "2,300 km from home"),
        ("velocity_count_10m", {"velocity_count_10m": 12}, "12 transactions in the last 10 minutes"),
        ("velocity_sum_1h", {"velocity_sum_1h": 1234.5}, "1,234.50 USD spent in the last hour"),
        ("log_amount", {"amount_usd": 950.0}, "amount 950.00 USD"),
        ("is_night", {"is_night": 1.0}, "night-time transaction"),
        ("merchant_last_label", {"merchant_last_label": 1.0},
         "merchant's latest known transaction was a fraud (a week ago)"),
    ],
)
def test_reasons_read_like_sentences(name: str, values: dict[str, float], words: str) -> None:
    assert describe_reason(name, row(**values)) == words


def test_unknown_values_say_so() -> None:
    assert describe_reason("distance_from_home_km", row(distance_from_home_km=math.nan)).endswith("unknown")


def test_rule_hits_come_first_and_duplicates_go() -> None:
    words = explain(
        [("amount_usd", 2.0), ("log_amount", 1.0), ("new_device", 0.5)],
        row(amount_usd=15000.0, new_device=1.0),
        ["amount 15,000.00 USD over 10,000: forced review"],
    )
    assert words == ["amount 15,000.00 USD over 10,000: forced review", "amount 15,000.00 USD", "new device"]


def test_a_device_id_not_sent_is_not_an_unknown_new_device() -> None:
    from app.contract import Transaction
    from pipeline.features import UserProfile, feature_row

    profile = UserProfile(3, 10, 40, 20.0, 20.0, 20.0, 5.0, 48.1, 11.6, frozenset({"d-1"}), 0.0, 86400.0)
    for known in (profile, None):  # a known user and a new one
        tx = Transaction("t", "u", 15000.0, "m", 90000.0)  # no device_id
        features = feature_row(tx, known, None, [0.0] * 6)
        words = explain([("new_device", 0.4)], features, [])
        assert words == ["no device_id sent"], words
        assert not any("new device" in w for w in words)
