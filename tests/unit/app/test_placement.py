"""A transaction's home partition is where Kafka's default partitioner puts its user's records."""

from __future__ import annotations

import pytest

from app.placement import Placement, home_partition
from tests.factories import partition_of

#: Kafka's own test vectors for its murmur2 (org.apache.kafka.common.utils.UtilsTest), as signed ints.
JAVA_MURMUR2 = {
    b"21": -973932308,
    b"foobar": -790332482,
    b"a-little-bit-long-string": -985981536,
    b"a-little-bit-longer-string": -1486304829,
    b"lkjh234lh9fiuh90y23oiuhsafujhadof229phr9h19h89h8": -58897971,
    b"abc": 479470107,
}


@pytest.mark.parametrize(("key", "java"), sorted(JAVA_MURMUR2.items()))
def test_the_home_partition_is_the_java_client_s(key: bytes, java: int) -> None:
    # The Java client: toPositive(murmur2(key)) % numPartitions.
    for partitions in (1, 3, 8, 12):
        assert home_partition(key, partitions) == (java & 0x7FFFFFFF) % partitions


def test_placement_agrees_with_aiokafka_for_every_user() -> None:
    placement = Placement(8)
    for i in range(500):
        user = f"u-{i:05d}"
        assert placement.home(user) == partition_of(user.encode(), 8)


def test_a_topic_has_at_least_one_partition() -> None:
    with pytest.raises(ValueError):
        Placement(0)
