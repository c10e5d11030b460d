"""`scale advise --from-broker`: lag per partition from end offsets and the
group's committed offsets, on the real broker."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.structs import OffsetAndMetadata

from agents.wiring import scoring_group
from app.settings import Settings
from app.topics import ensure_topics
from tools.autoscale import broker_offsets

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

REPO = Path(__file__).resolve().parents[2]
PARTITIONS = 4
PER_PARTITION = 25


def test_lag_from_the_broker(kafka_bootstrap: str, unique_name: Callable[[str], str]) -> None:
    topic, group = unique_name("as-tx"), unique_name("as-group")
    settings = Settings(kafka_bootstrap=kafka_bootstrap, topic_transactions=topic, app_id=group, partitions=PARTITIONS)

    async def scenario() -> dict[int, object]:
        await ensure_topics(settings, wait_s=20)
        # linger: several records per batch.
        producer = AIOKafkaProducer(bootstrap_servers=kafka_bootstrap, linger_ms=20)
        await producer.start()
        try:
            sent = [
                await producer.send(topic, b"x" * 50, partition=p)
                for p in range(PARTITIONS)
                for _ in range(PER_PARTITION)
            ]
            await asyncio.gather(*sent)
        finally:
            await producer.stop()
        # The scoring loop's group (app/eos.py) commits the offsets of `transactions`.
        committer = AIOKafkaConsumer(
            bootstrap_servers=kafka_bootstrap, group_id=scoring_group(settings), enable_auto_commit=False
        )
        await committer.start()
        try:
            committer.assign([TopicPartition(topic, 0), TopicPartition(topic, 1)])
            await committer.commit({TopicPartition(topic, 0): OffsetAndMetadata(PER_PARTITION, ""),
                                    TopicPartition(topic, 1): OffsetAndMetadata(10, "")})  # fmt: skip
        finally:
            await committer.stop()
        return await broker_offsets(settings)

    offsets = asyncio.run(scenario())
    assert {p: (o.highwater, o.committed, o.lag) for p, o in offsets.items()} == {  # type: ignore[attr-defined]
        0: (PER_PARTITION, PER_PARTITION, 0),
        1: (PER_PARTITION, 10, PER_PARTITION - 10),
        2: (PER_PARTITION, None, PER_PARTITION),  # never committed: all of it
        3: (PER_PARTITION, None, PER_PARTITION),
    }

    # The command, as an operator runs it: lag 65, nothing arriving, 20 TPS per worker assumed.
    env = {"KAFKA_BOOTSTRAP": kafka_bootstrap, "FRAUD_TOPIC_TRANSACTIONS": topic, "FRAUD_APP_ID": group,
           "PATH": "/usr/bin:/bin"}  # fmt: skip
    done = subprocess.run(
        [sys.executable, "-m", "tools.cli", "scale", "advise", "--from-broker", "--interval", "1",
         "--capacity-tps", "1", "--drain-s", "60"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    # 65 / 60 s = 1.08 TPS needed; 0.7 TPS per worker: 2 workers.
    assert done.stdout.startswith("recommended workers: 2"), done.stdout
    assert "lag 65" in done.stdout


def test_a_missing_topic_is_named_not_created(kafka_bootstrap: str, unique_name: Callable[[str], str]) -> None:
    settings = Settings(kafka_bootstrap=kafka_bootstrap, topic_transactions=unique_name("as-none"))
    from app.errors import ConfigError

    with pytest.raises(ConfigError, match="does not exist"):
        asyncio.run(broker_offsets(settings))
    with pytest.raises(ConfigError, match="does not exist"):  # and it still does not
        asyncio.run(broker_offsets(settings))
