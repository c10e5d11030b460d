"""Night and weekend on the model's clock: the zone trained on is the zone served."""

from __future__ import annotations

import asyncio
import json
import shutil
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from zoneinfo import ZoneInfo

import orjson
import pandas as pd
import pytest

from app.contract import Transaction
from app.errors import ModelError
from app.settings import get_settings
from models import lifecycle
from models.registry import current_version, list_versions, load_ensemble, read_manifest
from pipeline.features import FEATURE_NAMES, feature_row
from tests.factories import ConstantModel
from tests.scoring import World, inbound, make_scorer
from tools.cli import main

NIGHT = FEATURE_NAMES.index("is_night")
WEEKEND = FEATURE_NAMES.index("is_weekend")


def _row(when: datetime, tz: ZoneInfo | None) -> list[float]:
    tx = Transaction(transaction_id="t", user_id="u", amount=10.0, merchant_id="m", timestamp=when.timestamp())
    return feature_row(tx, None, None, (1.0, 1.0, 1.0, 10.0, 10.0, 10.0), tz)


def test_night_and_weekend_read_the_given_zones_wall_clock() -> None:
    friday_late = datetime(2026, 7, 3, 23, 30, tzinfo=UTC)  # Saturday 01:30 in Brussels (UTC+2 in July)
    utc, brussels = _row(friday_late, None), _row(friday_late, ZoneInfo("Europe/Brussels"))
    assert (utc[NIGHT], utc[WEEKEND]) == (0.0, 0.0)
    assert (brussels[NIGHT], brussels[WEEKEND]) == (1.0, 1.0)
    winter = datetime(2026, 1, 9, 23, 30, tzinfo=UTC)  # Saturday 00:30 in Brussels (UTC+1 in January)
    assert _row(winter, ZoneInfo("Europe/Brussels"))[NIGHT] == 1.0
    assert utc[:NIGHT] == brussels[:NIGHT] and utc[WEEKEND + 1 :] == brussels[WEEKEND + 1 :]


def test_the_scorer_computes_them_on_the_served_models_zone(sim_frame: pd.DataFrame) -> None:
    world = World(sim_frame)  # decides at 02:00 UTC: night in UTC, 21:00 or 22:00 in New York

    class Zoned(ConstantModel):
        tz = ZoneInfo("America/New_York")

    async def features(model: ConstantModel) -> dict[str, float]:
        scorer = make_scorer(world, model)
        out = await scorer.score_batch([inbound(world.tx(1), world)])
        await scorer.finish(out)
        [(_, raw)] = out.feedback
        got: dict[str, float] = orjson.loads(raw)["features"]
        return got

    assert asyncio.run(features(ConstantModel()))["is_night"] == 1.0
    assert asyncio.run(features(Zoned()))["is_night"] == 0.0


@pytest.fixture()
def registry(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    monkeypatch.setenv("FRAUD_REGISTRY_DIR", str(tmp_path / "registry"))
    get_settings.cache_clear()
    yield tmp_path / "registry"
    get_settings.cache_clear()


def test_naive_local_times_train_a_model_that_serves_on_that_zone(
    sim_frame: pd.DataFrame, registry: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    local = sim_frame["timestamp"].dt.tz_convert("Europe/Brussels").dt.tz_localize(None)
    path = tmp_path / "local.csv"
    sim_frame.drop(columns=["scenario"]).assign(timestamp=local.dt.strftime("%Y-%m-%d %H:%M:%S.%f")).to_csv(
        path, index=False
    )
    assert main(["train", "--data", str(path), "--quiet", "--rounds-scale", "0.05"]) == 2  # no zone: refused
    assert "--timezone" in capsys.readouterr().err
    rc = main(["train", "--data", str(path), "--quiet", "--rounds-scale", "0.05", "--timezone", "Europe/Brussels"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert "read as Europe/Brussels local time" in out and "night and weekend on Europe/Brussels time" in out
    [version] = list_versions(registry)
    manifest = read_manifest(registry, version)
    assert manifest["timezone"] == "Europe/Brussels"
    expected_end = sim_frame["timestamp"].max().ceil("D").isoformat()  # the instants are UTC again
    assert manifest["data_window"]["test"][1] == expected_end
    assert load_ensemble(registry, version, warm_up=False).tz == ZoneInfo("Europe/Brussels")


def test_a_shadow_in_another_zone_is_refused(trained_registry: Path, tmp_path: Path) -> None:
    registry = tmp_path / "registry"
    shutil.copytree(trained_registry, registry)
    served = current_version(registry)
    other = "v29991231-000000"
    shutil.copytree(registry / served, registry / other)
    manifest = read_manifest(registry, other)
    manifest.update(version=other, timezone="Asia/Tokyo")
    (registry / other / "manifest.json").write_text(json.dumps(manifest))
    assert read_manifest(registry, served).get("timezone") == "UTC"
    with pytest.raises(ModelError, match="Asia/Tokyo time.*share the served model's zone"):
        lifecycle.set_shadow(registry, other)
    assert lifecycle.shadow_version(registry) is None
