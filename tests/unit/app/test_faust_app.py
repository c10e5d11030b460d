"""faust's own topic (the assignor's leader topic) gets the project topics' replicas."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from app import faust_app
from app.settings import Settings
from app.topics import replicas_for

#: Nothing listens here: the app is built and its first start hook run, nothing connects.
NOWHERE = "127.0.0.1:1"


def test_replicas_follow_the_setting_else_the_cluster_size() -> None:
    auto = Settings(kafka_bootstrap=NOWHERE)
    assert [replicas_for(auto, brokers) for brokers in (1, 2, 3, 5)] == [1, 1, 3, 3]
    assert replicas_for(Settings(kafka_bootstrap=NOWHERE, replication_factor=2), 3) == 2


@pytest.mark.parametrize("replicas", [1, 3])
def test_faust_declares_its_own_topics_with_the_project_replicas(
    replicas: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    settings = Settings(kafka_bootstrap=NOWHERE, data_dir=tmp_path, partitions=4)
    asked: list[Settings] = []

    async def cluster_replicas(s: Settings) -> int:  # the cluster's answer to describe_cluster
        asked.append(s)
        return replicas

    monkeypatch.setattr(faust_app, "cluster_replicas", cluster_replicas)
    app = faust_app.base_app(settings)
    assert app.conf.topic_replication_factor == 1  # faust's default until the app starts
    asyncio.run(app.on_first_start())
    assert asked == [settings]
    created: list[tuple[str, int]] = []

    class Producer:  # what Topic.declare hands each topic to
        async def create_topic(self, topic: str, partitions: int, replication: int, **_: object) -> None:
            created.append((topic, replication))

    async def declare_all() -> None:
        leader = app._leader_assignor._leader_topic  # type: ignore[attr-defined]
        monkeypatch.setattr(leader, "_get_producer", lambda: _ready(Producer()))
        await leader.declare()

    asyncio.run(declare_all())
    assert created == [(f"{settings.app_id}-__assignor-__leader", replicas)]


async def _ready(value: object) -> object:
    return value
