"""The learned combination: what it is fitted on, and how it scores."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from models.combination import MEAN, STACKED, Combination, fit_stacked
from models.registry import read_manifest
from models.selection import prequential_windows
from pipeline.features import DAY_S


def test_fit_stacked_weights_the_informative_member_and_never_goes_negative() -> None:
    rng = np.random.default_rng(0)
    y = (rng.random(4000) < 0.1).astype(float)
    informative = 3.0 * y - 1.5 + rng.normal(0, 1, len(y))
    noise = rng.normal(0, 1, len(y))
    contrary = -informative  # an unconstrained fit would give it a large weight
    fitted = fit_stacked(np.column_stack([informative, noise, contrary]), y)
    assert fitted.kind == STACKED
    assert fitted.weights[0] > 0.5
    assert fitted.weights[1] < 0.1 and fitted.weights[2] == 0.0


def test_scores_follow_the_formula_of_each_kind() -> None:
    margins = np.array([[0.0, 2.0], [-3.0, 1.0]])
    stacked = Combination(STACKED, (0.5, 2.0), intercept=-1.0)
    np.testing.assert_allclose(stacked.score(margins), 1 / (1 + np.exp(-(-1.0 + margins @ [0.5, 2.0]))))
    mean = Combination(MEAN, (3.0, 1.0))
    np.testing.assert_allclose(mean.score(margins), (0.75 / (1 + np.exp(-margins[:, 0]))) + 0.25 / (1 + np.exp(-margins[:, 1])))
    old = Combination.from_manifest(None, [{"name": "a", "weight": 3.0}, {"name": "b", "weight": 1.0}])
    np.testing.assert_array_equal(old.score(margins), mean.score(margins))


def test_one_class_validation_rows_are_refused() -> None:
    with pytest.raises(ValueError, match="one class"):
        fit_stacked(np.ones((10, 2)), np.zeros(10))


def test_prequential_folds_are_the_handbooks_and_end_before_the_delay() -> None:
    start = 100 * DAY_S
    folds = prequential_windows(start, 3, train_days=7, delay_days=7)
    assert [f.fit[0] / DAY_S for f in folds] == [86, 79, 72]
    assert folds[0].validate == (start, start + 7 * DAY_S)  # the training window itself
    assert all(f.validate[1] <= start + 7 * DAY_S for f in folds)  # never the delay or the test week


def test_the_combination_never_sees_the_test_week(sim_frame: pd.DataFrame, tmp_path: Path) -> None:
    """Rewriting every label of the test week changes the test metrics but not
    one digit of the learned combination (nor the members' choice)."""
    from models.training import TrainConfig, train

    cfg = TrainConfig(rounds_scale=0.05)
    first = train(sim_frame, tmp_path / "a", cfg, progress=False)
    ts = (pd.to_datetime(sim_frame["timestamp"], utc=True) - pd.Timestamp(0, tz="UTC")).dt.total_seconds().to_numpy()
    end = np.ceil(ts.max() / DAY_S) * DAY_S
    flipped = sim_frame.copy()
    test_week = ts >= end - 7 * DAY_S
    assert 0 < test_week.sum() < len(ts) / 3
    rng = np.random.default_rng(1)
    flipped.loc[test_week, "label"] = rng.permutation(flipped.loc[test_week, "label"].to_numpy())
    second = train(flipped, tmp_path / "b", cfg, progress=False)
    a = read_manifest(tmp_path / "a", first.version)
    b = read_manifest(tmp_path / "b", second.version)
    assert json.dumps(a["combination"]) == json.dumps(b["combination"])
    assert a["metrics"]["ensemble"] != b["metrics"]["ensemble"]
    validated = a["combination"]["fitted_on"]["folds"][0]["validate"]
    assert pd.Timestamp(validated[1]) <= pd.Timestamp(a["data_window"]["train"][1])
