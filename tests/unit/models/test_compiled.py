"""The served trees compiled to C: same scores as XGBoost, built once per
machine, never loaded from a directory others can write, XGBoost serving
whenever the library cannot be had."""

from __future__ import annotations

import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import models.compiled as compiled_module
from models.compiled import MAX_SCORE_DIFF, library_path, load_or_compile
from models.ensemble import XGBoostEnsemble
from models.registry import load_ensemble
from pipeline.features import FEATURE_NAMES

pytest.importorskip("tl2cgen")
if shutil.which("gcc") is None:
    pytest.skip("no C compiler: the worker serves with XGBoost (tested below without one)", allow_module_level=True)


def _wait_compiled(ensemble: XGBoostEnsemble, timeout_s: float = 180.0) -> None:
    deadline = time.monotonic() + timeout_s
    while ensemble.compiled is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert ensemble.compiled is not None, "the compiled trees were never attached"


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("compiled") / "trees"


@pytest.fixture(scope="module")
def served(trained_registry: Path, cache: Path) -> XGBoostEnsemble:
    ensemble = load_ensemble(trained_registry, compiled_dir=cache)
    _wait_compiled(ensemble)
    return ensemble


def _batches(seed: int) -> list[np.ndarray]:
    """Batches of the sizes the worker sends, values over the features' scales, some missing."""
    rng = np.random.default_rng(seed)
    out = []
    for size in (1, 2, 7, 32, 64, 257):
        x = rng.standard_normal((size, len(FEATURE_NAMES))) * rng.choice([1.0, 30.0, 5000.0], len(FEATURE_NAMES))
        x[rng.random(x.shape) < 0.15] = np.nan
        out.append(np.abs(x).astype(np.float32))
    return out


def test_the_compiled_trees_score_as_xgboost_within_1e_5(served: XGBoostEnsemble) -> None:
    assert served.merged is not None
    for matrix in _batches(1):
        margin = served.merged.inplace_predict(matrix, missing=np.nan, predict_type="margin")
        reference = 1.0 / (1.0 + np.exp(-np.asarray(margin, dtype=np.float64)))
        got = served.predict(matrix, explain_above=None).scores
        assert np.max(np.abs(got - reference)) <= MAX_SCORE_DIFF
        inline = served.inline_scores(matrix)
        assert inline is not None and np.array_equal(inline, got)


def test_the_rows_explained_and_their_reasons_are_the_xgboost_ones(served: XGBoostEnsemble) -> None:
    """Which rows get reasons follows the compiled scores; the reasons themselves
    are XGBoost's contributions, so both must match an ensemble without them."""
    plain = XGBoostEnsemble(served.version, served.members, combination=served.combination)
    for matrix in _batches(2)[2:]:
        reference = plain.predict(matrix, explain_above=None).scores
        # Between two scores near the middle, well clear of both: a row exactly at
        # the threshold may land on either side by the 1e-7 the two differ.
        ordered = np.sort(reference)
        middle = ordered[len(ordered) // 4 : 3 * len(ordered) // 4 + 1]
        k = int(np.argmax(np.diff(middle)))
        assert middle[k + 1] - middle[k] > 2 * MAX_SCORE_DIFF
        threshold = float(middle[k] + middle[k + 1]) / 2
        ours, theirs = served.predict(matrix, explain_above=threshold), plain.predict(matrix, explain_above=threshold)
        assert 0 < sum(bool(r) for r in theirs.reasons) < len(matrix)
        assert [[n for n, _ in r] for r in ours.reasons] == [[n for n, _ in r] for r in theirs.reasons]


def test_a_second_worker_loads_the_library_without_compiling(
    trained_registry: Path, cache: Path, served: XGBoostEnsemble, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_compiling(*args: Any) -> None:
        raise AssertionError("compiled again although the cache holds the library")

    monkeypatch.setattr(compiled_module, "_compile", no_compiling)
    again = load_ensemble(trained_registry, compiled_dir=cache)
    assert again.compiled is not None  # attached before load_ensemble returned
    assert again.compiled.path == served.compiled.path  # type: ignore[union-attr]


def test_a_cache_directory_others_can_write_is_refused(
    served: XGBoostEnsemble, cache: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    shared = tmp_path / "shared"
    shutil.copytree(cache, shared, ignore=shutil.ignore_patterns(".build-*"))
    os.chmod(shared, 0o777)
    assert served.merged is not None
    with caplog.at_level(logging.WARNING, logger="models.compiled"):
        assert load_or_compile(served.merged, shared) is None
    assert "writable by others" in caplog.text


def test_a_library_built_from_other_trees_is_never_used(
    served: XGBoostEnsemble, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A library under the booster's key that scores otherwise (a wrong file in the
    cache) is refused by the probe comparison, and XGBoost serves."""
    assert served.merged is not None and served.compiled is not None
    other = served.members[0].booster
    mine = tmp_path / "cache"
    elsewhere = load_or_compile(other, tmp_path / "other")
    assert elsewhere is not None
    mine.mkdir(mode=0o700)
    shutil.copy(elsewhere.path, library_path(served.merged, mine))
    with caplog.at_level(logging.WARNING, logger="models.compiled"):
        assert load_or_compile(served.merged, mine) is None
    assert "XGBoost" in caplog.text


def test_without_a_compiler_xgboost_serves(
    trained_registry: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with caplog.at_level(logging.WARNING, logger="models.compiled"):
        ensemble = load_ensemble(trained_registry, compiled_dir=tmp_path / "trees", warm_up=False)
        deadline = time.monotonic() + 60
        while "XGBoost" not in caplog.text and time.monotonic() < deadline:
            time.sleep(0.05)
    assert "scoring with XGBoost" in caplog.text
    assert ensemble.compiled is None and ensemble.inline_scores(_batches(3)[0]) is None
    assert ensemble.predict(_batches(3)[3], explain_above=None).scores.shape == (32,)
