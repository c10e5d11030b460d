"""Kafka's group-generation fence for transactional offsets (KIP-447), in aiokafka's protocol classes.

One transaction per batch, whatever input partitions it holds, needs a fence
that is not the transactional id: a worker's producer is its own, and what
makes a worker that lost its partitions (a zombie) unable to commit is the
consumer group's generation, sent with the offsets:

- **TxnOffsetCommit v3** carries the group's generation and the member id of
  the consumer that read the records. The group coordinator refuses offsets
  of a generation that is not the group's current one (``ILLEGAL_GENERATION``)
  or of a member the group no longer has (``UNKNOWN_MEMBER_ID``): the
  transaction can only abort, and none of its records become visible.
- **OffsetFetch v7** with ``require_stable``: while a transaction holding
  offsets for a partition is still open, the coordinator answers
  ``UNSTABLE_OFFSET_COMMIT`` instead of the older offset. A partition's new
  owner reads its offsets this way, so it starts where the previous owner's
  last transaction left it, whether that transaction commits or aborts.

aiokafka 0.14 sends TxnOffsetCommit v0 and OffsetFetch up to v3 (neither
field exists there), so the two requests are declared here with aiokafka's
own types; app/seams.py installs them into aiokafka's sender and sends the
fetch to the group coordinator. Field layouts: Kafka's
``TxnOffsetCommitRequest.json`` (v3, flexible) and ``OffsetFetchRequest.json``
(v7, flexible).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from aiokafka.protocol.api import Request, RequestStruct, Response
from aiokafka.protocol.types import (
    Boolean,
    CompactArray,
    CompactString,
    Int16,
    Int32,
    Int64,
    Schema,
    TaggedFields,
)

__all__ = [
    "GENERATION_FENCE_ERRORS",
    "GenerationFenced",
    "UNSTABLE_OFFSET_COMMIT",
    "GroupMember",
    "StableOffsetFetchRequest",
    "TxnOffsetCommitV3Request",
    "stable_offsets",
    "txn_offset_commit_errors",
]

#: Error codes by which the group coordinator refuses a transaction's offsets
#: because the member that read them is no longer the group's (ILLEGAL_GENERATION,
#: UNKNOWN_MEMBER_ID, FENCED_INSTANCE_ID): the transaction must abort.
GENERATION_FENCE_ERRORS = frozenset({22, 25, 82})
#: The partition has offsets in a transaction still open: ask again.
UNSTABLE_OFFSET_COMMIT = 88
#: The transaction coordinator is still completing the producer's previous transaction.
CONCURRENT_TRANSACTIONS = 51


class GenerationFenced(Exception):
    """The group coordinator refused a transaction's offsets: the member that
    read them is no longer in the group's current generation."""


class GroupMember(str):
    """A consumer group id that also carries the member that read the records.

    It is a ``str`` (the group id) so that it passes through aiokafka's
    ``send_offsets_to_transaction(offsets, group_id)`` unchanged to the request
    builder, which reads the generation and member id from it.
    """

    generation_id: int
    member_id: str

    def __new__(cls, group_id: str, generation_id: int, member_id: str) -> GroupMember:
        self = super().__new__(cls, group_id)
        self.generation_id = generation_id
        self.member_id = member_id
        return self

    def __repr__(self) -> str:
        return f"GroupMember({str(self)!r}, generation={self.generation_id}, member={self.member_id!r})"


# --- TxnOffsetCommit v3 ---------------------------------------------------------------------------


class TxnOffsetCommitResponse_v3(Response):  # type: ignore[misc]  # aiokafka is untyped
    API_KEY = 28
    API_VERSION = 3
    SCHEMA = Schema(
        ("throttle_time_ms", Int32),
        (
            "topics",
            CompactArray(
                ("name", CompactString("utf-8")),
                ("partitions", CompactArray(("partition_index", Int32), ("error_code", Int16), ("tags", TaggedFields))),
                ("tags", TaggedFields),
            ),
        ),
        ("tags", TaggedFields),
    )


class TxnOffsetCommitRequest_v3(RequestStruct):  # type: ignore[misc]  # aiokafka is untyped
    FLEXIBLE_VERSION = True
    API_KEY = 28
    API_VERSION = 3
    RESPONSE_TYPE = TxnOffsetCommitResponse_v3
    SCHEMA = Schema(
        ("transactional_id", CompactString("utf-8")),
        ("group_id", CompactString("utf-8")),
        ("producer_id", Int64),
        ("producer_epoch", Int16),
        ("generation_id", Int32),
        ("member_id", CompactString("utf-8")),
        ("group_instance_id", CompactString("utf-8")),
        (
            "topics",
            CompactArray(
                ("name", CompactString("utf-8")),
                (
                    "partitions",
                    CompactArray(
                        ("partition_index", Int32),
                        ("committed_offset", Int64),
                        ("committed_leader_epoch", Int32),
                        ("committed_metadata", CompactString("utf-8")),
                        ("tags", TaggedFields),
                    ),
                ),
                ("tags", TaggedFields),
            ),
        ),
        ("tags", TaggedFields),
    )


class TxnOffsetCommitV3Request(Request[TxnOffsetCommitRequest_v3]):  # type: ignore[misc]  # aiokafka is untyped
    """The offsets of a transaction, fenced by the group generation of ``group_id``
    when it is a :class:`GroupMember` (a plain group id sends generation -1: no check)."""

    API_KEY = 28

    def __init__(
        self,
        transactional_id: str,
        group_id: str,
        producer_id: int,
        producer_epoch: int,
        topics: list[tuple[str, list[tuple[int, int, str]]]],
    ) -> None:
        self._transactional_id = transactional_id
        self._group_id = group_id
        self._producer_id = producer_id
        self._producer_epoch = producer_epoch
        self._topics = topics

    def build(self, request_struct_class: type[TxnOffsetCommitRequest_v3]) -> TxnOffsetCommitRequest_v3:
        generation, member = -1, ""
        if isinstance(self._group_id, GroupMember):
            generation, member = self._group_id.generation_id, self._group_id.member_id
        topics: list[tuple[str, list[tuple[int, int, int, str, dict[int, bytes]]], dict[int, bytes]]] = [
            (topic, [(p, offset, -1, metadata or "", {}) for p, offset, metadata in parts], {})
            for topic, parts in self._topics
        ]
        return request_struct_class(
            self._transactional_id,
            str(self._group_id),
            self._producer_id,
            self._producer_epoch,
            generation,
            member,
            None,
            topics,
            {},
        )


def txn_offset_commit_errors(response: Any) -> list[tuple[str, list[tuple[int, int]]]]:
    """(topic, [(partition, error code)]) of a v3 response, in the shape aiokafka's handler reads."""
    return [(name, [(p, code) for p, code, _tags in parts]) for name, parts, _tags in response.topics]


# --- OffsetFetch v7, require_stable ---------------------------------------------------------------


class OffsetFetchResponse_v7(Response):  # type: ignore[misc]  # aiokafka is untyped
    API_KEY = 9
    API_VERSION = 7
    SCHEMA = Schema(
        ("throttle_time_ms", Int32),
        (
            "topics",
            CompactArray(
                ("name", CompactString("utf-8")),
                (
                    "partitions",
                    CompactArray(
                        ("partition_index", Int32),
                        ("committed_offset", Int64),
                        ("committed_leader_epoch", Int32),
                        ("metadata", CompactString("utf-8")),
                        ("error_code", Int16),
                        ("tags", TaggedFields),
                    ),
                ),
                ("tags", TaggedFields),
            ),
        ),
        ("error_code", Int16),
        ("tags", TaggedFields),
    )


class OffsetFetchRequest_v7(RequestStruct):  # type: ignore[misc]  # aiokafka is untyped
    FLEXIBLE_VERSION = True
    API_KEY = 9
    API_VERSION = 7
    RESPONSE_TYPE = OffsetFetchResponse_v7
    SCHEMA = Schema(
        ("group_id", CompactString("utf-8")),
        (
            "topics",
            CompactArray(
                ("name", CompactString("utf-8")), ("partition_indexes", CompactArray(Int32)), ("tags", TaggedFields)
            ),
        ),
        ("require_stable", Boolean),
        ("tags", TaggedFields),
    )


class StableOffsetFetchRequest(Request[OffsetFetchRequest_v7]):  # type: ignore[misc]  # aiokafka is untyped
    """The group's committed offsets of some partitions, refused while a transaction holding them is open."""

    API_KEY = 9

    def __init__(self, group_id: str, partitions: Iterable[tuple[str, int]]) -> None:
        self._group_id = str(group_id)
        by_topic: dict[str, list[int]] = {}
        for topic, partition in partitions:
            by_topic.setdefault(topic, []).append(partition)
        self._topics: list[tuple[str, list[int], dict[int, bytes]]] = [
            (t, sorted(ps), {}) for t, ps in sorted(by_topic.items())
        ]

    def build(self, request_struct_class: type[OffsetFetchRequest_v7]) -> OffsetFetchRequest_v7:
        return request_struct_class(self._group_id, self._topics, True, {})


def stable_offsets(response: Any) -> tuple[dict[tuple[str, int], int | None], dict[tuple[str, int], int]]:
    """(offsets, errors) of an OffsetFetch v7 answer: the committed offset of
    each partition (None: nothing committed), and the error code of each
    partition that has none yet (``UNSTABLE_OFFSET_COMMIT``: ask again). A
    group-level error is reported for every partition."""
    offsets: dict[tuple[str, int], int | None] = {}
    errors: dict[tuple[str, int], int] = {}
    for name, parts, _tags in response.topics:
        for partition, offset, _epoch, _metadata, code, _ptags in parts:
            key = (name, partition)
            if code or response.error_code:
                errors[key] = code or response.error_code
            else:
                offsets[key] = offset if offset >= 0 else None
    return offsets, errors
