"""What each role's Redis ACL user may run: an allow-list built from one table.

:data:`SENDS` names every piece of code that talks to Redis and the commands it
sends, those its Lua scripts call included (Redis checks a script's
``redis.call`` against the caller's ACL too); :data:`ROLE_CODE` says which of
that code each role runs. A role's ACL (:func:`acl_rule`) starts from
``-@all`` and adds exactly those commands, so a user cannot list keys
(``SCAN``, ``RANDOMKEY``, ``KEYS``), flush or replace scripts and functions,
size the keyspace or switch databases. Subcommands are named ``command|sub``
(``script|load`` allows loading a script, not flushing them).

tests/integration/test_redis_acl.py runs every role's code against an ACL'd
redis-server and compares what it sent (``INFO commandstats``) with this
table, both ways; adding a command to the code without adding it here fails
that test, as does a command here that no code sends.
"""

from __future__ import annotations

from app.redis_keys import ACL_KEY_PATTERNS

__all__ = ["ROLE_CODE", "SENDS", "acl_commands", "acl_rule"]

#: Code that talks to Redis -> the commands it sends.
SENDS: dict[str, tuple[str, ...]] = {
    # app/redis_client.py, every client: the handshake, in which redis-py
    # authenticates. (NOTE: Redis lets every user run HELLO and AUTH whatever its
    # ACL; HELLO is listed because it is what the client sends.)
    "connect": ("hello",),
    # ... and on a Redis Cluster, the client's discovery: the slot map and the
    # command table it extracts keys with. Names no key.
    "cluster discovery": ("cluster|slots", "command"),
    # Scripts (feature store, decision cache, replay guard, rate limiter) run by
    # SHA and are loaded again after a restart or failover (NOSCRIPT).
    "scripts": ("evalsha", "script|load"),
    # pipeline/feature_store.py: profiles and merchant risk, the velocity script
    # (window trimmed by score and capped by rank; the newest events read by ZRANGE BYSCORE REV).
    "feature store": ("hmget", "zadd", "zremrangebyscore", "zremrangebyrank", "expire", "zrange"),
    # pipeline/cache.py: MGET by id and content hash; SET NX EX (in a script, or pipelined on a cluster).
    "decision cache": ("mget", "set"),
    # pipeline/auth.py: SET NX GET EX per signature.
    "replay guard": ("set",),
    # pipeline/ratelimit.py: the token-bucket script.
    "rate limiter": ("hmget", "hset", "pexpire"),
    # pipeline/quality.py (agents/feedback.py, ``report quality``): the join
    # (SET NX EX + GET, one MULTI/EXEC per pair on one server), the counters,
    # the bounded joined rows.
    "quality store": ("set", "get", "multi", "exec", "hincrby", "hset", "zadd", "zcard", "zpopmin", "hdel", "hgetall"),
    # tools/materialize.py: profile and merchant hashes, velocity seeds, their TTLs, fp:meta.
    "materialize": ("hset", "expire", "zadd"),
}

#: Each role's code: the processes that connect as that user (SECURITY.md, *Redis users*).
ROLE_CODE: dict[str, tuple[str, ...]] = {
    # The scoring worker and the feedback worker (and ``report quality``).
    "worker": (
        "connect", "cluster discovery", "scripts", "feature store", "decision cache", "replay guard",
        "rate limiter", "quality store",
    ),  # fmt: skip
    # The REST/gRPC gateway: its own token buckets.
    "gateway": ("connect", "cluster discovery", "scripts", "rate limiter"),
    # ``fraud-pipeline materialize``.
    "materialize": ("connect", "cluster discovery", "materialize"),
}


def acl_commands(role: str) -> tuple[str, ...]:
    """The commands ``role``'s code sends, sorted, each once."""
    return tuple(sorted({command for code in ROLE_CODE[role] for command in SENDS[code]}))


def acl_rule(role: str) -> str:
    """``role``'s ACL rules after ``user <role> on #<hash>``: its key patterns,
    no channels, and nothing but its commands."""
    patterns = " ".join(ACL_KEY_PATTERNS[role])
    commands = " ".join("+" + command for command in acl_commands(role))
    return f"resetchannels {patterns} -@all {commands}"
