"""What ``fraud-pipeline topics`` creates (app/topics.py): ``decisions``, the
resend index's changelog, partition for partition with ``transactions`` and
kept at least for the TTL whatever its size."""

from __future__ import annotations

from app.settings import Settings
from app.topics import DECISIONS_RETENTION_MS, topic_configs, topic_partitions


def test_decisions_have_a_partition_for_each_partition_of_transactions() -> None:
    for n in (1, 8, 12):
        s = Settings(partitions=n)
        counts = topic_partitions(s)
        assert counts[s.topic_decisions] == counts[s.topic_transactions] == n


def test_decisions_are_kept_for_the_ttl_at_least_and_no_size_limit_drops_one() -> None:
    week = Settings(decision_cache_ttl_s=7200)
    assert topic_configs(week)[week.topic_decisions]["retention.ms"] == str(DECISIONS_RETENTION_MS)
    longer = Settings(decision_cache_ttl_s=30 * 24 * 3600)
    assert topic_configs(longer)[longer.topic_decisions]["retention.ms"] == str(30 * 24 * 3600 * 1000)
    # A broker default such as log.retention.bytes (the local stack: 128 MiB a
    # partition) would drop decisions an hour of peak needs: never limited by size.
    assert topic_configs(week)[week.topic_decisions]["retention.bytes"] == "-1"
