"""The transaction simulator: determinism, schema, and the shape of each fraud scenario."""

from __future__ import annotations

import json
import re
from datetime import UTC, datetime, timedelta
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from app.contract import CURRENCY_TO_USD, REQUIRED_FIELDS, TRAINING_COLUMNS
from tools.simulator import (
    LiveTransactions,
    Population,
    SimulationConfig,
    build_population,
    simulate,
    write_parquet,
)

END = datetime(2026, 3, 1, tzinfo=UTC)
SMALL = SimulationConfig(n_users=300, n_merchants=1000, days=35, seed=3, end=END)
HANDBOOK = ("amount_over_220", "compromised_terminal", "compromised_customer")
EXTRA = ("account_takeover", "card_testing")


@pytest.fixture(scope="module")
def df() -> pd.DataFrame:
    return simulate(SMALL, progress=False)


@pytest.fixture(scope="module")
def handbook_df() -> pd.DataFrame:
    return simulate(SimulationConfig(**{**SMALL.__dict__, "scenarios": "handbook"}), progress=False)


@pytest.fixture(scope="module")
def population() -> Population:
    return build_population(SMALL)


def haversine_km(
    lat1: np.ndarray, lon1: np.ndarray, lat2: np.ndarray, lon2: np.ndarray
) -> np.ndarray:
    # Written out again here rather than imported, so the test checks the simulator.
    p1, p2, dl = np.radians(lat1), np.radians(lat2), np.radians(lon2 - lon1)
    a = np.sin((p2 - p1) / 2) ** 2 + np.cos(p1) * np.cos(p2) * np.sin(dl / 2) ** 2
    return 2 * 6371.0 * np.arcsin(np.sqrt(a))


def usd(frame: pd.DataFrame) -> pd.Series:
    return frame["amount"] * frame["currency"].map(CURRENCY_TO_USD)


def bursts(rows: pd.DataFrame, gap: pd.Timedelta) -> list[pd.DataFrame]:
    """Rows of one user split wherever two consecutive ones are more than ``gap`` apart."""
    out = []
    for _, user_rows in rows.sort_values("timestamp").groupby("user_id"):
        burst_no = (user_rows["timestamp"].diff() > gap).cumsum()
        out += [b for _, b in user_rows.groupby(burst_no)]
    return out


# --- determinism ------------------------------------------------------------------------
def test_same_seed_gives_identical_frame(df: pd.DataFrame) -> None:
    pd.testing.assert_frame_equal(simulate(SMALL, progress=False), df)


def test_different_seed_gives_different_data(df: pd.DataFrame) -> None:
    other = simulate(SimulationConfig(**{**SMALL.__dict__, "seed": 4}), progress=False)
    assert len(other) != len(df) or not other["amount"].equals(df["amount"])
    assert set(other["transaction_id"]).isdisjoint(df["transaction_id"])


def test_population_does_not_depend_on_period(population: Population) -> None:
    cfg = SimulationConfig(n_users=300, n_merchants=1000, days=5, seed=3, end=END + timedelta(days=9))
    other = build_population(cfg)
    for name, value in population.__dict__.items():
        np.testing.assert_array_equal(getattr(other, name), value, err_msg=name)


def test_handbook_part_is_the_same_in_both_modes(
    df: pd.DataFrame, handbook_df: pd.DataFrame
) -> None:
    core = df[~df["scenario"].isin(EXTRA)].drop(columns="transaction_id").reset_index(drop=True)
    pd.testing.assert_frame_equal(core, handbook_df.drop(columns="transaction_id"))


# --- schema -------------------------------------------------------------------------------
def test_columns_and_dtypes(df: pd.DataFrame) -> None:
    assert list(df.columns) == [*TRAINING_COLUMNS, "scenario"]
    assert df["timestamp"].dtype == pd.DatetimeTZDtype("ms", "UTC")
    assert df["amount"].dtype == np.float64
    assert df["lat"].dtype == df["lon"].dtype == np.float64
    assert df["label"].dtype == np.int8
    text = ("transaction_id", "user_id", "currency", "merchant_id", "merchant_category")
    for col in (*text, "device_id", "country", "scenario"):
        assert pd.api.types.is_string_dtype(df[col]), col
    assert df.notna().all().all()


def test_values_follow_the_contract(df: pd.DataFrame, population: Population) -> None:
    assert df["transaction_id"].is_unique
    assert df["transaction_id"].str.fullmatch(r"t-[0-9a-f]{16}").all()
    assert df["merchant_id"].str.fullmatch(r"m-\d{6}").all()
    assert df["device_id"].str.fullmatch(r"d-[0-9a-f]+").all()
    assert df["user_id"].isin(population.user_id).all()
    assert df["currency"].isin(CURRENCY_TO_USD).all()
    assert (df["amount"] > 0).all()
    np.testing.assert_array_equal(df["amount"].round(2), df["amount"])
    assert df["lat"].between(40, 50).all() and df["lon"].between(-5, 15).all()


def test_timestamps_sorted_and_inside_the_period(df: pd.DataFrame) -> None:
    assert df["timestamp"].is_monotonic_increasing
    assert df["timestamp"].min() >= END - timedelta(days=SMALL.days)
    assert df["timestamp"].max() < END


def test_default_end_is_todays_utc_midnight() -> None:
    cfg = SimulationConfig(n_users=20, n_merchants=50, days=2, scenarios="handbook")
    out = simulate(cfg, progress=False)
    today = datetime.now(UTC).replace(hour=0, minute=0, second=0, microsecond=0)
    assert out["timestamp"].max() < today <= out["timestamp"].min() + timedelta(days=2)


def test_bad_scenarios_option_is_rejected() -> None:
    with pytest.raises(ValueError):
        SimulationConfig(scenarios="some")


# --- fraud scenarios ---------------------------------------------------------------------------
def test_every_scenario_in_all_mode(df: pd.DataFrame) -> None:
    assert set(df["scenario"]) == {"legit", *HANDBOOK, *EXTRA}
    assert ((df["scenario"] != "legit") == (df["label"] == 1)).all()


def test_only_handbook_scenarios_in_handbook_mode(handbook_df: pd.DataFrame) -> None:
    assert set(handbook_df["scenario"]) == {"legit", *HANDBOOK}


def test_fraud_rate_is_sane(df: pd.DataFrame, handbook_df: pd.DataFrame) -> None:
    # A small population has relatively more takeovers (at least one a day).
    assert 0.006 < df["label"].mean() < 0.04
    assert 0.003 < handbook_df["label"].mean() < 0.015


def test_amount_over_220_is_always_fraud(df: pd.DataFrame) -> None:
    assert (df.loc[usd(df) > 220, "label"] == 1).all()
    assert (usd(df[df["scenario"] == "amount_over_220"]) > 220).all()


def test_compromised_customer_amounts_are_inflated(df: pd.DataFrame) -> None:
    hit = df[df["scenario"] == "compromised_customer"]
    typical = df[df["scenario"] == "legit"].groupby("user_id")["amount"].median()
    assert (hit["amount"] > 2 * hit["user_id"].map(typical)).mean() > 0.8


def test_compromised_terminal_takes_every_transaction(df: pd.DataFrame) -> None:
    hit = df[df["scenario"] == "compromised_terminal"]
    window = hit.groupby("merchant_id")["timestamp"].agg(["min", "max"])
    assert ((window["max"] - window["min"]) < pd.Timedelta(days=28)).all()
    there = df.join(window, on="merchant_id", how="inner")
    inside = there[there["timestamp"].between(there["min"], there["max"])]
    assert (inside["label"] == 1).all()


def test_card_testing_is_bursts_of_small_amounts(df: pd.DataFrame) -> None:
    rows = df[df["scenario"] == "card_testing"]
    assert rows["amount"].between(0.01, 3.0).all()
    found = bursts(rows, pd.Timedelta(minutes=10))
    assert found
    for burst in found:
        assert 5 <= len(burst) <= 20
        assert burst["timestamp"].max() - burst["timestamp"].min() <= pd.Timedelta(minutes=10)
        assert burst["merchant_id"].nunique() >= 2


def test_account_takeover_uses_new_device_far_from_home(
    df: pd.DataFrame, population: Population
) -> None:
    rows = df[df["scenario"] == "account_takeover"]
    user = rows["user_id"].map({u: i for i, u in enumerate(population.user_id)}).to_numpy()
    home_lat, home_lon = population.user_lat[user], population.user_lon[user]
    km = haversine_km(home_lat, home_lon, rows["lat"].to_numpy(), rows["lon"].to_numpy())
    assert (km > 300).all()
    own = df[df["scenario"] != "account_takeover"].groupby("user_id")["device_id"].agg(set)
    for i, u, device in zip(user, rows["user_id"], rows["device_id"]):
        assert device not in set(population.devices_of(int(i)))
        assert device not in own.get(u, set())
    for burst in bursts(rows, pd.Timedelta(hours=1)):
        assert 2 <= len(burst) <= 6
        assert burst["device_id"].nunique() == 1
        assert burst["timestamp"].max() - burst["timestamp"].min() <= pd.Timedelta(hours=1)


# --- parquet ----------------------------------------------------------------------------------
def test_parquet_round_trip(df: pd.DataFrame, tmp_path: Path) -> None:
    path = tmp_path / "nested" / "tx.parquet"
    write_parquet(df, path)
    assert pq.read_schema(path).field("timestamp").type == pa.timestamp("ms", tz="UTC")
    pd.testing.assert_frame_equal(pd.read_parquet(path), df)


# --- live traffic -------------------------------------------------------------------------------
def test_live_transactions_follow_the_contract(population: Population) -> None:
    live = LiveTransactions(population, seed=1, fraud_rate=0.05)
    now = END.timestamp()
    txs, scenarios = [], []
    for i in range(3000):
        txs.append(live.next(now + i * 0.01))
        scenarios.append(live.last_scenario)
    ids = {u: i for i, u in enumerate(population.user_id)}
    merchants = set(population.merchant_id)
    for tx in txs:
        json.dumps(tx)
        assert all(tx.get(f) is not None for f in REQUIRED_FIELDS)
        assert tx["user_id"] in ids
        assert tx["currency"] == population.currency[ids[tx["user_id"]]]
        assert tx["merchant_id"] in merchants
        assert tx["amount"] > 0 and round(tx["amount"], 2) == tx["amount"]
        assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", tx["timestamp"])
    assert len({tx["transaction_id"] for tx in txs}) == len(txs)
    assert datetime.fromisoformat(txs[0]["timestamp"]) == END
    fraud_share = np.mean([s != "legit" for s in scenarios])
    assert 0.02 < fraud_share < 0.1
    assert {"amount_over_220", "account_takeover", "card_testing"} <= set(scenarios)


def test_live_transactions_are_reproducible(population: Population) -> None:
    def draws(seed: int) -> list[dict[str, object]]:
        live = LiveTransactions(population, seed=seed, fraud_rate=0.05)
        # transaction ids and fraudsters' devices are uuid4s: unique across runs on purpose.
        txs = [live.next(1e9) for _ in range(300)]
        return [{k: v for k, v in tx.items() if k not in ("transaction_id", "device_id")} for tx in txs]

    assert draws(5) == draws(5)
    assert draws(5) != draws(6)
