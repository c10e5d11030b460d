"""Which simulated frauds no model can see when it scores them (bench.model_ceiling)."""

from __future__ import annotations

import pandas as pd
import pytest

from bench.model_ceiling import ceiling_report, undetectable
from pipeline.features import DAY_S

D0 = 20_000 * DAY_S  # a UTC midnight


def test_a_terminal_fraud_is_undetectable_until_its_compromise_has_a_known_fraud() -> None:
    at = D0 + 3600.0
    rows = pd.DataFrame(
        [
            ("m1", at, "compromised_terminal"),  # a terminal fraud 10 days back is known (delay 7)
            ("m2", at, "compromised_terminal"),  # its only earlier fraud is 3 days back: not known yet
            ("m3", at, "compromised_terminal"),  # 40 days back: outside the 30-day window
            ("m4", at, "compromised_customer"),  # the customer's pattern is in the row itself
            ("m5", at, "legit"),
        ],
        columns=["merchant_id", "ts", "scenario"],
    )
    terminal_frauds = pd.DataFrame(
        [("m1", D0 - 10 * DAY_S), ("m2", D0 - 3 * DAY_S), ("m3", D0 - 40 * DAY_S)], columns=["merchant_id", "ts"]
    )
    assert undetectable(rows, terminal_frauds).tolist() == [False, True, True, False, False]


def test_the_report_refuses_data_that_does_not_say_which_fraud_is_which() -> None:
    with pytest.raises(ValueError, match="scenario"):
        ceiling_report(pd.DataFrame({"transaction_id": ["t"]}), pd.DataFrame({"transaction_id": ["t"]}))


def _terminal_week() -> tuple[pd.DataFrame, pd.DataFrame]:
    """A data file (scenario as the simulator names it) and its test scores: on
    terminal m1 a fraud known 10 days back and one today; on m2 a first fraud
    today, which nothing known could point at."""
    rows = [
        ("t0", "u0", "m1", D0 - 10 * DAY_S, 1, "compromised_terminal"),
        ("t1", "u1", "m1", D0 + 3600.0, 1, "compromised_terminal"),
        ("t2", "u2", "m2", D0 + 3600.0, 1, "compromised_terminal"),
        ("t3", "u3", "m3", D0 + 7200.0, 1, "amount_over_220"),
        *((f"l{i}", f"u{10 + i}", "m3", D0 + 100.0 * i, 0, "legit") for i in range(20)),
    ]  # fmt: skip
    data = pd.DataFrame(rows, columns=["transaction_id", "user_id", "merchant_id", "ts", "label", "scenario"])
    data = data.assign(amount=10.0, timestamp=data.pop("ts"))
    test = data[data["timestamp"] >= D0]
    scores = pd.DataFrame({
        "transaction_id": test["transaction_id"], "user_id": test["user_id"], "ts": test["timestamp"],
        "label": test["label"], "evaluated": True, "ensemble": test["label"] * 0.5 + 0.1,
    })  # fmt: skip
    return data, scores


def test_the_handbooks_integer_scenario_codes_read_as_the_simulators_names() -> None:
    """The Handbook's files hold TX_FRAUD_SCENARIO as 0-3 (legit, amount > 220,
    compromised terminal, compromised customer): the same report as with names."""
    data, scores = _terminal_week()
    by_name = ceiling_report(scores, data, bootstrap=0)
    assert by_name["undetectable_frauds"] == 1  # t2: its terminal had no known fraud
    codes = {"legit": 0, "amount_over_220": 1, "compromised_terminal": 2, "compromised_customer": 3}
    coded = data.assign(scenario=data["scenario"].map(codes).astype("int64"))
    assert ceiling_report(scores, coded, bootstrap=0) == by_name


@pytest.mark.parametrize("scenario", [7, -1, 2.5, "compromised terminal"])
def test_a_scenario_that_is_no_known_one_is_refused_not_read_as_legit(scenario: object) -> None:
    data, scores = _terminal_week()
    data["scenario"] = data["scenario"].astype(object)
    data.loc[0, "scenario"] = scenario
    if not isinstance(scenario, str):
        data["scenario"] = pd.to_numeric(data["scenario"].map(
            {"legit": 0, "amount_over_220": 1, "compromised_terminal": 2}).fillna(scenario))  # fmt: skip
    with pytest.raises(ValueError, match="scenario"):
        ceiling_report(scores, data, bootstrap=0)
