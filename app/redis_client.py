"""Redis clients from settings: one server, or a Redis Cluster.

A cluster is chosen by the URL scheme (``redis+cluster://host:port``, or
``rediss+cluster://`` with TLS) or by ``FRAUD_REDIS_CLUSTER=true`` with a
plain ``redis://`` URL naming any node; the client discovers the rest.

What makes the code work on a cluster is its keys: every key that one
command or script touches together carries the same hash tag (the part in
braces), so it lives in one slot:

- a user's profile, velocity set, rate-limit bucket and decision-cache
  entries: ``{u:<user>}``; a merchant's risk: ``{m:<merchant>}``;
  a producing client's bucket: ``{c:<client>}``; a signature: its own key.
- the velocity script takes one key; the rate-limit script is called once per
  slot on a cluster (see :class:`pipeline.ratelimit.RedisRateLimiter`).

A batch's pipeline then splits into one pipeline per node (redis-py does
that), with no cross-slot errors and no MOVED redirects in steady state.
"""

from __future__ import annotations

from typing import Any

from app.settings import Settings

__all__ = ["async_client", "is_cluster", "is_cluster_client", "plain_url", "sync_client"]

_CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}


def is_cluster(settings: Settings) -> bool:
    scheme = settings.redis_url.split("://", 1)[0].lower()
    return settings.redis_cluster or scheme in _CLUSTER_SCHEMES


def is_cluster_client(client: Any) -> bool:
    """A Redis Cluster client: scripts there may only touch keys of one slot."""
    from redis.asyncio.cluster import RedisCluster

    return isinstance(client, RedisCluster)


def plain_url(url: str) -> str:
    """The URL redis-py understands: ``redis+cluster://`` -> ``redis://``."""
    scheme, sep, rest = url.partition("://")
    return f"{_CLUSTER_SCHEMES.get(scheme.lower(), scheme)}{sep}{rest}"


def async_client(settings: Settings) -> Any:
    """The worker's pooled asyncio client, with the hot path's timeouts."""
    s = settings
    options = {
        "max_connections": s.redis_pool_size,
        "socket_timeout": s.redis_timeout_s,
        "socket_connect_timeout": max(s.redis_timeout_s, 0.2),
    }
    if is_cluster(s):
        from redis.asyncio.cluster import RedisCluster

        return RedisCluster.from_url(plain_url(s.redis_url), **options)
    import redis.asyncio as aioredis

    return aioredis.Redis.from_url(s.redis_url, **options)


def sync_client(settings: Settings) -> Any:
    """A blocking client for batch jobs (``fraud-pipeline materialize``)."""
    if is_cluster(settings):
        from redis.cluster import RedisCluster

        return RedisCluster.from_url(plain_url(settings.redis_url))
    import redis

    return redis.Redis.from_url(settings.redis_url)
