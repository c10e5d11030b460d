"""The feature set's names and window constants, shared by the per-row serving
code (:mod:`pipeline.features`) and the vectorised training code
(:mod:`pipeline.batch_features`), so the two cannot drift apart."""

from __future__ import annotations

__all__ = [
    "DAY_S",
    "FEATURE_NAMES",
    "FEATURE_SET_VERSION",
    "HOME_WINDOW_DAYS",
    "MAX_KNOWN_DEVICES",
    "MERCHANT_LABEL_DELAY_DAYS",
    "PROFILE_WINDOWS_DAYS",
    "VELOCITY_MAX_EVENTS",
    "VELOCITY_WINDOWS_S",
]

#: Bump when a feature's definition changes: profiles in Redis and models in the
#: registry carry it, and a mismatch is refused rather than silently mis-scored.
FEATURE_SET_VERSION = "fs3"

DAY_S = 86400.0
PROFILE_WINDOWS_DAYS = (1, 7, 30)
VELOCITY_WINDOWS_S = (600.0, 3600.0, 86400.0)
#: Velocity counts and sums see at most the user's newest this many events up
#: to the transaction: what one transaction costs Redis and the worker stays
#: bounded when one card is hammered (card testing, a bot), where it grew with
#: the card's activity. A legitimate card makes a few payments a day.
VELOCITY_MAX_EVENTS = 32
MERCHANT_LABEL_DELAY_DAYS = 7
HOME_WINDOW_DAYS = 90
MAX_KNOWN_DEVICES = 16

FEATURE_NAMES: tuple[str, ...] = (
    "amount_usd",
    "log_amount",
    "is_night",
    "is_weekend",
    "user_count_1d",
    "user_count_7d",
    "user_count_30d",
    "user_mean_1d",
    "user_mean_7d",
    "user_mean_30d",
    "user_std_30d",
    "amount_ratio_30d",
    "amount_zscore_30d",
    "account_age_days",
    "distance_from_home_km",
    "new_device",
    "merchant_count_1d",
    "merchant_count_7d",
    "merchant_count_30d",
    "merchant_risk_1d",
    "merchant_risk_7d",
    "merchant_risk_30d",
    "merchant_last_label",
    "velocity_count_10m",
    "velocity_count_1h",
    "velocity_count_24h",
    "velocity_sum_10m",
    "velocity_sum_1h",
    "velocity_sum_24h",
)

