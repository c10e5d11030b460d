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
