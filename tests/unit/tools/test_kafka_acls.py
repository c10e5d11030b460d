"""The ACL table (tools/kafka_acls.py) and the secure broker's settings (tools/kafka_secure.py)."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest

from agents.wiring import scoring_group
from app.settings import Settings
from tools import kafka_acls, kafka_secure
from tools.kafka_acls import ROLES, acl_table, acls, kafka_acls_commands

S = Settings()


def allowed(role: str, resource: str, name: str, operation: str) -> bool:
    """What the broker's authorizer would answer for the role's principal."""
    principal = f"User:{ROLES[role]}"
    for acl in acls(S):
        if acl.principal != principal or acl.resource != resource or acl.operation != operation:
            continue
        if (acl.pattern == "literal" and acl.name == name) or (
            acl.pattern == "prefixed" and name.startswith(acl.name)
        ):
            return True
    return False


def test_every_role_has_a_row_and_its_own_principal() -> None:
    assert set(acl_table(S)) == set(ROLES)
    assert len(set(ROLES.values())) == len(ROLES)
    assert kafka_secure.ADMIN not in ROLES.values()  # the super user is no role


# (role, operation, topic, expected)
RIGHTS = [
    ("payment-client", "Write", S.topic_transactions, True),
    ("payment-client", "Read", S.topic_decisions, True),
    ("payment-client", "Write", S.topic_decisions, False),
    ("payment-client", "Write", S.topic_labels, False),
    ("payment-client", "Read", S.topic_feedback, False),
    ("payment-client", "Read", S.topic_transactions, False),
    ("scoring-worker", "Read", S.topic_transactions, True),
    ("scoring-worker", "Read", S.topic_labels, True),
    ("scoring-worker", "Write", S.topic_decisions, True),
    ("scoring-worker", "Write", S.topic_dlq, True),
    ("scoring-worker", "Write", S.topic_feedback, True),
    ("scoring-worker", "Write", S.topic_monitoring, True),
    # Re-routing a record found away from its user's partition (app/placement.py).
    ("scoring-worker", "Write", S.topic_transactions, True),
    # ``decisions`` is the resend index's changelog: a partition's new owner reads it back.
    ("scoring-worker", "Read", S.topic_decisions, True),
    ("feedback-worker", "Read", S.topic_decisions, False),
    ("scoring-worker", "Write", S.topic_labels, False),
    ("scoring-worker", "Create", f"{S.app_id}-merchant-tally", True),
    ("scoring-worker", "Write", f"{S.app_id}-merchant-tally", True),
    ("feedback-worker", "Write", f"{S.app_id}-merchant-tally", False),
    ("scoring-worker", "Create", S.topic_decisions, False),
    ("feedback-worker", "Read", S.topic_feedback, True),
    ("feedback-worker", "Read", S.topic_labels, True),
    ("feedback-worker", "Write", S.topic_monitoring, True),
    ("feedback-worker", "Write", S.topic_decisions, False),
    ("feedback-worker", "Read", S.topic_transactions, False),
    ("analyst", "Read", S.topic_feedback, True),
    ("analyst", "Write", S.topic_labels, True),
    ("analyst", "Read", S.topic_labels, True),  # replay: report quality --replay, train --from-feedback
    ("analyst", "Write", S.topic_decisions, False),
    ("analyst", "Read", S.topic_transactions, False),
    ("gateway", "Write", S.topic_transactions, True),
    ("gateway", "Read", S.topic_decisions, True),
    ("gateway", "Write", S.topic_labels, True),
    ("gateway", "Read", S.topic_dlq, True),
    ("gateway", "Read", S.topic_feedback, True),
    ("gateway", "Read", S.topic_labels, True),
    ("gateway", "Write", S.topic_feedback, False),
    ("gateway", "Write", S.topic_decisions, False),
    ("gateway", "Read", S.topic_transactions, False),
    # scale advise --from-broker: offsets, never a record.
    ("operator", "Describe", S.topic_transactions, True),
    ("operator", "Read", S.topic_transactions, False),
    ("operator", "Read", S.topic_decisions, False),
    ("operator", "Read", S.topic_feedback, False),
    ("operator", "Write", S.topic_transactions, False),
]


@pytest.mark.parametrize(("role", "operation", "topic", "expected"), RIGHTS)
def test_topic_rights(role: str, operation: str, topic: str, expected: bool) -> None:
    assert allowed(role, "topic", topic, operation) is expected


def test_only_the_scoring_worker_holds_the_scoring_transactional_ids() -> None:
    tid = f"{S.app_id}-score-{S.topic_transactions}-3"
    assert [r for r in ROLES if allowed(r, "transactional-id", tid, "Write")] == ["scoring-worker"]


def test_consumer_groups_are_per_role() -> None:
    scoring = scoring_group(S)
    assert scoring == f"{S.app_id}-score"
    # The scoring loop's librdkafka consumer (app/eos.py), the merchant tally's
    # counting group and its copies' reader (agents/tally.py), and faust's own group.
    for group in (scoring, f"{S.app_id}-tally", f"{S.app_id}-tally-reader", S.app_id):
        assert allowed("scoring-worker", "group", group, "Read")
        assert allowed("scoring-worker", "group", group, "Describe")
        assert not allowed("feedback-worker", "group", group, "Read")
        assert not allowed("payment-client", "group", group, "Read")
    # The feedback loop's librdkafka consumer (agents/feedback.py), and the faust app hosting it.
    for group in (f"{S.app_id}-feedback", f"{S.app_id}-feedback-host"):
        assert not allowed("scoring-worker", "group", group, "Read")
        assert allowed("feedback-worker", "group", group, "Read")
        assert allowed("feedback-worker", "group", group, "Describe")
    assert allowed("payment-client", "group", f"{kafka_acls.PAYMENT_GROUP_PREFIX}pos-1", "Read")
    # The operator sees the scoring group's committed offsets but cannot commit, join or reset it.
    assert allowed("operator", "group", scoring, "Describe")
    assert not allowed("operator", "group", scoring, "Read")
    assert not allowed("operator", "group", S.app_id, "Describe")


def test_no_role_may_alter_the_cluster_or_delete() -> None:
    assert {a.operation for a in acls(S)} <= {"Read", "Write", "Create", "Describe"}
    assert {a.resource for a in acls(S)} <= {"topic", "group", "transactional-id"}


def test_the_table_follows_the_configured_names() -> None:
    custom = Settings(app_id="fp-eu", topic_decisions="eu.decisions")
    entries = acls(custom)
    assert any(a.name == "eu.decisions" and a.operation == "Write" for a in entries)
    assert any(a.name == "fp-eu-score-" and a.resource == "transactional-id" for a in entries)
    assert not any(a.name == S.topic_decisions for a in entries)


def test_kafka_acls_commands_cover_every_entry() -> None:
    """The deploy script's commands grant exactly what the local stack grants."""
    granted = set()
    for line in kafka_acls_commands(S):
        args = shlex.split(line)
        assert args[:2] == ["--add", "--allow-principal"]
        principal = args[2]
        ops = [args[i + 1] for i, a in enumerate(args) if a == "--operation"]
        pattern = args[args.index("--resource-pattern-type") + 1]
        for flag in ("--topic", "--group", "--transactional-id"):
            for i, a in enumerate(args):
                if a == flag:
                    granted |= {(principal, flag[2:], args[i + 1], pattern, op) for op in ops}
    assert granted == {(a.principal, a.resource, a.name, a.pattern, a.operation) for a in acls(S)}


def test_cli_renames_a_role(capsys: pytest.CaptureFixture[str]) -> None:
    assert kafka_acls.main(["--user", "scoring-worker=svc-scoring"]) == 0
    out = capsys.readouterr().out
    assert "User:svc-scoring" in out and "User:scoring " not in out
    with pytest.raises(SystemExit):
        kafka_acls.main(["--user", "nobody=x"])


# --- the secure broker's settings -------------------------------------------------------------


def test_secure_properties(tmp_path: Path) -> None:
    for user in (*kafka_secure.USERS, "keystore"):
        path = kafka_secure.password_file(tmp_path, user)
        path.parent.mkdir(exist_ok=True)
        path.write_text(f"pw-{user}\n")
    props = kafka_secure.secure_properties(tmp_path, 9093, 9094)
    assert props["listeners"] == "SASL_SSL://127.0.0.1:9093,CONTROLLER://127.0.0.1:9094"
    assert props["advertised.listeners"] == "SASL_SSL://127.0.0.1:9093"
    assert "PLAINTEXT" not in props["listener.security.protocol.map"].replace("SASL_PLAINTEXT", "")
    assert props["listener.name.sasl_ssl.sasl.enabled.mechanisms"] == "SCRAM-SHA-512"
    assert props["authorizer.class.name"] == "org.apache.kafka.metadata.authorizer.StandardAuthorizer"
    assert props["super.users"] == "User:admin"
    assert props["allow.everyone.if.no.acl.found"] == "false"
    broker = kafka_secure.secure_properties(tmp_path, 9093, None)  # the replicated stack's broker
    assert broker["listeners"] == "SASL_SSL://127.0.0.1:9093" and broker["sasl.mechanism.controller.protocol"] == "PLAIN"
    assert "user_admin=" in broker["listener.name.controller.plain.sasl.jaas.config"]
    controller = kafka_secure.secure_properties(tmp_path, None, 9094)  # and its controller: no client listener, no TLS
    assert controller["listeners"] == "CONTROLLER://127.0.0.1:9094"
    assert controller["listener.security.protocol.map"] == "CONTROLLER:SASL_PLAINTEXT"
    assert not any(key.startswith(("ssl.", "advertised.", "inter.broker.")) for key in controller)
    assert controller["authorizer.class.name"] == props["authorizer.class.name"] and controller["super.users"] == "User:admin"
    args = kafka_secure.format_scram_args(tmp_path)
    assert args.count("--add-scram") == len(kafka_secure.USERS)
    assert "SCRAM-SHA-512=[name=scoring,password=pw-scoring]" in args


def test_client_env_names_the_password_file_not_the_password(tmp_path: Path) -> None:
    env = kafka_secure.client_env(tmp_path, "scoring", "127.0.0.1:1")
    assert "FRAUD_KAFKA_SASL_PASSWORD" not in env
    assert env["FRAUD_KAFKA_SASL_PASSWORD_FILE"] == str(tmp_path / "secrets" / "scoring.password")
    assert env["FRAUD_KAFKA_SSL_CAFILE"] == str(tmp_path / "tls" / "ca.pem")
