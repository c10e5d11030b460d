"""The stack as one unit: ``up`` (idempotent: reuses live servers of ours),
``down`` (exactly the PIDs its files name) and ``status``."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from app.errors import StackError
from app.topics import kafka_auth
from tools import kafka_secure
from tools.stack.broker import start_broker
from tools.stack.ports import DEFAULT_BROKER_PORT, DEFAULT_REDIS_PORT
from tools.stack.process import ServiceHandle, runs
from tools.stack.readiness import ATTEMPT_TIMEOUT_S, Wait, wait_broker_ready, wait_redis_ready
from tools.stack.redis_server import start_redis
from tools.stack.secure import PER_ROLE, redis_password_path
from tools.stack.state import DEFAULT_STATE_DIR, pid_path, read_env, read_pid, write_env

__all__ = ["running", "stack_down", "stack_status", "stack_up"]

logger = logging.getLogger(__name__)

#: A PID file's process gets this long to prove it is ready before ``up`` replaces it.
_REUSE_TIMEOUT_S = 3.0


@dataclass(frozen=True)
class _Service:
    name: str  # names the PID and log files
    env_var: str  # set -> the service is external: wait for it, never start or stop it
    program: str  # what a live PID from our PID file must be running
    url: Callable[[int], str]
    start: Callable[[int | None, Path, bool], ServiceHandle]
    wait: Wait


_SERVICES = (
    _Service(
        "broker",
        "KAFKA_BOOTSTRAP",
        "kafka.Kafka",
        lambda port: f"127.0.0.1:{port}",
        # The controller listens next to the broker: a restart on the same log
        # dir finds the quorum where its configuration says.
        lambda port, state_dir, secure: start_broker(
            port, state_dir, controller_port=port + 1 if port else None, secure=secure
        ),
        wait_broker_ready,
    ),
    _Service(
        "redis",
        "REDIS_URL",
        "redis-server",
        lambda port: f"redis://127.0.0.1:{port}/0",
        lambda port, state_dir, secure: start_redis(port, state_dir, secure=secure),
        wait_redis_ready,
    ),
)


def stack_up(
    state_dir: Path = DEFAULT_STATE_DIR,
    *,
    broker_port: int = DEFAULT_BROKER_PORT,
    redis_port: int = DEFAULT_REDIS_PORT,
    secure: bool = False,
) -> dict[str, str]:
    """Start the broker and Redis unless already up; return their ``KAFKA_BOOTSTRAP``/``REDIS_URL``.

    Idempotent: services whose PID files name live, ready processes are reused.
    On failure, whatever this call started is stopped again. ``secure``: the
    broker with SASL/SCRAM over TLS and ACLs (:func:`start_broker`) and Redis
    with ACL users (:func:`start_redis`); the env then also says how to reach
    the broker (TLS, CA file, mechanism) but names no user and holds no
    password: ``REDIS_URL`` carries no credentials, and each process sets its
    role's own (:func:`role_env`).
    """
    state_dir.mkdir(parents=True, exist_ok=True)
    ports = {"broker": broker_port, "redis": redis_port}
    started: list[ServiceHandle] = []
    try:
        env = {svc.env_var: _up(svc, state_dir, ports[svc.name], started, secure) for svc in _SERVICES}
    except BaseException:
        for handle in started:
            handle.stop()
            pid_path(state_dir, handle.name).unlink(missing_ok=True)
        raise
    if secure:
        client = kafka_secure.client_env(state_dir.resolve(), "", env["KAFKA_BOOTSTRAP"])
        env.update({k: v for k, v in client.items() if k not in PER_ROLE and k != "FRAUD_KAFKA_BOOTSTRAP"})
    write_env(state_dir / "env", env)
    return env


def _wait_options(svc: _Service, state_dir: Path, secure: bool) -> dict[str, Any]:
    """The readiness probe's connection options: the super user's on the secure broker."""
    if svc.name != "broker" or not secure:
        return {}
    admin = kafka_secure.client_settings(state_dir.resolve(), kafka_secure.ADMIN, "")
    return {"client": kafka_auth(admin)}


def _probe_url(svc: _Service, state_dir: Path, url: str, secure: bool) -> str:
    """The URL a readiness probe uses: on the secure Redis, as its ``admin`` user
    (the anonymous ``default`` user is off); the URL handed out never carries it."""
    if svc.name != "redis" or not secure or "@" in url:
        return url
    password = redis_password_path(state_dir, "admin")
    if not password.is_file():
        return url  # no ACL users here: the probe fails and says so
    return url.replace("redis://", f"redis://admin:{password.read_text().strip()}@", 1)


def _up(svc: _Service, state_dir: Path, port: int, started: list[ServiceHandle], secure: bool = False) -> str:
    external = os.environ.get(svc.env_var)
    if external:
        svc.wait(external, **_wait_options(svc, state_dir, secure))
        return external
    url = svc.url(port)
    if _reuse(svc, state_dir, url, secure):
        return url
    handle = svc.start(port, state_dir, secure)
    started.append(handle)
    pid_path(state_dir, svc.name).write_text(f"{handle.pid}\n")
    # The secure Redis's handle carries the admin's credentials: the env gets the plain URL.
    return url if svc.name == "redis" else handle.url


def _reuse(svc: _Service, state_dir: Path, url: str, secure: bool = False) -> bool:
    """Whether the process in ``svc``'s PID file is ours, alive and ready at ``url``."""
    pid_file = pid_path(state_dir, svc.name)
    pid = read_pid(pid_file)
    if pid is None:
        return False
    if not runs(pid, svc.program):
        pid_file.unlink()  # stale: gone, or the PID now belongs to something else
        return False
    log_path = state_dir / f"{svc.name}.log"
    try:
        svc.wait(
            _probe_url(svc, state_dir, url, secure), timeout=_REUSE_TIMEOUT_S, pid=pid, log_path=log_path,
            **_wait_options(svc, state_dir, secure),
        )  # fmt: skip
    except StackError:
        logger.warning("%s (pid %d) is not ready at %s; replacing it", svc.name, pid, url)
        ServiceHandle(svc.name, pid, url, log_path).stop()
        pid_file.unlink(missing_ok=True)
        return False
    logger.info("%s already up (pid %d) at %s", svc.name, pid, url)
    return True


def running(state_dir: Path) -> list[str]:
    """``name (pid N)`` of each service whose PID file in ``state_dir`` names a live process of ours."""
    out = []
    for svc in _SERVICES:
        pid = read_pid(pid_path(state_dir, svc.name))
        if pid is not None and runs(pid, svc.program):
            out.append(f"{svc.name} (pid {pid})")
    return out


def stack_down(state_dir: Path = DEFAULT_STATE_DIR) -> None:
    """Stop the processes the PID files in ``state_dir`` name (if still ours); remove the files."""
    for svc in _SERVICES:
        pid_file = pid_path(state_dir, svc.name)
        pid = read_pid(pid_file)
        if pid is None:
            continue
        if runs(pid, svc.program):
            ServiceHandle(svc.name, pid, "", state_dir / f"{svc.name}.log").stop()
            logger.info("stopped %s (pid %d)", svc.name, pid)
        else:
            logger.info(
                "%s: pid %d is not a running %s; removing the stale PID file",
                svc.name,
                pid,
                svc.program,
            )
        pid_file.unlink(missing_ok=True)
    (state_dir / "env").unlink(missing_ok=True)


def stack_status(
    state_dir: Path = DEFAULT_STATE_DIR,
) -> list[tuple[str, int | None, str | None, bool]]:
    """``(name, pid, url, ready)`` per service; pid is None for external or stopped services."""
    env = read_env(state_dir / "env")
    rows: list[tuple[str, int | None, str | None, bool]] = []
    for svc in _SERVICES:
        pid = read_pid(pid_path(state_dir, svc.name))
        pid = pid if pid is not None and runs(pid, svc.program) else None
        url = env.get(svc.env_var)
        secure = "FRAUD_KAFKA_SASL_MECHANISM" in env
        options = _wait_options(svc, state_dir, secure)
        probe = None if url is None else _probe_url(svc, state_dir, url, secure)
        rows.append((svc.name, pid, url, probe is not None and _is_ready(svc, probe, pid, options)))
    return rows


def _is_ready(svc: _Service, url: str, pid: int | None, options: Mapping[str, Any] | None = None) -> bool:
    try:
        svc.wait(url, timeout=ATTEMPT_TIMEOUT_S, pid=pid, **(options or {}))
    except StackError:
        return False
    return True

