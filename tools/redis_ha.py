"""A Redis that fails over: a primary, two replicas and three Sentinels on loopback.

Started by ``python -m tools.stack up --brokers 3`` (``tools/cluster.py``) and
by the tests. The clients reach it through the Sentinels with a
``redis+sentinel://`` URL (``app/redis_client.py`` says why Sentinel rather
than a Redis Cluster); when the primary is lost, the Sentinels agree (quorum 2
of 3) and promote a replica, and every client's next connection goes there.

Timing (why the tuned values): a primary silent for ``DOWN_AFTER_MS`` is
subjectively down; two Sentinels agreeing make it objectively down, one is
elected leader and promotes the replica with the most data, in ~1-2 s more on
this machine. Shorter than 2 s risks a failover whenever the 2-core machine is
busy for a moment (a benchmark, a JVM's garbage collection).

Secure (``--secure``): every node and Sentinel has the secure stack's ACL users
(the anonymous user off); replicas and Sentinels authenticate to the primary as
``admin``, and so do the Sentinels to each other. Passwords go into 0600 config
files, never onto a command line.
"""

from __future__ import annotations

import hashlib
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis

from app.errors import StackError
from tools.stack import ServiceHandle, redis_password_path, start_redis
from tools.stack.secure import write_acl

__all__ = ["DOWN_AFTER_MS", "SERVICE", "RedisHA", "SentinelView", "sentinel_url", "start_redis_ha", "topology", "wait_replicated"]

#: The name the Sentinels monitor (the URL's path: ``/fraud/0``).
SERVICE = "fraud"
DOWN_AFTER_MS = 2000
#: A failover that has not finished in this long is retried by another Sentinel.
FAILOVER_TIMEOUT_MS = 6000
QUORUM = 2
_READY_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class SentinelView:
    """What one Sentinel says of the service: the primary (``host:port``), its
    flags (``master``, or ``o_down``/``failover_in_progress`` mid-failover), the
    replicas in sync and how many other Sentinels it knows."""

    primary: str
    flags: str
    replicas: list[str]
    sentinels: int


@dataclass
class RedisHA:
    """The handles of the data nodes (``nodes[0]`` started as primary) and the Sentinels."""

    nodes: list[ServiceHandle]
    sentinels: list[ServiceHandle]

    @property
    def url(self) -> str:
        return sentinel_url([_port(h.url) for h in self.sentinels])

    def stop(self) -> None:
        for handle in [*self.sentinels, *self.nodes]:
            handle.stop()


def sentinel_url(sentinel_ports: list[int], db: int = 0) -> str:
    """``redis+sentinel://`` to the Sentinels on loopback, for the service they watch."""
    hosts = ",".join(f"127.0.0.1:{p}" for p in sentinel_ports)
    return f"redis+sentinel://{hosts}/{SERVICE}/{db}"


def start_redis_ha(
    node_ports: list[int], sentinel_ports: list[int], workdir: Path, *, secure: bool = False
) -> RedisHA:
    """Start ``node_ports[0]`` as primary, the others as its replicas, then a
    Sentinel on each of ``sentinel_ports``; return once all replicas are in sync
    and every Sentinel knows the others and the replicas (a failover can then
    happen). On failure, whatever was started is stopped again."""
    workdir.mkdir(parents=True, exist_ok=True)
    primary = node_ports[0]
    started: list[ServiceHandle] = []
    try:
        for i, port in enumerate(node_ports, 1):
            conf = _node_config(workdir, i, None if port == primary else primary, secure)
            started.append(start_redis(port, workdir, secure=secure, name=f"redis-{i}", config=conf))
        ha = RedisHA(list(started), [])
        for i, port in enumerate(sentinel_ports, 1):
            conf = _sentinel_config(workdir, i, primary, secure)
            handle = start_redis(port, workdir, secure=secure, name=f"sentinel-{i}", config=conf,
                                 program=_sentinel_binary())  # fmt: skip
            started.append(handle)
            ha.sentinels.append(handle)
        wait_replicated(ha, replicas=len(node_ports) - 1)
        return ha
    except BaseException:
        for handle in reversed(started):
            handle.stop()
        raise


def wait_replicated(ha: RedisHA, replicas: int, timeout: float = _READY_TIMEOUT_S) -> str:
    """Block until every Sentinel agrees on one primary with ``replicas`` replicas
    in sync and knows the other Sentinels; return that primary's ``host:port``."""
    deadline = time.monotonic() + timeout
    last = "no answer"
    while time.monotonic() < deadline:
        try:
            views = [_sentinel_view(h.url) for h in ha.sentinels]
        except redis.RedisError as exc:
            last = f"{type(exc).__name__}: {exc}"
        else:
            primaries = {v.primary for v in views}
            ok = all(len(v.replicas) >= replicas and v.sentinels >= len(ha.sentinels) - 1 for v in views)
            if len(primaries) == 1 and ok:
                return primaries.pop()
            last = repr(views)
        time.sleep(0.2)
    raise StackError(f"Redis replication not ready after {timeout:g} s (Sentinels saw: {last})")


def topology(sentinel_urls: list[str]) -> SentinelView:
    """What the first Sentinel that answers says: the primary, its replicas (with
    their link state) and how many Sentinels watch it."""
    for url in sentinel_urls:
        try:
            return _sentinel_view(url)
        except redis.RedisError:
            continue
    raise StackError("no Sentinel answered")


def _sentinel_view(url: str) -> SentinelView:
    client = redis.Redis.from_url(url, socket_timeout=2, socket_connect_timeout=2, decode_responses=True)
    try:
        master: Any = client.execute_command("SENTINEL", "MASTER", SERVICE)  # type: ignore[no-untyped-call]
        info = dict(zip(master[::2], master[1::2], strict=False)) if isinstance(master, list) else master
        slaves: Any = client.execute_command("SENTINEL", "REPLICAS", SERVICE)  # type: ignore[no-untyped-call]
        in_sync = [s for s in slaves if _flag(s, "master-link-status") == "ok" and "down" not in _flag(s, "flags")]
        return SentinelView(
            primary=f"{info['ip']}:{info['port']}", flags=str(info["flags"]),
            replicas=sorted(f"{_flag(s, 'ip')}:{_flag(s, 'port')}" for s in in_sync),
            sentinels=int(info["num-other-sentinels"]),
        )  # fmt: skip
    finally:
        client.close()


def _flag(entry: object, key: str) -> str:
    if isinstance(entry, dict):
        return str(entry.get(key, ""))
    items = list(entry)  # type: ignore[call-overload]
    return str(dict(zip(items[::2], items[1::2], strict=False)).get(key, ""))


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1].split("/", 1)[0])


def _admin_password(workdir: Path) -> str:
    return redis_password_path(workdir, "admin").read_text().strip()


def _node_config(workdir: Path, index: int, primary: int | None, secure: bool) -> Path:
    """A data node's config: whose replica it is. Every node (the primary too:
    after a failover it comes back as a replica) authenticates to its primary."""
    lines = [f"replicaof 127.0.0.1 {primary}"] if primary else []
    # Its own file name: the nodes share a state dir, and a replica's first sync
    # writes the primary's snapshot there.
    lines += [f"dbfilename redis-{index}.rdb", "repl-diskless-sync yes", "repl-diskless-sync-delay 0"]
    if secure:
        _ensure_users(workdir)
        lines += ["masteruser admin", f"masterauth {_admin_password(workdir)}"]
    return _write_conf(workdir / f"redis-{index}.conf", lines)


def _sentinel_config(workdir: Path, index: int, primary: int, secure: bool) -> Path:
    """A Sentinel's config (rewritten by the Sentinel as it learns the topology, so
    its own file, kept 0600)."""
    lines = [
        "sentinel resolve-hostnames no",
        f"sentinel monitor {SERVICE} 127.0.0.1 {primary} {QUORUM}",
        f"sentinel down-after-milliseconds {SERVICE} {DOWN_AFTER_MS}",
        f"sentinel failover-timeout {SERVICE} {FAILOVER_TIMEOUT_MS}",
        f"sentinel parallel-syncs {SERVICE} 1",
    ]
    if secure:
        _ensure_users(workdir)
        password = _admin_password(workdir)
        lines += [f"sentinel auth-user {SERVICE} admin", f"sentinel auth-pass {SERVICE} {password}",
                  "sentinel sentinel-user admin", f"sentinel sentinel-pass {password}"]  # fmt: skip
        # The role users may ask a Sentinel where the primary is (and nothing
        # else exists on a Sentinel); the anonymous user may not.
        lines.append("user default off")
        for path in sorted((workdir / "redis-users").glob("*.password")):
            digest = hashlib.sha256(path.read_text().strip().encode()).hexdigest()
            lines.append(f"user {path.stem} on #{digest} allchannels +@all")
    return _write_conf(workdir / f"sentinel-{index}.conf", lines)


def _ensure_users(workdir: Path) -> None:
    """The ACL users and their passwords, written once for every node and Sentinel."""
    if not (workdir / "users.acl").exists() or not redis_password_path(workdir, "admin").exists():
        write_acl(workdir / "users.acl", workdir)


def _write_conf(path: Path, lines: list[str]) -> Path:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write("\n".join(lines) + "\n")
    return path


def _sentinel_binary() -> str:
    import shutil

    found = shutil.which("redis-sentinel")
    if found is None:
        raise StackError("redis-sentinel is not on PATH: `apt-get install redis-sentinel` (`make setup` does)")
    return found
