"""The registry: checksums, feature list, reproducible scores."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from app.errors import ModelIntegrityError, ModelNotFound
from models.registry import current_version, load_ensemble, read_manifest
from pipeline.features import FEATURE_NAMES


def copy_registry(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst / "registry")
    return dst / "registry"


def test_manifest_describes_the_members_their_combination_and_metrics(trained_registry: Path) -> None:
    manifest = read_manifest(trained_registry)
    names = [m["name"] for m in manifest["members"]]
    assert names == ["broad", "shallow", "forest", "behaviour"]
    assert manifest["feature_names"] == list(FEATURE_NAMES)
    assert not any(n.startswith("merchant_") for n in manifest["members"][3]["features"])
    combination = manifest["combination"]
    assert combination["kind"] == "stacked" and set(combination["weights"]) == set(names)
    assert all(w >= 0 for w in combination["weights"].values()) and any(w > 0 for w in combination["weights"].values())
    assert combination["fitted_on"]["rows"] > 0 and combination["fitted_on"]["frauds"] > 0
    assert {"auc", "ap", "cp_at_100"} <= set(manifest["metrics"]["ensemble"])
    assert set(manifest["sha256"]) >= {m["file"] for m in manifest["members"]}
    assert (trained_registry / manifest["version"] / "report" / "curves.png").stat().st_size > 10_000


def test_scores_are_reproducible_from_the_registry(trained_registry: Path) -> None:
    rng = np.random.default_rng(3)
    batch = rng.random((32, len(FEATURE_NAMES)), dtype=np.float32) * 100
    first = load_ensemble(trained_registry).predict(batch)
    again = load_ensemble(trained_registry, current_version(trained_registry), warm_up=False).predict(batch)
    np.testing.assert_array_equal(first.scores, again.scores)
    assert ((first.scores >= 0) & (first.scores <= 1)).all()
    assert all(len(r) <= 3 and all(c > 0 for _, c in r) for r in first.reasons)


def test_reasons_only_for_rows_at_or_above_the_threshold_and_scores_match_xgboost(trained_registry: Path) -> None:
    import xgboost as xgb

    model = load_ensemble(trained_registry)
    rng = np.random.default_rng(5)
    batch = rng.random((40, len(FEATURE_NAMES)), dtype=np.float32) * 100
    batch[::7, 3] = np.nan  # missing values take each split's default branch
    everything = model.predict(batch)  # explain_above=0.0: every row
    threshold = float(np.median(everything.scores))
    some = model.predict(batch, explain_above=threshold)
    none = model.predict(batch, explain_above=None)
    np.testing.assert_array_equal(some.scores, everything.scores)
    np.testing.assert_array_equal(none.scores, everything.scores)
    assert none.reasons == []
    for score, mine, full in zip(some.scores, some.reasons, everything.reasons, strict=True):
        assert mine == (full if score >= threshold else [])
    assert any(some.reasons) and not all(some.reasons)
    # The stacked formula on each member's own margin (XGBoost's predict on a DMatrix):
    # sigmoid(intercept + sum of weight x margin), weights and intercept as the manifest records them.
    entry = read_manifest(trained_registry)["combination"]
    log_odds = entry["intercept"] + sum(
        entry["weights"][m.name] * m.booster.predict(xgb.DMatrix(batch[:, m.columns], missing=np.nan), output_margin=True)
        for m in model.members
    )
    np.testing.assert_allclose(everything.scores, 1 / (1 + np.exp(-log_odds)), rtol=1e-5, atol=1e-6)


def test_a_stacked_version_serves_from_one_merged_booster_with_the_members_reasons(trained_registry: Path) -> None:
    """Scores come from one booster holding every member's trees (one predict
    call per batch, not one per member); the test above holds its scores to the
    members' own margins, this its contributions to theirs."""
    model = load_ensemble(trained_registry)
    assert model.merged is not None
    trees = sum(len(model.members[i].booster.get_dump()) for i in model.active)
    assert len(model.merged.get_dump()) == trees
    batch = np.random.default_rng(11).random((64, len(FEATURE_NAMES)), dtype=np.float32) * 100
    batch[::5, FEATURE_NAMES.index("new_device")] = np.nan
    merged = model.contributions(batch)
    per_member = model.contributions(batch, merged=False)
    assert np.abs(per_member).max() > 0.1
    np.testing.assert_allclose(merged, per_member, atol=1e-5)


def test_a_version_saved_before_stacking_loads_and_scores_as_the_weighted_mean(
    trained_registry: Path, tmp_path: Path
) -> None:
    """Manifests written before the combination existed have no ``combination``
    and score as the weighted mean of the members' probabilities."""
    import xgboost as xgb

    registry = copy_registry(trained_registry, tmp_path)
    path = registry / current_version(registry) / "manifest.json"
    manifest = json.loads(path.read_text())
    del manifest["combination"]
    for member, weight in zip(manifest["members"], (0.45, 0.35, 0.2, 0.1)):
        member["weight"] = weight
    path.write_text(json.dumps(manifest))
    model = load_ensemble(registry)
    batch = np.random.default_rng(8).random((32, len(FEATURE_NAMES)), dtype=np.float32) * 100
    scored = model.predict(batch)
    expected = sum(
        w / 1.1 * m.booster.predict(xgb.DMatrix(batch[:, m.columns], missing=np.nan))
        for m, w in zip(model.members, (0.45, 0.35, 0.2, 0.1))
    )
    np.testing.assert_allclose(scored.scores, expected, rtol=1e-5, atol=1e-6)
    assert any(scored.reasons)  # explanations work on the old format too


def test_a_tampered_model_file_is_refused(trained_registry: Path, tmp_path: Path) -> None:
    registry = copy_registry(trained_registry, tmp_path)
    version = current_version(registry)
    model_file = registry / version / "member_shallow.ubj"
    data = bytearray(model_file.read_bytes())
    data[len(data) // 2] ^= 0xFF
    model_file.write_bytes(bytes(data))
    with pytest.raises(ModelIntegrityError, match="sha256"):
        load_ensemble(registry)


def test_a_manifest_naming_unknown_features_is_refused(trained_registry: Path, tmp_path: Path) -> None:
    registry = copy_registry(trained_registry, tmp_path)
    path = registry / current_version(registry) / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["members"][0]["features"][0] = "shoe_size"
    path.write_text(json.dumps(manifest))
    with pytest.raises(ModelIntegrityError, match="shoe_size"):
        load_ensemble(registry)


def test_an_empty_registry_says_how_to_fix_it(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFound, match="fraud-pipeline train"):
        load_ensemble(tmp_path)


def test_training_without_optional_columns_uses_the_features_it_can_compute(
    sim_frame: object, tmp_path: Path
) -> None:
    from models.training import TrainConfig, train

    bare = sim_frame.drop(columns=["device_id", "lat", "lon", "merchant_category", "currency"])  # type: ignore[attr-defined]
    result = train(bare, tmp_path, TrainConfig(rounds_scale=0.05), progress=False)
    features = read_manifest(tmp_path, result.version)["members"][0]["features"]
    assert "new_device" not in features and "distance_from_home_km" not in features
    assert load_ensemble(tmp_path, result.version).predict(np.zeros((2, len(FEATURE_NAMES)), np.float32)).scores.shape == (2,)


def test_the_report_has_daily_card_precision_and_reliability_recomputable_from_the_saved_scores(
    trained_registry: Path,
) -> None:
    import pandas as pd

    from models.evaluation import card_precision_per_day

    manifest = read_manifest(trained_registry)
    report = trained_registry / manifest["version"] / "report"
    for name in ("daily_card_precision.png", "reliability.png", "curves.png"):
        assert (report / name).stat().st_size > 10_000
        assert f"report/{name}" in manifest["sha256"]
    evaluation = json.loads((report / "evaluation.json").read_text())
    scores = pd.read_parquet(report / "test_scores.parquet")
    kept = scores[scores["evaluated"]].reset_index(drop=True)
    for model in ("ensemble", "broad", "baseline"):
        daily = evaluation["daily_card_precision"][model]
        assert len(daily) == 7  # one value per test day
        assert daily == card_precision_per_day(kept, kept[model].to_numpy())
        assert round(float(np.mean(list(daily.values()))), 4) == manifest["metrics"][model]["cp_at_100"]
    bins = evaluation["reliability"]
    assert sum(b["rows"] for b in bins) == len(kept)
    top = bins[-1]
    in_top = kept[(kept["ensemble"] >= top["low"]) & (kept["ensemble"] <= top["high"])]
    assert top["fraud_rate"] == round(float(in_top["label"].mean()), 5)
