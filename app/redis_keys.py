"""Every Redis key the project reads or writes, in one place.

The bytes of these keys are a storage format: profiles materialized last night,
velocity sets, decision-cache entries, rate buckets, seen signatures and the
live quality join are all found again by them, by other processes and by the
next release. Changing one string here orphans what is already stored, so the
literal keys are pinned byte for byte in tests/unit/app/test_redis_keys.py.

Hash tags (the part in braces) place keys in Redis Cluster slots: whatever one
command, script or batch touches together for a user carries ``{u:<user>}``
(profile, velocity, user rate bucket, both decision-cache entries); a merchant's
risk ``{m:<merchant>}``; a producing client's bucket ``{c:<client>}``. Keys
without a tag (signatures, materialize's meta hash, the quality join) are only
ever used one key per command, or by code that handles slots itself
(:class:`pipeline.quality.RedisQualityStore`).
"""

from __future__ import annotations

import functools
import hashlib

import orjson

from app.contract import Transaction

__all__ = [
    "ACL_KEY_PATTERNS",
    "GATEWAY_NAMESPACE",
    "MATERIALIZE_META_KEY",
    "QUALITY_PREFIX",
    "client_bucket_key",
    "content_hash",
    "decision_hash_key",
    "decision_id_key",
    "decision_keys",
    "gateway_bucket_ids",
    "merchant_key",
    "profile_key",
    "quality_decided_key",
    "quality_joined_at_key",
    "quality_joined_key",
    "quality_label_key",
    "quality_prefix",
    "quality_served_key",
    "signature_key",
    "user_bucket_key",
    "velocity_key",
]


# --- feature store (pipeline/feature_store.py, tools/materialize.py) ----------------


def profile_key(user_id: str) -> str:
    """A user's profile hash, written by ``materialize``."""
    return f"fp:{{u:{user_id}}}:profile"


def velocity_key(user_id: str) -> str:
    """A user's velocity sorted set (members: pipeline.feature_store.velocity_member)."""
    return f"fp:{{u:{user_id}}}:vel"


def merchant_key(merchant_id: str) -> str:
    """A merchant's risk hash, written by ``materialize``."""
    return f"fp:{{m:{merchant_id}}}:risk"


#: What ``materialize`` last wrote (feature set, as-of time, counts).
MATERIALIZE_META_KEY = "fp:meta"


# --- decision cache (pipeline/cache.py) ---------------------------------------------

_CONTENT_FIELDS = ("user_id", "amount", "currency", "merchant_id", "device_id", "lat", "lon", "timestamp")


def content_hash(tx: Transaction) -> str:
    """What makes two messages the same payment, whatever their ids.

    Here, not in the cache: its hex digest is part of a cache key's bytes, so
    the fields and their encoding are as much the key scheme as the prefix."""
    return _identity(tx)[0]


def _content_digest(tx: Transaction) -> str:
    canonical = orjson.dumps([getattr(tx, f) for f in _CONTENT_FIELDS])
    return hashlib.blake2b(canonical, digest_size=16).hexdigest()


def decision_id_key(user_id: str, transaction_id: str) -> str:
    """A decision found again by its transaction id (a resend)."""
    return f"fp:dec:{{u:{user_id}}}:id:{transaction_id}"


def decision_hash_key(user_id: str, digest: str) -> str:
    """A decision found again by its content hash (the same payment under a new id)."""
    return f"fp:dec:{{u:{user_id}}}:h:{digest}"


# NOTE: tagged by user, as the user's features and rate bucket: on a Redis
# Cluster a transaction's two entries share a slot (and node) with the rest of
# what its batch reads for that user. A resend carries the same user; the same
# transaction id under another user is not the same payment.
def decision_keys(tx: Transaction) -> tuple[str, str]:
    """A transaction's two decision-cache keys: by id, then by content."""
    return _identity(tx)[1]


@functools.lru_cache(maxsize=8192)
def _identity(tx: Transaction) -> tuple[str, tuple[str, str]]:
    """A transaction's content hash and its two decision keys, computed once.

    NOTE: cached (a transaction is frozen, so hashable): a batch asks for them
    four to six times per transaction (the in-batch copies, the look-up's
    rows, the held decisions, the index entry's header, the index), 1.0 µs
    for the hash alone against 0.24 for a hit. One cache for both, so one
    entry per transaction for the garbage collector."""
    digest = _content_digest(tx)
    return digest, (decision_id_key(tx.user_id, tx.transaction_id), decision_hash_key(tx.user_id, digest))


# --- rate limits (pipeline/ratelimit.py, gateway/rest.py) ----------------------------


def client_bucket_key(client_id: str) -> str:
    """The token bucket of one producing client (or, namespaced, one API client)."""
    return f"fp:rl:{{c:{client_id}}}"


def user_bucket_key(user_id: str) -> str:
    """The token bucket of one user; shares the user's slot."""
    return f"fp:rl:{{u:{user_id}}}"


#: The gateway's buckets are its own: a worker keeps a per-client bucket for the
#: gateway's producer id and its own per-user buckets, while the gateway limits
#: per API client and per user before producing (a 429 rather than a ``reject``
#: decision). The namespace keeps the two sets of buckets apart.
GATEWAY_NAMESPACE = "gw:"


def gateway_bucket_ids(api_client: str, user_id: str) -> tuple[str, str]:
    """The (client, user) ids the gateway's limiter buckets by: ``fp:rl:{c:gw:<api client>}``
    and ``fp:rl:{u:gw:<user>}``."""
    return f"{GATEWAY_NAMESPACE}{api_client}", f"{GATEWAY_NAMESPACE}{user_id}"


# --- replay guard (pipeline/auth.py) -------------------------------------------------


def signature_key(signature: str) -> str:
    """A signature seen (the value is its first delivery); one key per command."""
    return f"fp:sig:{signature}"


# --- live quality (pipeline/quality.py, agents/feedback.py, ``report quality``) -------

#: The quality store's prefix when no deployment is named (tests, tools).
QUALITY_PREFIX = "quality:"


def quality_prefix(app_id: str) -> str:
    """The quality keys of one deployment (one app id = one consumer group): two
    deployments on one Redis, or parallel test workers, never mix their figures."""
    return f"{QUALITY_PREFIX}{app_id}:"


def quality_served_key(prefix: str, transaction_id: str) -> str:
    """A decision waiting for its label."""
    return f"{prefix}fb:{transaction_id}"


def quality_label_key(prefix: str, transaction_id: str) -> str:
    """A label waiting for its decision."""
    return f"{prefix}lab:{transaction_id}"


def quality_decided_key(prefix: str) -> str:
    """Hash: decision counts per model|rule|action."""
    return f"{prefix}decided"


def quality_joined_key(prefix: str) -> str:
    """Hash: transaction id -> joined row."""
    return f"{prefix}joined"


def quality_joined_at_key(prefix: str) -> str:
    """Sorted set of joined rows by decision time (bounds ``joined``)."""
    return f"{prefix}joined-at"


# --- ACL users ------------------------------------------------------------------

#: The key patterns each role's Redis ACL user may touch (``%R~``: read only),
#: from the key functions above. tools/stack/ ``start_redis(secure=True)``
#: creates these users (app/redis_acl.py adds their commands); SECURITY.md (*Redis users*) explains them.
ACL_KEY_PATTERNS: dict[str, tuple[str, ...]] = {
    # Scores: reads features, writes velocity, the decision cache, its buckets,
    # the replay guard and (feedback role) the quality counters.
    "worker": (
        "%R~" + profile_key("*"), "%R~" + merchant_key("*"), "%R~" + MATERIALIZE_META_KEY,
        "~" + velocity_key("*"), "~fp:dec:*", "~fp:rl:*", "~" + signature_key("*"), "~" + QUALITY_PREFIX + "*",
    ),  # fmt: skip
    # Its own token buckets only (``gw:`` ids inside the bucket keys).
    "gateway": ("~" + client_bucket_key(GATEWAY_NAMESPACE + "*"), "~" + user_bucket_key(GATEWAY_NAMESPACE + "*")),
    # Features only: profiles, merchant risk, velocity history, the as-of marker.
    "materialize": (
        "~" + profile_key("*"), "~" + merchant_key("*"), "~" + velocity_key("*"), "~" + MATERIALIZE_META_KEY,
    ),  # fmt: skip
}
# The commands each role may run: app/redis_acl.py.
