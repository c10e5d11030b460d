"""Redis clients from settings: one server, a primary watched by Sentinels, or a Redis Cluster.

A cluster is chosen by the URL scheme (``redis+cluster://host:port``, or
``rediss+cluster://`` with TLS) or by ``FRAUD_REDIS_CLUSTER=true`` with a
plain ``redis://`` URL naming any node; the client discovers the rest.

A primary with replicas under Sentinel is chosen by
``redis+sentinel://host:port,host:port,host:port/<service>/<db>`` (the
Sentinels, the name they monitor, the database; ``rediss+sentinel://`` for TLS
to the data nodes). The client asks the Sentinels where the primary is on every
new connection, so after a failover (the primary lost, a replica promoted) the
next command that fails on a dead connection reconnects to the new primary: no
process restarts. The local stack runs this topology (``tools/redis_ha.py``);
it is preferred over a Redis Cluster there because the data path stays one
server (scripts and pipelines unchanged), and a replica per primary needs 6
servers on a cluster against 3 + 3 Sentinels. Sentinels take the same user and
password as the data nodes (``redis_username`` / ``redis_password_file``).

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
    "BATCH_TIMEOUT_S", "async_client", "credentials", "is_cluster", "is_cluster_client", "is_sentinel", "plain_url",
    "sentinel_target", "sync_client", "tls_options",
]  # fmt: skip

_CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}
_SENTINEL_SCHEMES = {"redis+sentinel": "redis", "rediss+sentinel": "rediss"}


def is_cluster(settings: Settings) -> bool:
    scheme = settings.redis_url.split("://", 1)[0].lower()
    return settings.redis_cluster or scheme in _CLUSTER_SCHEMES


def is_cluster_client(client: Any) -> bool:
    """A Redis Cluster client: scripts there may only touch keys of one slot."""
    from redis.asyncio.cluster import RedisCluster

    return isinstance(client, RedisCluster)


def is_sentinel(settings: Settings) -> bool:
    """A primary found through Sentinels (``redis+sentinel://``)."""
    return settings.redis_url.split("://", 1)[0].lower() in _SENTINEL_SCHEMES


def sentinel_target(url: str) -> tuple[list[tuple[str, int]], str, int, bool]:
    """``(sentinels, service, db, tls)`` of a ``redis+sentinel://h:p,h:p/<service>/<db>`` URL."""
    scheme, _, rest = url.partition("://")
    hosts, _, path = rest.partition("/")
    service, _, db = path.partition("/")
    if not hosts or not service:
        raise ConfigError(f"a Sentinel URL names its Sentinels and service: redis+sentinel://host:port,.../<service>/<db>, not {url!r}")
    sentinels: list[tuple[str, int]] = []
    for host in hosts.split(","):
        name, _, port = host.rpartition(":")
        try:
            sentinels.append((name or port, int(port) if name else 26379))
        except ValueError:
            raise ConfigError(f"bad Sentinel address {host!r} in {url!r}") from None
    try:
        database = int(db.strip("/") or 0)
    except ValueError:
        raise ConfigError(f"bad database {db!r} in {url!r}") from None
    return sentinels, service, database, _SENTINEL_SCHEMES.get(scheme.lower()) == "rediss"


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
    if is_sentinel(s):
        from redis.asyncio.sentinel import Sentinel

        return _via_sentinel(Sentinel, s, options)
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
    if is_sentinel(settings):
        from redis.sentinel import Sentinel

        return _via_sentinel(Sentinel, settings, options)
    if is_cluster(settings):
        from redis.cluster import RedisCluster

        return RedisCluster.from_url(plain_url(settings.redis_url), **options)
    import redis

    return redis.Redis.from_url(settings.redis_url, **options)


def _via_sentinel(sentinel_class: Any, settings: Settings, options: dict[str, Any]) -> Any:
    """The primary's client, through ``sentinel_class`` (sync or asyncio redis-py)."""
    sentinels, service, db, tls = sentinel_target(settings.redis_url)
    # The Sentinels answer in well under a connect timeout; they take the data
    # nodes' credentials (the local stack gives them the same ACL users).
    asked = {k: v for k, v in options.items() if k in ("socket_timeout", "socket_connect_timeout")}
    asked.update(credentials(settings))
    if tls:
        options = {**options, "ssl": True}
    sentinel = sentinel_class(sentinels, sentinel_kwargs=asked, **options)
    # NOTE: a pooled connection to the lost primary fails its next command once
    # (callers treat that as any Redis error: a degraded decision, a retried
    # write); the connection made next asks the Sentinels again.
    return sentinel.master_for(service, db=db)
