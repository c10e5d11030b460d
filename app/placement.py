"""Where a transaction belongs: its user's partition of ``transactions``.

Producers key a transaction by its ``user_id`` (docs/contract.md), and
Kafka's default partitioner (murmur2, as the Java clients, aiokafka and
librdkafka's ``murmur2_random`` place a keyed record) puts every record of a
user, resends included, on one partition: its *home*. The worker that owns a
partition therefore sees every earlier decision of that partition's users,
and keeps them in the partition's resend index (pipeline/resend_index.py),
which answers a resend without asking anyone else.

A record found away from its home (a producer with another partitioner, or
keyed by something else) cannot be checked that way: the worker re-routes it
to its home in the transaction that consumes it (pipeline/scorer.py), where
it is decided like any other.
"""

from __future__ import annotations

from functools import lru_cache

from aiokafka.partitioner import murmur2

__all__ = ["Placement", "home_partition"]


def home_partition(key: bytes, partitions: int) -> int:
    """The partition Kafka's default partitioner puts a record keyed ``key`` on."""
    hashed: int = murmur2(key)
    return (hashed & 0x7FFFFFFF) % partitions


class Placement:
    """The home partitions of ``transactions``, for ``partitions`` partitions."""

    def __init__(self, partitions: int) -> None:
        if partitions < 1:
            raise ValueError(f"a topic has at least one partition, not {partitions}")
        self.partitions = partitions
        # NOTE: murmur2 in pure Python is ~4 µs for a short key; users repeat.
        self.home = lru_cache(maxsize=65_536)(self._home)

    def _home(self, user_id: str) -> int:
        return home_partition(user_id.encode(), self.partitions)
