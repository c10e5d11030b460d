"""The Handbook's 15 baseline features (models/handbook_features.py): hand-computed
windows, and the Handbook's own pandas code on random data."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from models.handbook_features import HANDBOOK_FEATURE_NAMES, handbook_features

D = 86400.0
T0 = 1_700_006_400.0  # 2023-11-15 00:00 UTC, a Wednesday
F = {name: i for i, name in enumerate(HANDBOOK_FEATURE_NAMES)}


def frame(rows: list[tuple[str, str, float, float, int]]) -> pd.DataFrame:
    """(user, terminal, ts, amount, label) rows as prepare_history leaves them: sorted by ts."""
    df = pd.DataFrame(rows, columns=["user_id", "merchant_id", "ts", "amount_usd", "label"])
    return df.sort_values("ts", kind="stable").reset_index(drop=True)


def test_customer_windows_end_at_and_include_the_transaction() -> None:
    history = frame([
        ("c", "x", T0, 10.0, 0),
        ("c", "x", T0 + 0.5 * D, 20.0, 0),
        ("c", "x", T0 + 1.0 * D, 30.0, 0),  # exactly a day after the first: the first is out of its 1-day window
        ("o", "x", T0 + 1.1 * D, 999.0, 0),  # another customer: never counted for c
        ("c", "x", T0 + 6.9 * D, 40.0, 0),
    ])  # fmt: skip
    x = handbook_features(history, T0, T0 + 10 * D)
    c = history["user_id"].to_numpy() == "c"
    assert list(x[c, F["CUSTOMER_ID_NB_TX_1DAY_WINDOW"]]) == [1, 2, 2, 1]
    assert list(x[c, F["CUSTOMER_ID_AVG_AMOUNT_1DAY_WINDOW"]]) == [10, 15, 25, 40]
    assert list(x[c, F["CUSTOMER_ID_NB_TX_7DAY_WINDOW"]]) == [1, 2, 3, 4]
    assert list(x[c, F["CUSTOMER_ID_AVG_AMOUNT_7DAY_WINDOW"]]) == [10, 15, 20, 25]
    assert list(x[c, F["CUSTOMER_ID_NB_TX_30DAY_WINDOW"]]) == [1, 2, 3, 4]
    assert list(x[~c, F["CUSTOMER_ID_NB_TX_1DAY_WINDOW"]]) == [1]


def test_terminal_windows_end_a_delay_of_seven_days_back() -> None:
    t = T0 + 40 * D  # the scored transaction, at the terminal
    history = frame([
        ("a", "term", t - 38 * D, 1.0, 1),  # before t - 37 d: in no window
        ("b", "term", t - 37 * D, 1.0, 0),  # exactly t - d - 30: left edge, excluded
        ("c", "term", t - 20 * D, 1.0, 1),  # 30-day window
        ("d", "term", t - 10 * D, 1.0, 0),  # 7- and 30-day
        ("e", "term", t - 7.5 * D, 1.0, 1),  # all three
        ("f", "term", t - 7 * D, 1.0, 0),  # exactly t - d: right edge, included
        ("g", "term", t - 3 * D, 1.0, 1),  # inside the delay: not known yet
        ("h", "term", t, 5.0, 0),
    ])  # fmt: skip
    (row,) = handbook_features(history, t, t + 1)
    assert (row[F["TERMINAL_ID_NB_TX_1DAY_WINDOW"]], row[F["TERMINAL_ID_RISK_1DAY_WINDOW"]]) == (2, 0.5)
    assert (row[F["TERMINAL_ID_NB_TX_7DAY_WINDOW"]], row[F["TERMINAL_ID_RISK_7DAY_WINDOW"]]) == (3, pytest.approx(1 / 3))
    assert (row[F["TERMINAL_ID_NB_TX_30DAY_WINDOW"]], row[F["TERMINAL_ID_RISK_30DAY_WINDOW"]]) == (4, 0.5)
    assert row[F["TX_AMOUNT"]] == 5.0


def test_an_empty_terminal_window_has_risk_zero_and_weekend_and_night_are_the_handbooks() -> None:
    saturday_6_59 = T0 + 3 * D + 6 * 3600 + 59 * 60
    history = frame([("c", "new", saturday_6_59, 1.0, 0), ("c", "new", saturday_6_59 + 60, 1.0, 0)])
    x = handbook_features(history, T0, T0 + 10 * D)
    assert list(x[:, F["TERMINAL_ID_NB_TX_7DAY_WINDOW"]]) == [0, 0] and list(x[:, F["TERMINAL_ID_RISK_7DAY_WINDOW"]]) == [0, 0]
    assert list(x[:, F["TX_DURING_WEEKEND"]]) == [1, 1]
    assert list(x[:, F["TX_DURING_NIGHT"]]) == [1, 0]  # hour <= 6: 06:59 is night, 07:00 is not


def handbook_reference(df: pd.DataFrame) -> pd.DataFrame:
    """The Handbook's own feature code (chapter 3), on this frame's column names."""
    tx = df.assign(TX_DATETIME=pd.to_datetime(df["ts"], unit="s"), TRANSACTION_ID=np.arange(len(df)))

    def customer(g: pd.DataFrame) -> pd.DataFrame:
        g = g.sort_values("TX_DATETIME")
        g.index = g.TX_DATETIME
        for w in (1, 7, 30):
            total = g["amount_usd"].rolling(f"{w}d").sum()
            count = g["amount_usd"].rolling(f"{w}d").count()
            g[f"CUSTOMER_ID_NB_TX_{w}DAY_WINDOW"] = list(count)
            g[f"CUSTOMER_ID_AVG_AMOUNT_{w}DAY_WINDOW"] = list(total / count)
        g.index = g.TRANSACTION_ID
        return g

    def terminal(g: pd.DataFrame, delay: int = 7) -> pd.DataFrame:
        g = g.sort_values("TX_DATETIME")
        g.index = g.TX_DATETIME
        fraud_delay = g["label"].rolling(f"{delay}d").sum()
        count_delay = g["label"].rolling(f"{delay}d").count()
        for w in (1, 7, 30):
            fraud = g["label"].rolling(f"{delay + w}d").sum() - fraud_delay
            count = g["label"].rolling(f"{delay + w}d").count() - count_delay
            g[f"TERMINAL_ID_NB_TX_{w}DAY_WINDOW"] = list(count)
            g[f"TERMINAL_ID_RISK_{w}DAY_WINDOW"] = list(fraud / count)
        g.index = g.TRANSACTION_ID
        return g.fillna(0)

    parts = [customer(g) for _, g in tx.groupby("user_id")]
    out = pd.concat(parts).sort_index()
    parts = [terminal(g) for _, g in tx.groupby("merchant_id")]
    terminals = pd.concat(parts).sort_index()
    for name in HANDBOOK_FEATURE_NAMES:
        if name.startswith("TERMINAL"):
            out[name] = terminals[name]
    out["TX_AMOUNT"] = out["amount_usd"]
    out["TX_DURING_WEEKEND"] = (out["TX_DATETIME"].dt.weekday >= 5).astype(float)
    out["TX_DURING_NIGHT"] = (out["TX_DATETIME"].dt.hour <= 6).astype(float)
    return out


def test_equals_the_handbooks_own_code_on_random_transactions() -> None:
    rng = np.random.default_rng(7)
    n = 3000
    ts = np.sort(T0 + np.floor(rng.uniform(0, 60 * D, n)))  # whole seconds, as the Handbook's datetimes
    ts[100:110] = ts[99]  # ties
    ts[500] = ts[400] + D  # a window edge hit exactly
    ts = np.sort(ts)
    df = frame([(f"c{rng.integers(40)}", f"t{rng.integers(25)}", float(t), float(rng.uniform(1, 300)), int(rng.random() < 0.1))
                for t in ts])  # fmt: skip
    start = T0 + 35 * D
    ours = handbook_features(df, start, T0 + 61 * D)
    reference = handbook_reference(df)[list(HANDBOOK_FEATURE_NAMES)].to_numpy()[df["ts"].to_numpy() >= start]
    np.testing.assert_allclose(ours, reference, rtol=1e-9, atol=1e-9)
