"""Features: hand-computed cases, point-in-time correctness, one code path."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pandas as pd
import pytest

from app.contract import Transaction
from pipeline.features import (
    DAY_S,
    FEATURE_NAMES,
    MERCHANT_FIELDS,
    PROFILE_FIELDS,
    MerchantRisk,
    UserProfile,
    available_features,
    build_merchant_risk,
    build_user_profiles,
    feature_row,
    haversine_km,
    prepare_history,
    training_matrix,
    velocity_from_events,
)

D0 = 1_764_547_200.0  # 2025-12-01T00:00:00Z, a Monday
F = {name: i for i, name in enumerate(FEATURE_NAMES)}


def frame(rows: list[tuple]) -> pd.DataFrame:
    cols = ["transaction_id", "user_id", "amount", "merchant_id", "device_id", "lat", "lon", "ts", "label"]
    df = pd.DataFrame(rows, columns=cols)
    df["timestamp"] = pd.to_datetime(df.pop("ts"), unit="s", utc=True)
    df["currency"] = "USD"
    return df


def test_haversine_matches_a_known_distance() -> None:
    # Paris - London is about 344 km.
    assert haversine_km(48.8566, 2.3522, 51.5074, -0.1278) == pytest.approx(344, abs=2)


def test_velocity_counts_and_sums_per_window() -> None:
    now = D0 + 10 * 3600
    times = np.array([now - 30, now - 900, now - 7200, now - 90000, now + 5])
    amounts = np.array([1.0, 2.0, 4.0, 8.0, 16.0])
    # 10 min: {now-30}; 1 h: + now-900; 24 h: + now-7200; now-90000 is out; the future one is out.
    assert velocity_from_events(times, amounts, now) == (1.0, 2.0, 3.0, 1.0, 3.0, 7.0)


def test_profile_hand_computed() -> None:
    df = frame(
        [
            ("a", "u", 10.0, "m", "d1", 48.0, 11.0, D0 - 20 * DAY_S, 0),
            ("b", "u", 30.0, "m", "d2", 48.2, 11.2, D0 - 3 * DAY_S, 0),
            ("c", "u", 50.0, "m", "d1", 48.4, 11.4, D0 - 3600, 0),
            ("late", "u", 999.0, "m", "d9", 10.0, 10.0, D0 + 60, 1),  # after as_of: must not count
        ]
    )
    profile = build_user_profiles(prepare_history(df), D0)["u"]
    assert (profile.count_1d, profile.count_7d, profile.count_30d) == (1, 2, 3)
    assert (profile.mean_1d, profile.mean_7d, profile.mean_30d) == (50.0, 40.0, 30.0)
    assert profile.std_30d == pytest.approx(np.std([10, 30, 50]))
    assert (profile.home_lat, profile.home_lon) == (48.2, 11.2)
    assert profile.devices == frozenset({"d1", "d2"})
    assert profile.first_seen == D0 - 20 * DAY_S and profile.as_of == D0


def test_feature_row_hand_computed() -> None:
    profile = UserProfile(1, 2, 3, 50.0, 40.0, 30.0, 10.0, 48.0, 11.0, frozenset({"d1"}), D0 - 10 * DAY_S, D0)
    tx = Transaction("t", "u", 120.0, "m", D0 + 5 * DAY_S + 3600, device_id="d-new", lat=49.0, lon=11.0)
    row = feature_row(tx, profile, None, (1.0, 2.0, 3.0, 120.0, 150.0, 200.0))
    assert row[F["amount_usd"]] == 120.0
    assert row[F["log_amount"]] == pytest.approx(math.log1p(120.0))
    assert row[F["is_night"]] == 1.0  # 01:00 UTC
    assert row[F["is_weekend"]] == 1.0  # D0 + 5 days is a Saturday
    assert row[F["amount_ratio_30d"]] == 4.0
    assert row[F["amount_zscore_30d"]] == 9.0
    assert row[F["account_age_days"]] == pytest.approx(15 + 1 / 24)
    assert row[F["distance_from_home_km"]] == pytest.approx(111.2, abs=0.5)
    assert row[F["new_device"]] == 1.0
    assert row[F["merchant_risk_7d"]] == 0.0
    assert row[F["velocity_count_24h"]] == 3.0 and row[F["velocity_sum_24h"]] == 200.0


def test_unknown_user_and_missing_optional_fields_give_nan_not_guesses() -> None:
    tx = Transaction("t", "u", 20.0, "m", D0)
    row = feature_row(tx, None, None, (1.0, 1.0, 1.0, 20.0, 20.0, 20.0))
    assert math.isnan(row[F["amount_ratio_30d"]]) and math.isnan(row[F["distance_from_home_km"]])
    assert math.isnan(row[F["new_device"]])  # no device given: unknown, not "new"
    assert row[F["user_count_30d"]] == 0.0


def test_merchant_risk_respects_the_label_delay() -> None:
    df = frame(
        [
            ("a", "u", 10.0, "m", "d", 48.0, 11.0, D0 - 10 * DAY_S, 1),  # known by D0 (10 > 7 days ago)
            ("b", "u", 10.0, "m", "d", 48.0, 11.0, D0 - 9 * DAY_S, 0),
            ("c", "u", 10.0, "m", "d", 48.0, 11.0, D0 - 2 * DAY_S, 1),  # label not known yet at D0
        ]
    )
    risk = build_merchant_risk(prepare_history(df), D0)["m"]
    assert risk.count_30d == 2 and risk.risk_30d == 0.5
    assert risk.count_1d == 0  # the window ends 7 days before D0
    assert risk.last_label == 0.0  # "b", the latest known; "c" is not known yet


def test_merchant_last_label_is_the_latest_known_transactions_in_both_paths() -> None:
    """A terminal compromised 9 days ago: its latest known transaction was a
    fraud, though its 30-day rate is diluted by the weeks before. Ties at the
    latest time count as a fraud if any of them was one."""
    rows = [
        ("a1", "u1", 10.0, "ma", "d", 48.0, 11.0, D0 - 25 * DAY_S, 0),
        ("a2", "u1", 10.0, "ma", "d", 48.0, 11.0, D0 - 20 * DAY_S, 0),
        ("a3", "u2", 10.0, "ma", "d", 48.0, 11.0, D0 - 8.5 * DAY_S, 1),
        ("a4", "u3", 10.0, "ma", "d", 48.0, 11.0, D0 - 3 * DAY_S, 0),  # within the delay: unknown
        ("b1", "u1", 10.0, "mb", "d", 48.0, 11.0, D0 - 20 * DAY_S, 1),
        ("b2", "u2", 10.0, "mb", "d", 48.0, 11.0, D0 - 9 * DAY_S, 0),
        ("c1", "u1", 10.0, "mc", "d", 48.0, 11.0, D0 - 12 * DAY_S, 0),
        ("c2", "u2", 10.0, "mc", "d", 48.0, 11.0, D0 - 12 * DAY_S, 1),  # same time as c1
        ("c3", "u3", 10.0, "mc", "d", 48.0, 11.0, D0 - 12 * DAY_S, 0),
        ("d1", "u1", 10.0, "md", "d", 48.0, 11.0, D0 - 40 * DAY_S, 1),  # older than the 30-day window
        *[(f"q{m}", "u9", 10.0, m, "d", 48.0, 11.0, D0 + 3600.0, 0) for m in ("ma", "mb", "mc", "md")],
    ]
    history = prepare_history(frame(rows))
    risk = build_merchant_risk(history, D0)
    assert {m: risk[m].last_label for m in ("ma", "mb", "mc")} == {"ma": 1.0, "mb": 0.0, "mc": 1.0}
    assert risk["ma"].risk_30d == 1 / 3 and "md" not in risk
    x, _, served = training_matrix(history, D0, D0 + DAY_S)
    got = dict(zip(served["merchant_id"], x[:, F["merchant_last_label"]]))
    assert got == {"ma": 1.0, "mb": 0.0, "mc": 1.0, "md": 0.0}


def test_training_features_never_see_the_future() -> None:
    """Changing everything after a transaction must not change its features."""
    rng = np.random.default_rng(0)
    n = 400
    rows = [
        (f"t{i}", f"u{i % 7}", float(rng.uniform(1, 200)), f"m{i % 5}", f"d{i % 3}", 48.0, 11.0,
         D0 - 40 * DAY_S + float(rng.uniform(0, 45 * DAY_S)), int(rng.random() < 0.1))
        for i in range(n)
    ]
    base = prepare_history(frame(rows))
    cut = D0 + 2 * DAY_S + 1234.0
    x1, _, rows1 = training_matrix(base, D0, cut)
    future = base.copy()
    later = future["ts"] > cut
    future.loc[later, "amount_usd"] *= 100
    future.loc[later, "amount"] *= 100
    future.loc[later, "label"] = 1 - future.loc[later, "label"]
    future.loc[later, "device_id"] = "d-other"
    x2, _, _ = training_matrix(future, D0, cut)
    assert len(rows1) > 10
    np.testing.assert_array_equal(x1, x2)


def test_available_features_drop_what_needs_missing_columns() -> None:
    names = available_features(["transaction_id", "user_id", "amount", "merchant_id", "timestamp"])
    assert "new_device" not in names and "distance_from_home_km" not in names
    assert "velocity_count_1h" in names
    assert available_features(FEATURE_NAMES + ("lat", "lon", "device_id")) == list(FEATURE_NAMES)


def test_profile_and_merchant_round_trip_through_their_redis_hashes_fields() -> None:
    profile = UserProfile(1, 2, 3, 1.5, 2.5, 3.5, float("nan"), 48.0, 11.0, frozenset({"a", "b"}), 1.0, 2.0)
    mapping = {k.encode(): v.encode() for k, v in profile.to_mapping().items()}
    assert set(mapping) == {f.encode() for f in PROFILE_FIELDS}  # HMGET reads every field written
    back = UserProfile.from_values([mapping[f.encode()] for f in PROFILE_FIELDS])  # as HMGET answers
    assert back.devices == profile.devices and back.count_30d == 3 and math.isnan(back.std_30d)
    assert back == replace(profile, std_30d=back.std_30d)
    risk = MerchantRisk(5, 40, 900, 0.0, 0.025, 0.0125, 1.0, 2.0)
    written = risk.to_mapping()
    assert set(written) == {*MERCHANT_FIELDS, "feature_set"}
    assert MerchantRisk.from_values([written[f].encode() for f in MERCHANT_FIELDS]) == risk
