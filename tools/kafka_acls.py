"""Least-privilege Kafka ACLs: one principal per role, from one table.

``acl_table(settings)`` is the only place the rights are written down. Two
things apply it:

* the local secure stack (``tools.stack.start_broker(secure=True)``) creates
  the ACLs with :func:`create_acls` as the super user ``admin``;
* ``deploy/kafka/acls.sh`` runs the ``kafka-acls.sh`` commands that
  ``python -m tools.kafka_acls`` prints, for a real cluster.

Every role may ``Describe`` every project topic: topic names and partition
counts are not secret, and a worker's start-up (``app.topics.ensure_topics``)
lists the topics and creates only the missing ones; a role that saw fewer
topics would try to create the others and fail.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from app.seams import admin_request
from app.settings import Settings

__all__ = ["ROLES", "Acl", "Grant", "acl_table", "acls", "create_acls", "kafka_acls_commands"]

ResourceType = Literal["topic", "group", "transactional-id"]
Pattern = Literal["literal", "prefixed"]

#: Role -> SCRAM user name (the principal ``User:<name>``). ``admin`` is the
#: broker's super user (topic creation, ACLs) and belongs to no role.
ROLES: dict[str, str] = {
    "payment-client": "payments",
    "scoring-worker": "scoring",
    "feedback-worker": "feedback",
    "analyst": "analyst",
    "gateway": "gateway",
    "operator": "operator",
}

#: Consumer groups of payment clients start with this (their reply readers).
PAYMENT_GROUP_PREFIX = "payments-"
#: Consumer groups of analysts' tools start with this.
ANALYST_GROUP_PREFIX = "analyst-"


@dataclass(frozen=True)
class Grant:
    """``operations`` on the resources ``names`` of one type, literal or prefixed."""

    resource: ResourceType
    names: tuple[str, ...]
    operations: tuple[str, ...]
    pattern: Pattern = "literal"


@dataclass(frozen=True, order=True)
class Acl:
    """One ALLOW ACL entry, as the broker stores it."""

    principal: str
    resource: ResourceType
    name: str
    pattern: Pattern
    operation: str


def _read(*topics: str) -> Grant:
    return Grant("topic", topics, ("Read", "Describe"))


def _write(*topics: str) -> Grant:
    return Grant("topic", topics, ("Write", "Describe"))


def acl_table(settings: Settings) -> dict[str, tuple[Grant, ...]]:
    """Role -> what it may do. Anything not granted here is refused."""
    # NOTE: loads the worker (faust): only when the table is built
    from agents.feedback import feedback_group, feedback_host
    from agents.tally import tally_group, tally_reader_group
    from agents.wiring import restore_group, scoring_group
    from app.eos import gate_group

    s = settings
    scoring = scoring_group(s)
    every_topic = Grant(
        "topic",
        (s.topic_transactions, s.topic_decisions, s.topic_dlq, s.topic_feedback,
         s.topic_labels, s.topic_monitoring),
        ("Describe",),
    )  # fmt: skip
    payment_client = (
        _write(s.topic_transactions),
        _read(s.topic_decisions),
        Grant("group", (PAYMENT_GROUP_PREFIX,), ("Read", "Describe"), "prefixed"),
    )
    analyst = (
        # `labels` too: `report quality --replay`, `train --from-feedback` and
        # `rules backtest` replay feedback and labels (tools/replay.py).
        _read(s.topic_feedback, s.topic_labels),
        _write(s.topic_labels),
        Grant("group", (ANALYST_GROUP_PREFIX,), ("Read", "Describe"), "prefixed"),
    )
    feedback_app = feedback_group(s)
    return {
        "payment-client": (every_topic, *payment_client),
        "scoring-worker": (
            every_topic,
            # `labels` feeds the merchant tally (agents/tally.py);
            # `decisions` is the resend index's changelog, read back by a
            # partition's new owner (app/changelog.py), whose reader,
            # unsubscribed, still names a group (the client requires one).
            _read(s.topic_transactions, s.topic_labels, s.topic_decisions),
            _write(s.topic_decisions, s.topic_dlq, s.topic_feedback, s.topic_monitoring),
            # Re-routing a transaction to its home partition (app/placement.py).
            _write(s.topic_transactions),
            Grant("group", (restore_group(s),), ("Read", "Describe")),
            # app/eos.py: one transactional producer per worker,
            # ``<app_id>-score-<topic>-<worker_id>``, and the scoring consumer
            # group, whose offsets the transactions commit (KIP-447).
            Grant("transactional-id", (f"{s.app_id}-score-",), ("Write", "Describe"), "prefixed"),
            Grant("group", (scoring,), ("Read", "Describe")),
            # The gate group: a transaction's first offsets, read by no one (app/eos.py).
            Grant("group", (gate_group(scoring),), ("Read", "Describe")),
            # The merchant tally (agents/tally.py): `labels` counted in a group
            # of its own, and every worker's copy read by a reader that, as the
            # index's, names a group it never joins.
            Grant("group", (tally_group(s), tally_reader_group(s)), ("Read", "Describe")),
            # faust's consumer group (the hosting app), and the topics named
            # ``<app_id>-...``: the tally's, created by the first worker, and
            # faust's own (the assignor's leader topic).
            Grant("group", (s.app_id,), ("Read", "Describe")),
            Grant("topic", (f"{s.app_id}-",), ("Create", "Read", "Write", "Describe"), "prefixed"),
        ),
        "feedback-worker": (
            every_topic,
            _read(s.topic_feedback, s.topic_labels),
            _write(s.topic_monitoring),
            # The loop's consumer group (librdkafka), and the group and topics
            # (the assignor's leader topic) of the faust app hosting it.
            Grant("group", (feedback_app, feedback_host(s)), ("Read", "Describe")),
            Grant("topic", (f"{feedback_app}-",), ("Create", "Read", "Write", "Describe"), "prefixed"),
        ),
        "analyst": (every_topic, *analyst),
        # The gateway submits transactions; its reply reader (partitions assigned
        # by hand: no group) reads `decisions` and `transactions.dlq` (a
        # dead-lettered request answers 502: gateway/replies.py). Its review
        # page reads `feedback` and `labels` (gateway/review.py) and writes labels.
        "gateway": (every_topic, *payment_client, *analyst, _read(s.topic_dlq)),
        # `scale advise --from-broker` (tools/autoscale.py): the end offsets of
        # `transactions` (ListOffsets: Describe) and the scoring group's committed
        # offsets (OffsetFetch: Describe on the group). It reads no record and
        # cannot join, commit to or reset the group.
        "operator": (every_topic, Grant("group", (scoring,), ("Describe",))),
    }


def acls(settings: Settings, roles: Mapping[str, str] = ROLES) -> list[Acl]:
    """Every ACL entry of :func:`acl_table`, one per principal, resource and operation."""
    entries: set[Acl] = set()
    for role, grants in acl_table(settings).items():
        principal = f"User:{roles[role]}"
        for grant in grants:
            for name in grant.names:
                for op in grant.operations:
                    entries.add(Acl(principal, grant.resource, name, grant.pattern, op))
    return sorted(entries)


# --- applying them -------------------------------------------------------------------

# Kafka's wire codes (org.apache.kafka.common.resource / acl).
_RESOURCE_CODE = {"topic": 2, "group": 3, "transactional-id": 5}
_PATTERN_CODE = {"literal": 3, "prefixed": 4}
_OPERATION_CODE = {"Read": 3, "Write": 4, "Create": 5, "Describe": 8}
_ALLOW = 3


async def create_acls(admin: Any, entries: Sequence[Acl]) -> None:
    """Create ``entries`` through ``admin`` (a started ``AIOKafkaAdminClient`` of a super user).

    NOTE: aiokafka 0.14 has the CreateAcls request but no public admin method
    for it; :func:`app.seams.admin_request` sends it.
    Creating an ACL that exists is a no-op on the broker.
    """
    from aiokafka.protocol.admin import CreateAclsRequest

    for acl in entries:
        request = CreateAclsRequest(
            _RESOURCE_CODE[acl.resource], acl.name, _PATTERN_CODE[acl.pattern],
            acl.principal, "*", _OPERATION_CODE[acl.operation], _ALLOW,
        )  # fmt: skip
        response = await admin_request(admin, request)
        for error_code, message in response.creation_responses:
            if error_code:
                raise RuntimeError(f"CreateAcls {acl} failed: error {error_code} {message}")


def kafka_acls_commands(settings: Settings, roles: Mapping[str, str] = ROLES) -> list[str]:
    """``kafka-acls.sh`` argument lists (after the connection options), one per grant."""
    lines = []
    for role, grants in acl_table(settings).items():
        for grant in grants:
            args = ["--add", "--allow-principal", f"User:{roles[role]}"]
            for op in grant.operations:
                args += ["--operation", op]
            for name in grant.names:
                args += [f"--{grant.resource}", name]
            args += ["--resource-pattern-type", grant.pattern]
            lines.append(shlex.join(args))
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m tools.kafka_acls``: print one ``kafka-acls.sh`` argument line per grant."""
    parser = argparse.ArgumentParser(prog="python -m tools.kafka_acls", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--user", action="append", default=[], metavar="ROLE=NAME",
        help=f"SCRAM user of a role (default: {', '.join(f'{r}={n}' for r, n in ROLES.items())})",
    )  # fmt: skip
    args = parser.parse_args(argv)
    roles = dict(ROLES)
    for item in args.user:
        role, _, name = item.partition("=")
        if role not in roles or not name:
            parser.error(f"--user {item!r}: want ROLE=NAME with ROLE one of {', '.join(roles)}")
        roles[role] = name
    print("\n".join(kafka_acls_commands(Settings(), roles)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
