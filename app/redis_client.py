"""Redis clients from settings: one server, or a Redis Cluster.

A cluster is chosen by the URL scheme (``redis+cluster://host:port``, or
``rediss+cluster://`` with TLS) or by ``FRAUD_REDIS_CLUSTER=true`` with a
plain ``redis://`` URL naming any node; the client discovers the rest.

Every process builds its clients here (the worker's scoring and feedback
agents, the gateway, the CLI, the benchmarks), so a cluster setting reaches
them all; each passes the timeouts its work can afford.

What makes the code work on a cluster is its keys (app/redis_keys.py): every
key that one command or script touches together carries the same hash tag
(the part in braces), so it lives in one slot:

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

from app.errors import ConfigError
from app.settings import Settings

__all__ = [
    "BATCH_TIMEOUT_S", "async_client", "credentials", "is_cluster", "is_cluster_client", "plain_url", "sync_client",
    "tls_options",
]  # fmt: skip

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


#: For batch jobs and one-off commands (``materialize``, ``report quality``):
#: long enough for a pipeline of thousands of writes or a 200k-row HGETALL,
#: short enough that a Redis gone silent ends the command with an error
#: instead of hanging it.
BATCH_TIMEOUT_S = 60.0


def tls_options(settings: Settings) -> dict[str, str]:
    """The CA to verify a ``rediss://`` server against (``redis_ssl_cafile``);
    nothing for plaintext URLs, where redis-py would refuse SSL options."""
    if settings.redis_ssl_cafile is None or not settings.redis_url.lower().startswith("rediss"):
        return {}
    return {"ssl_ca_certs": str(settings.redis_ssl_cafile)}


def credentials(settings: Settings) -> dict[str, str]:
    """``username``/``password`` for the client, from ``redis_username`` and
    ``redis_password`` or ``redis_password_file``; empty when none is set (the
    URL's own ``user:password@``, if any, then applies)."""
    if settings.redis_password is not None and settings.redis_password_file is not None:
        raise ConfigError("set FRAUD_REDIS_PASSWORD or FRAUD_REDIS_PASSWORD_FILE, not both")
    password: str | None = None
    if settings.redis_password is not None:
        password = settings.redis_password.get_secret_value()
    elif settings.redis_password_file is not None:
        try:
            password = settings.redis_password_file.read_text().strip()
        except OSError as exc:
            raise ConfigError(f"Redis password file {settings.redis_password_file}: {exc.strerror}") from None
    out: dict[str, str] = {}
    if settings.redis_username:
        out["username"] = settings.redis_username
    if password is not None:
        out["password"] = password
    return out


def _options(timeout_s: float, connect_timeout_s: float | None, max_connections: int | None) -> dict[str, Any]:
    options: dict[str, Any] = {
        "socket_timeout": timeout_s,
        # NOTE: a floor on connecting: a new connection costs a TCP (and TLS)
        # handshake that a 50 ms command budget does not cover.
        "socket_connect_timeout": connect_timeout_s if connect_timeout_s is not None else max(timeout_s, 0.2),
    }
    if max_connections is not None:
        options["max_connections"] = max_connections
    return options


def async_client(
    settings: Settings,
    *,
    timeout_s: float | None = None,
    connect_timeout_s: float | None = None,
    max_connections: int | None = None,
) -> Any:
    """A pooled asyncio client: ``redis.asyncio.Redis`` or ``RedisCluster``.

    ``timeout_s``: how long one command may wait for its reply; by default
    ``settings.redis_timeout_s``, the scoring path's budget. ``connect_timeout_s``:
    by default ``max(timeout_s, 0.2)``. ``max_connections``: the pool's bound
    (per node on a cluster), by default ``settings.redis_pool_size``; a call
    past it raises rather than waits. Make it inside the running loop.
    """
    s = settings
    timeout = s.redis_timeout_s if timeout_s is None else timeout_s
    options = _options(timeout, connect_timeout_s, s.redis_pool_size if max_connections is None else max_connections)
    options.update(credentials(s))
    options.update(tls_options(s))
    if is_cluster(s):
        from redis.asyncio.cluster import RedisCluster

        return RedisCluster.from_url(plain_url(s.redis_url), **options)
    import redis.asyncio as aioredis

    return aioredis.Redis.from_url(s.redis_url, **options)


def sync_client(
    settings: Settings,
    *,
    timeout_s: float = BATCH_TIMEOUT_S,
    connect_timeout_s: float | None = None,
) -> Any:
    """A blocking client for batch jobs: ``redis.Redis`` or ``redis.cluster.RedisCluster``.

    ``timeout_s``: how long one command may wait for its reply (default
    :data:`BATCH_TIMEOUT_S`); ``connect_timeout_s``: by default ``max(timeout_s, 0.2)``.
    """
    options = _options(timeout_s, connect_timeout_s, None)
    options.update(credentials(settings))
    options.update(tls_options(settings))
    if is_cluster(settings):
        from redis.cluster import RedisCluster

        return RedisCluster.from_url(plain_url(settings.redis_url), **options)
    import redis

    return redis.Redis.from_url(settings.redis_url, **options)
