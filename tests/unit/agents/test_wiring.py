"""The worker's start-up wiring (agents/wiring.py): what it decides from settings, once."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from agents.wiring import Runtime, create_app
from app.settings import Settings
from pipeline.auth import ClientKeys
from pipeline.decision_signing import DecisionSigner
from pipeline.resend_index import MemoryStore, ResendIndex
from pipeline.scorer import Scorer
from tests.factories import RULES, ConstantModel

#: Nothing listens here: clients are built, none connects.
NOWHERE = "127.0.0.1:1"


def runtime(**settings: Any) -> Runtime:
    return Runtime(
        Settings(allow_unsigned=True, **settings), RULES, ConstantModel(0.1, version="v1"), ClientKeys({}),
        DecisionSigner.generate(),
    )  # fmt: skip


def built_scorer(rt: Runtime) -> Scorer:
    async def build() -> Scorer:
        client = rt.redis()  # a client needs the running loop
        try:
            return rt.build_scorer(client, rt.decision_cache(client, ResendIndex(MemoryStore(), 3600)))
        finally:
            await client.aclose()

    return asyncio.run(build())


@pytest.mark.parametrize(
    ("settings", "cluster"),
    [
        ({"redis_url": f"redis://{NOWHERE}/0"}, False),
        ({"redis_url": f"redis+sentinel://{NOWHERE}/primary/0"}, False),
        ({"redis_url": f"redis+cluster://{NOWHERE}"}, True),
        ({"redis_url": f"redis://{NOWHERE}/0", "redis_cluster": True}, True),
    ],
)
def test_a_cluster_is_decided_from_settings_and_its_scorer_keeps_scripts_to_one_slot(
    settings: dict[str, Any], cluster: bool
) -> None:
    """A Redis Cluster refuses a script over several slots: there the scorer
    makes the separate calls; one server (or a Sentinel-watched primary) gets
    the batch's one-call lookup."""
    rt = runtime(**settings)
    assert rt.cluster is cluster
    scorer = built_scorer(rt)
    assert (scorer.lookup is None) is cluster


def test_create_app_registers_the_scoring_task_the_tally_and_the_registry_watch_without_a_broker() -> None:
    """Registered by calls rather than faust's decorators: each still runs with the app."""
    rt = runtime(redis_url=f"redis://{NOWHERE}/0", kafka_bootstrap=NOWHERE, worker_role="score")
    app = create_app(rt.settings, rt)
    # NOTE: faust keeps the functions it starts with the app in _app_tasks
    # (timers too, wrapped in their interval loop): each keeps its name.
    assert sorted(task.__name__ for task in app._app_tasks) == ["count", "score", "watch_registry"]
