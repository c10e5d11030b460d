"""The vectorised training features equal the serving code applied row by row."""

from __future__ import annotations

from zoneinfo import ZoneInfo

import numpy as np
import pandas as pd
import pytest

from pipeline.feature_defs import VELOCITY_MAX_EVENTS
from pipeline.features import DAY_S, FEATURE_NAMES, prepare_history, rowwise_matrix, training_matrix

D0 = 1_764_547_200.0  # 2025-12-01T00:00:00Z


def awkward_history(seed: int, with_labels: bool = True) -> pd.DataFrame:
    """Cases the per-row code handles one way and arrays could get wrong: equal
    timestamps, constant amounts (std 0), a user with 20 devices (the profile
    keeps 16), users last seen 100 days back, rows without device or location,
    merchants whose only labels are inside the delay."""
    rng = np.random.default_rng(seed)
    n = 1500
    ts = D0 - 120 * DAY_S + rng.uniform(0, 130 * DAY_S, n).round(3)
    ts[100:110] = ts[99]  # ties
    users = rng.integers(0, 40, n).astype(str)
    users[:30] = "old"  # seen long ago, then again in the window
    ts[:30] = D0 - 110 * DAY_S + np.arange(30) * 600.0
    ts[30] = D0 + 2 * DAY_S + 77.0
    users[30] = "old"
    users[200:250] = "bot"  # 50 payments in 6 minutes: past the velocity cap
    ts[200:250] = D0 + 2 * DAY_S + 500.0 + np.arange(50) * 7.0
    amount = rng.uniform(1, 300, n).round(2)
    amount[users == "7"] = 25.0  # constant spender
    devices = np.array([f"d{u}-{rng.integers(0, 3)}" for u in users], dtype=object)
    crowd = users == "3"
    devices[crowd] = [f"burner-{i % 20}" for i in range(int(crowd.sum()))]
    devices[rng.random(n) < 0.05] = None
    lat = rng.uniform(40, 50, n)
    lat[rng.random(n) < 0.05] = np.nan
    lon = rng.uniform(0, 10, n)
    if seed % 2:  # a longitude missing where the latitude is not: the medians' NaN-skipping path
        lon[rng.random(n) < 0.03] = np.nan
    df = pd.DataFrame({
        "transaction_id": [f"t{i}" for i in range(n)], "user_id": users, "amount": amount,
        "merchant_id": rng.integers(0, 25, n).astype(str), "device_id": devices, "lat": lat,
        "lon": lon, "timestamp": pd.to_datetime(ts, unit="s", utc=True),
        "currency": rng.choice(["USD", "EUR"], n),
    })  # fmt: skip
    df.loc[users == "7", "currency"] = "USD"
    if with_labels:
        df["label"] = (rng.random(n) < 0.08).astype(int)
    return df


def assert_same(a: np.ndarray, b: np.ndarray) -> None:
    assert a.shape == b.shape
    for i, name in enumerate(FEATURE_NAMES):
        np.testing.assert_allclose(a[:, i], b[:, i], rtol=1e-6, atol=1e-6, equal_nan=True, err_msg=name)


@pytest.mark.parametrize("seed", [0, 1])
def test_vectorised_features_equal_the_serving_code_row_by_row(seed: int) -> None:
    history = prepare_history(awkward_history(seed))
    start, end = D0 - 3 * DAY_S + 3600.0, D0 + 10 * DAY_S
    fast, fast_labels, fast_rows = training_matrix(history, start, end)
    slow, slow_labels, slow_rows = rowwise_matrix(history, start, end)
    assert len(fast) > 100
    assert_same(fast, slow)
    np.testing.assert_array_equal(fast_labels, slow_labels)
    assert fast_rows["transaction_id"].tolist() == slow_rows["transaction_id"].tolist()
    # The hard cases are really in the window.
    crowded = (fast_rows["user_id"] == "3").to_numpy()
    assert (fast[crowded, FEATURE_NAMES.index("new_device")] == 0).any()
    steady = (fast_rows["user_id"] == "7").to_numpy()
    assert (fast[steady, FEATURE_NAMES.index("user_std_30d")] == 0).any()
    old = (fast_rows["user_id"] == "old").to_numpy()
    assert fast[old, FEATURE_NAMES.index("account_age_days")][0] > 100
    last_label = fast[:, FEATURE_NAMES.index("merchant_last_label")]
    assert (last_label == 1).any() and (last_label == 0).any()
    bot = (fast_rows["user_id"] == "bot").to_numpy()
    assert fast[bot, FEATURE_NAMES.index("velocity_count_10m")].max() == VELOCITY_MAX_EVENTS


def test_equal_on_local_time_and_without_labels() -> None:
    history = prepare_history(awkward_history(2, with_labels=False))
    zone = ZoneInfo("America/New_York")
    start, end = D0 + 1 * DAY_S, D0 + 6 * DAY_S
    fast, _, _ = training_matrix(history, start, end, tz=zone)
    slow, _, _ = rowwise_matrix(history, start, end, zone)
    assert_same(fast, slow)
    assert (fast[:, FEATURE_NAMES.index("merchant_risk_30d")] == 0).all()  # no labels: no merchant risk
