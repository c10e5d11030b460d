"""PSI against the training reference: stable traffic stays low, shifted traffic warns."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from pipeline.drift import DriftMonitor, build_reference, psi
from pipeline.features import FEATURE_NAMES

AMOUNT = FEATURE_NAMES.index("amount_usd")


def matrix(rng: np.random.Generator, n: int, amount_scale: float = 1.0) -> np.ndarray:
    m = rng.random((n, len(FEATURE_NAMES)), dtype=np.float32)
    m[:, AMOUNT] = rng.lognormal(3.5, 1.0, n) * amount_scale
    return m


def test_psi_is_zero_for_identical_shares_and_grows_with_the_shift() -> None:
    ref = [0.1] * 10
    assert psi(ref, [100] * 10) == pytest.approx(0.0, abs=1e-9)
    small = psi(ref, [120, 80] + [100] * 8)
    large = psi(ref, [500, 500] + [0] * 8)
    assert 0 < small < 0.1 < 1.0 < large


def test_reference_bins_are_deciles_and_missing_values_have_their_own_bin() -> None:
    rng = np.random.default_rng(1)
    m = matrix(rng, 10_000)
    m[:500, AMOUNT] = np.nan
    ref = build_reference(m, rng.random(10_000), ["amount_usd"])["items"]
    assert len(ref["amount_usd"]["edges"]) == 9
    assert ref["amount_usd"]["shares"][-1] == pytest.approx(0.05)
    assert sum(ref["score"]["shares"]) == pytest.approx(1.0)


def test_a_window_of_the_reference_population_is_stable(caplog: pytest.LogCaptureFixture) -> None:
    rng = np.random.default_rng(2)
    reference = build_reference(matrix(rng, 20_000), rng.beta(1, 20, 20_000), ["amount_usd"])
    monitor = DriftMonitor("v1", reference, window_rows=4000, warn_psi=0.2)
    records = [monitor.observe(matrix(rng, 1000), rng.beta(1, 20, 1000)) for _ in range(4)]
    assert records[:3] == [None, None, None]
    assert records[3]["rows"] == 4000 and not records[3]["warning"]
    assert max(records[3]["psi"].values()) < 0.05


def test_shifted_amounts_and_scores_are_flagged_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    rng = np.random.default_rng(3)
    reference = build_reference(matrix(rng, 20_000), rng.beta(1, 20, 20_000), ["amount_usd"])
    monitor = DriftMonitor("v1", reference, window_rows=2000, warn_psi=0.2)
    with caplog.at_level(logging.WARNING, logger="pipeline.drift"):
        record = monitor.observe(matrix(rng, 2000, amount_scale=4.0), rng.beta(2, 5, 2000))
    assert record is not None and record["warning"]
    assert record["drifting"] == ["amount_usd", "score"]
    assert record["psi"]["amount_usd"] > 0.5
    assert "drift: PSI above 0.20" in caplog.text


def test_a_window_counted_at_its_end_equals_counting_batch_by_batch() -> None:
    """The monitor keeps each batch's values and counts them once the window
    closes: the same PSI as counting the whole window at once, whatever the
    batch sizes (missing feature values included)."""
    rng = np.random.default_rng(4)
    reference = build_reference(matrix(rng, 20_000), rng.beta(1, 20, 20_000), ["amount_usd", FEATURE_NAMES[0]])
    whole = DriftMonitor("v1", reference, window_rows=1500, warn_psi=0.2)
    batched = DriftMonitor("v1", reference, window_rows=1500, warn_psi=0.2)
    m, s = matrix(rng, 1500, amount_scale=2.0), rng.beta(2, 5, 1500)
    m[::7, AMOUNT] = np.nan
    expected = whole.observe(m, s)
    sizes = rng.integers(1, 64, 200)
    cuts = np.cumsum(sizes)[np.cumsum(sizes) < 1500]
    records = [batched.observe(mb, sb) for mb, sb in zip(np.split(m, cuts), np.split(s, cuts))]
    assert records[:-1] == [None] * (len(records) - 1)
    assert records[-1] == expected and expected is not None and expected["rows"] == 1500
    assert batched.observe(m[:10], s[:10]) is None  # a new window starts empty
