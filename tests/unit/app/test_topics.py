"""What ``fraud-pipeline topics`` creates (app/topics.py): the resend index's
changelog, partition for partition with ``transactions``, kept for the TTL whatever its size."""

from __future__ import annotations

from app.settings import Settings
from app.topics import topic_configs, topic_partitions


def test_the_changelog_has_a_partition_for_each_partition_of_transactions() -> None:
    for n in (1, 8, 12):
        s = Settings(partitions=n)
        counts = topic_partitions(s)
        assert counts[s.topic_decision_index] == counts[s.topic_transactions] == n


def test_the_changelog_keeps_every_entry_for_the_ttl_and_no_size_limit_drops_one() -> None:
    s = Settings(decision_cache_ttl_s=7200)
    config = topic_configs(s)[s.topic_decision_index]
    assert config["cleanup.policy"] == "compact,delete"
    assert config["retention.ms"] == "7200000"
    # A broker default such as log.retention.bytes (the local stack: 128 MiB a
    # partition) would drop entries an hour of peak needs: never limited by size.
    assert config["retention.bytes"] == "-1"
    assert int(config["segment.ms"]) < int(config["retention.ms"])
