"""redis-server on loopback: no persistence, ACL users per role when secure."""

from __future__ import annotations

import shutil
from pathlib import Path

from app.errors import StackError
from tools.stack.ports import ensure_port_free, free_port
from tools.stack.process import ServiceHandle, spawn
from tools.stack.readiness import ready_or_stopped, wait_redis_ready
from tools.stack.secure import redis_password_path, write_acl
from tools.stack.state import DEFAULT_STATE_DIR

__all__ = ["start_redis"]


def start_redis(
    port: int | None = None,
    workdir: Path = DEFAULT_STATE_DIR,
    *,
    secure: bool = False,
    name: str = "redis",
    config: Path | None = None,
    program: str | None = None,
) -> ServiceHandle:
    """Start redis-server on 127.0.0.1:``port`` (a free one if None); return once it answers PING.

    No persistence: every start is empty. Logs to ``workdir/<name>.log``. The handle's
    ``url`` is ``redis://127.0.0.1:PORT/0``.

    ``secure``: ACL users instead of the open ``default`` user (switched off): one
    per role of ``app.redis_keys.ACL_KEY_PATTERNS`` (worker, gateway, materialize)
    and ``admin`` (everything: tests, operators). Each gets a fresh random password
    in ``redis_password_path(workdir, role)`` (0600), for ``FRAUD_REDIS_USERNAME`` +
    ``FRAUD_REDIS_PASSWORD_FILE``; a ``workdir/users.acl`` written before (the
    replicated Redis's nodes share one) is kept. The handle's ``url`` then carries
    the admin's credentials.

    ``config``: a config file read first (replication settings: ``tools/redis_ha.py``);
    ``program``: another binary (``redis-sentinel``).
    """
    port = port or free_port()
    ensure_port_free(port, name)
    workdir.mkdir(parents=True, exist_ok=True)
    argv = [
        program or _redis_binary(),
        *([str(config.resolve())] if config is not None else []),
        "--port", str(port),
        "--bind", "127.0.0.1",
        "--daemonize", "no",
        "--dir", str(workdir.resolve()),
    ]  # fmt: skip
    if program is None:
        argv += ["--save", "", "--appendonly", "no"]
    url = f"redis://127.0.0.1:{port}/0"
    if secure:
        acl_file = workdir / "users.acl"
        admin_file = redis_password_path(workdir, "admin")
        admin = admin_file.read_text().strip() if acl_file.exists() and admin_file.exists() and name != "redis" else ""
        admin = admin or write_acl(acl_file, workdir)
        if program is None:  # a Sentinel takes its users from its config file
            argv += ["--aclfile", str(acl_file.resolve())]
        url = f"redis://admin:{admin}@127.0.0.1:{port}/0"
    handle = spawn(name, argv, url, workdir / f"{name}.log")
    return ready_or_stopped(handle, wait_redis_ready)


def _redis_binary() -> str:
    found = shutil.which("redis-server")
    if found is None:
        raise StackError(
            "redis-server is not on PATH: `apt-get install redis-server` or `brew install redis`"
        )
    return found
