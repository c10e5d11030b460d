"""The Redis ACL table (app/redis_acl.py): what each role's user may run."""

from __future__ import annotations

from app.redis_acl import ROLE_CODE, SENDS, acl_commands, acl_rule
from app.redis_keys import ACL_KEY_PATTERNS


def test_every_role_with_key_patterns_has_code_and_every_code_path_a_role() -> None:
    assert set(ROLE_CODE) == set(ACL_KEY_PATTERNS)
    assert {code for codes in ROLE_CODE.values() for code in codes} == set(SENDS)


def test_a_rule_starts_from_nothing_and_adds_the_roles_commands() -> None:
    assert acl_rule("gateway") == (
        "resetchannels ~fp:rl:{c:gw:*} ~fp:rl:{u:gw:*} -@all +cluster|slots +command +evalsha +hello +hmget +hset"
        " +pexpire +script|load"
    )
    assert acl_commands("materialize") == ("cluster|slots", "command", "expire", "hello", "hset", "zadd")


def test_no_role_may_list_keys_flush_or_administer() -> None:
    forbidden = {"scan", "randomkey", "keys", "dbsize", "select", "flushall", "flushdb", "script|flush", "function",
                 "function|load", "function|flush", "config", "debug", "acl", "eval", "client|kill"}  # fmt: skip
    for role in ROLE_CODE:
        assert not forbidden & set(acl_commands(role)), role
