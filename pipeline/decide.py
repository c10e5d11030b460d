"""Decision assembly: model reasons in words, rule hits, the decision record."""

from __future__ import annotations

import math
from collections.abc import Sequence

from pipeline.features import FEATURE_NAMES

__all__ = ["describe_reason", "explain"]

_WINDOW_WORDS = {
    "10m": "the last 10 minutes",
    "1h": "the last hour",
    "24h": "the last 24 hours",
    "1d": "1 day",
    "7d": "7 days",
    "30d": "30 days",
}
_INDEX = {name: i for i, name in enumerate(FEATURE_NAMES)}
#: Features that are NaN only because an optional field was not sent, in words.
_NOT_SENT = {"new_device": "no device_id sent"}


def describe_reason(name: str, row: Sequence[float]) -> str:
    """One model reason in words, using the transaction's own feature values."""
    value = float(row[_INDEX[name]])
    if math.isnan(value) and name in _NOT_SENT:
        # NOTE: NaN here only means the client left the field out
        # (pipeline/features.py); "new device unknown" read as a suspicious device.
        return _NOT_SENT[name]
    if math.isnan(value):
        return f"{name.replace('_', ' ')} unknown"
    window = _WINDOW_WORDS.get(name.rsplit("_", 1)[-1], "")
    if name in ("amount_usd", "log_amount"):
        return f"amount {row[_INDEX['amount_usd']]:,.2f} USD"
    if name == "amount_ratio_30d":
        return f"amount {value:.1f}x the 30-day average"
    if name == "amount_zscore_30d":
        return f"amount {value:+.1f} standard deviations from the 30-day average"
    if name == "distance_from_home_km":
        return f"{value:,.0f} km from home"
    if name == "new_device":
        return "new device" if value >= 0.5 else "known device"
    if name == "is_night":
        return "night-time transaction" if value >= 0.5 else "daytime transaction"
    if name == "is_weekend":
        return "weekend transaction" if value >= 0.5 else "weekday transaction"
    if name == "account_age_days":
        return f"account {value:,.0f} days old"
    if name.startswith("velocity_count"):
        return f"{value:,.0f} transactions in {window}"
    if name.startswith("velocity_sum"):
        return f"{value:,.2f} USD spent in {window}"
    if name == "merchant_last_label":
        return (
            "merchant's latest known transaction was a fraud (a week ago)" if value >= 0.5
            else "merchant's latest known transaction was legitimate (a week ago)"
        )  # fmt: skip
    if name.startswith("merchant_risk"):
        return f"merchant fraud rate {value:.0%} over {window} (labels a week old)"
    if name.startswith("merchant_count"):
        return f"merchant volume {value:,.0f} transactions over {window} (a week ago)"
    if name.startswith("user_count"):
        return f"{value:,.0f} transactions by the user over the previous {window}"
    if name.startswith("user_mean"):
        return f"user's average {value:,.2f} USD over {window}"
    if name == "user_std_30d":
        return f"user's 30-day amount spread {value:,.2f} USD"
    return name.replace("_", " ")


def explain(
    reasons: Sequence[tuple[str, float]], row: Sequence[float], rule_hits: Sequence[str]
) -> list[str]:
    """Rule hits first (they decided), then the model's top reasons, de-duplicated."""
    words = list(rule_hits)
    for name, _ in reasons:
        text = describe_reason(name, row)
        if text not in words:
            words.append(text)
    return words
