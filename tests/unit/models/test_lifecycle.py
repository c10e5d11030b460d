"""Promotion, rollback, shadow and hot reload, on a registry on disk and a Scorer with fakes."""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
from pathlib import Path
from typing import Any

import orjson
import pandas as pd
import pytest

from agents.reload import Reloader
from app.errors import ModelError, ModelNotFound, RulesError
from models import lifecycle
from models.registry import current_version, read_manifest
from pipeline.rules import load_rules
from tests.factories import ConstantModel
from tests.scoring import RULES, World, decisions, inbound, make_scorer


def two_versions(trained: Path, tmp_path: Path) -> tuple[Path, str, str]:
    """A registry holding the trained version and a copy of it under a second name."""
    registry = tmp_path / "registry"
    shutil.copytree(trained, registry)
    first = current_version(registry)
    second = "v29991231-000000"
    shutil.copytree(registry / first, registry / second)
    manifest = read_manifest(registry, second)
    manifest["version"] = second
    (registry / second / "manifest.json").write_text(json.dumps(manifest))
    return registry, first, second


@pytest.fixture(scope="module")
def world(sim_frame: pd.DataFrame) -> World:
    return World(sim_frame)


#: Every line of promotions.jsonl carries these, whatever the action.
LINE_FIELDS = ["at", "action", "kind", "version", "previous", "by", "reason"]


def _without_at(entry: dict[str, Any]) -> dict[str, Any]:
    assert list(entry)[: len(LINE_FIELDS)] == LINE_FIELDS and entry["at"].endswith("Z")
    return {k: v for k, v in entry.items() if k != "at"}


def test_promote_and_rollback_are_recorded_with_who_and_when(trained_registry: Path, tmp_path: Path) -> None:
    registry, first, second = two_versions(trained_registry, tmp_path)
    entry = lifecycle.promote(registry, second, by="alice", reason="better AP on feedback")
    assert current_version(registry) == second
    assert (entry["action"], entry["version"], entry["previous"], entry["by"]) == ("promote", second, first, "alice")
    assert entry["at"].endswith("Z")
    back = lifecycle.rollback(registry, by="bob")
    assert current_version(registry) == first
    assert (back["action"], back["version"], back["replaced"], back["by"]) == ("rollback", first, second, "bob")
    assert [e["action"] for e in lifecycle.history(registry)] == ["promote", "promote", "rollback"]
    with pytest.raises(ModelError, match="nothing to roll back to"):
        lifecycle.rollback(registry)  # `first` was the registry's first model: it replaced nothing


def test_training_never_serves_and_only_promotion_changes_what_does(sim_frame: pd.DataFrame, tmp_path: Path) -> None:
    """train -> train -> shadow V2 -> promote V2 -> rollback: V1 serves again, every step logged in full."""
    from models.training import TrainConfig, train

    registry = tmp_path / "registry"
    cfg = TrainConfig(rounds_scale=0.05)
    v1 = train(sim_frame, registry, cfg, progress=False).version
    with pytest.raises(ModelNotFound, match=f"no version serves yet.*models promote {v1}"):
        current_version(registry)  # registered, not served: not even as the only version
    first = lifecycle.promote(registry, v1, by="ops", reason="first model")
    v2 = train(sim_frame, registry, cfg, progress=False).version
    assert v2 != v1 and current_version(registry) == v1  # the second training changed nothing served
    with pytest.raises(ModelError, match="is the served version"):
        lifecycle.set_shadow(registry, v1, by="ops")
    with pytest.raises(ModelError, match="already serves"):
        lifecycle.promote(registry, v1, by="ops")
    shadow = lifecycle.set_shadow(registry, v2, by="ops", reason="compare on live traffic")
    assert lifecycle.shadow_version(registry) == v2
    promoted = lifecycle.promote(registry, v2, by="ops", reason="better AP in shadow")
    assert current_version(registry) == v2 and lifecycle.shadow_version(registry) is None
    back = lifecycle.rollback(registry, by="oncall", reason="alert rate doubled")
    assert current_version(registry) == v1
    assert [_without_at(e) for e in (first, shadow, promoted, back)] == [
        {"action": "promote", "kind": "model", "version": v1, "previous": None, "by": "ops", "reason": "first model"},
        {"action": "shadow", "kind": "model", "version": v2, "previous": None, "by": "ops",
         "reason": "compare on live traffic"},
        {"action": "promote", "kind": "model", "version": v2, "previous": v1, "by": "ops",
         "reason": "better AP in shadow"},
        {"action": "rollback", "kind": "model", "version": v1, "previous": None, "by": "oncall",
         "reason": "alert rate doubled", "replaced": v2},
    ]  # fmt: skip
    assert lifecycle.history(registry) == [first, shadow, promoted, back]  # what was returned is what was logged
    with pytest.raises(ModelError, match="nothing to roll back to"):
        lifecycle.rollback(registry)
    off = lifecycle.set_shadow(registry, v2, by="ops")
    stop = lifecycle.set_shadow(registry, None, by="ops", reason="done")
    assert _without_at(stop) == {"action": "shadow", "kind": "model", "version": None, "previous": v2, "by": "ops",
                                 "reason": "done"}  # fmt: skip
    assert off["reason"] is None and lifecycle.shadow_version(registry) is None
    with pytest.raises(ModelError, match="nothing to stop"):
        lifecycle.set_shadow(registry, None)


def test_a_missing_or_tampered_version_is_not_promoted(trained_registry: Path, tmp_path: Path) -> None:
    registry, first, second = two_versions(trained_registry, tmp_path)
    with pytest.raises(ModelNotFound):
        lifecycle.promote(registry, "v-nope")
    (registry / second / "member_broad.ubj").write_bytes(b"junk")
    with pytest.raises(Exception, match="sha256"):
        lifecycle.promote(registry, second)
    assert current_version(registry) == first
    assert [e["version"] for e in lifecycle.history(registry)] == [first]  # the fixture's promotion only


def test_the_shadow_pointer_is_set_cleared_and_dropped_on_promotion(trained_registry: Path, tmp_path: Path) -> None:
    registry, _, second = two_versions(trained_registry, tmp_path)
    lifecycle.set_shadow(registry, second, by="carol")
    assert lifecycle.shadow_version(registry) == second
    lifecycle.promote(registry, second)
    assert lifecycle.shadow_version(registry) is None


def test_rules_promotion_validates_first(tmp_path: Path) -> None:
    served = tmp_path / "rules.json"
    served.write_text(json.dumps({**_rules_doc(), "version": "r-1"}))
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({**_rules_doc(), "thresholds": {"review": 0.9, "decline": 0.5}}))
    with pytest.raises(RulesError):
        lifecycle.promote_rules(tmp_path, bad, served)
    assert load_rules(served).version == "r-1"
    good = tmp_path / "good.json"
    good.write_text(json.dumps({**_rules_doc(), "version": "r-2"}))
    entry = lifecycle.promote_rules(tmp_path, good, served, by="dan", reason="fewer false declines")
    assert _without_at(entry) == {"action": "promote", "kind": "rules", "version": "r-2", "previous": "r-1",
                                  "by": "dan", "reason": "fewer false declines", "file": str(served)}  # fmt: skip
    assert load_rules(served).version == "r-2"
    assert lifecycle.history(tmp_path) == [entry]  # one line, for the accepted file only


def _rules_doc() -> dict[str, Any]:
    return {
        "version": RULES.version,
        "thresholds": {"review": 0.5, "decline": 0.9},
        "force_review_amount_usd": 10000,
        "degraded_review_amount_usd": 1000,
    }


async def _apply_until(reloader: Reloader, scorer: Any, done: Any, timeout: float = 30.0) -> list[str]:
    changes: list[str] = []
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not done():
        assert loop.time() < deadline, f"not reloaded after {timeout} s: {changes}"
        await reloader.poll(force=True)
        changes += await reloader.apply(scorer)
        await asyncio.sleep(0.05)
    return changes


def test_a_worker_follows_a_promotion_between_batches(trained_registry: Path, tmp_path: Path, world: World) -> None:
    from models.registry import load_ensemble

    registry, first, second = two_versions(trained_registry, tmp_path)
    rules_path = tmp_path / "rules.json"
    rules_path.write_text(json.dumps(_rules_doc()))

    async def go() -> None:
        model = load_ensemble(registry, first)
        scorer = make_scorer(world, model)
        reloader = Reloader(registry=registry, rules_path=rules_path, model=model, rules=RULES, check_every_s=0.0)
        before = decisions(await scorer.score_batch([inbound(world.tx(1), world)]))
        lifecycle.promote(registry, second, by="test")
        changes = await _apply_until(reloader, scorer, lambda: scorer.model.version == second)
        assert f"model {first} -> {second}" in changes
        after = decisions(await scorer.score_batch([inbound(world.tx(1), world)]))
        assert before[0]["model_version"] == first and after[0]["model_version"] == second
        assert scorer.drift is not None  # the new version came with its drift reference
        lifecycle.rollback(registry, by="test")
        await _apply_until(reloader, scorer, lambda: scorer.model.version == first)

    asyncio.run(go())


def test_a_changed_rules_file_is_reloaded_and_a_bad_one_refused(
    trained_registry: Path, tmp_path: Path, world: World, caplog: pytest.LogCaptureFixture
) -> None:
    rules_path = tmp_path / "rules.json"
    rules_path.write_text(json.dumps(_rules_doc()))

    async def go() -> None:
        scorer = make_scorer(world, ConstantModel(0.6))
        reloader = Reloader(registry=trained_registry, rules_path=rules_path, model=scorer.model, rules=RULES,
                            pinned_version="const-1", load=lambda r, v: ConstantModel(0.6), check_every_s=0.0)  # fmt: skip
        rules_path.write_text(json.dumps({**_rules_doc(), "version": "r-new", "thresholds": {"review": 0.7, "decline": 0.9}}))
        await _apply_until(reloader, scorer, lambda: scorer.rules.version == "r-new")
        [d] = decisions(await scorer.score_batch([inbound(world.tx(2), world)]))
        assert (d["action"], d["rules_version"]) == ("approve", "r-new")
        rules_path.write_text("{not json")
        with caplog.at_level(logging.ERROR):
            await reloader.poll(force=True)
            assert await reloader.apply(scorer) == []
        assert scorer.rules.version == "r-new" and "refused" in caplog.text

    asyncio.run(go())


def test_a_shadow_is_scored_and_logged_but_never_decides(world: World) -> None:
    async def go() -> None:
        scorer = make_scorer(world, ConstantModel(0.1, version="served-1"), shadow=ConstantModel(0.99, version="cand-2"))
        batch = [inbound(world.tx(i), world, correlation=f"c{i}") for i in range(5)]
        out = await scorer.score_batch(batch)
        assert {d["action"] for d in decisions(out)} == {"approve"}
        assert {d["model_version"] for d in decisions(out)} == {"served-1"}
        await scorer.finish(out)
        records = [orjson.loads(v) for _, v in out.feedback]
        assert len(records) == 5
        for r in records:
            assert r["decision"]["action"] == "approve"
            assert r["shadow"] == {"model_version": "cand-2", "fraud_score": 0.99, "action": "decline"}
            assert r["rule"] == "score"
        [summary] = [orjson.loads(m) for m in out.extra_monitoring]
        assert summary["kind"] == "shadow" and summary["served_to_shadow_actions"] == {"approve->decline": 5}

    asyncio.run(go())


def test_a_failing_shadow_leaves_feedback_without_it(world: World) -> None:
    class Broken(ConstantModel):
        def predict(self, matrix: Any, explain_above: float | None = 0.0) -> Any:
            raise RuntimeError("boom")

    async def go() -> None:
        scorer = make_scorer(world, ConstantModel(0.1), shadow=Broken(version="bad"))
        out = await scorer.score_batch([inbound(world.tx(3), world)])
        await scorer.finish(out)
        [(_, raw)] = out.feedback
        assert "shadow" not in orjson.loads(raw) and decisions(out)[0]["action"] == "approve"

    asyncio.run(go())


def test_a_model_that_fails_while_warming_up_is_not_swapped_in_and_nothing_raises(
    world: World, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    class Exploding(ConstantModel):
        def predict(self, matrix: Any, explain_above: float | None = 0.0) -> Any:
            raise RuntimeError("cannot predict")

    registry = tmp_path / "registry"
    registry.mkdir()
    (registry / "CURRENT").write_text("bad-2\n")
    rules_path = tmp_path / "rules.json"
    rules_path.write_text(json.dumps(_rules_doc()))

    async def go() -> None:
        scorer = make_scorer(world, ConstantModel(0.1, version="good-1"))
        reloader = Reloader(registry=registry, rules_path=rules_path, model=scorer.model, rules=RULES,
                            load=lambda r, v: Exploding(version=v), check_every_s=0.0)  # fmt: skip
        with caplog.at_level(logging.ERROR):
            for _ in range(20):
                assert await reloader.apply(scorer) == []
                await asyncio.sleep(0.02)
        assert scorer.model.version == "good-1"
        assert caplog.text.count("bad-2 fails to predict") == 1  # dropped, not retried every batch

    asyncio.run(go())


def test_a_slow_shadow_never_delays_the_deciding_model_and_is_skipped_while_busy(world: World) -> None:
    async def go() -> None:
        # The shadow takes 5x the budget; the served model is instant. Queued
        # behind the shadow, the second batch's prediction would miss its budget.
        scorer = make_scorer(world, ConstantModel(0.1), shadow=ConstantModel(0.99, sleep_s=1.0, version="slow"),
                             model_budget_s=0.2)  # fmt: skip
        first = await scorer.score_batch([inbound(world.tx(4), world)])
        await scorer.finish(first)
        assert "shadow" not in orjson.loads(first.feedback[0][1])  # late: left out
        second = await scorer.score_batch([inbound(world.tx(5), world)])
        [d] = decisions(second)
        assert not d["degraded"] and d["model_version"] == "const-1"
        await scorer.finish(second)
        assert scorer.shadow_skipped == 1

    asyncio.run(go())
