"""Readiness: a protocol call to the broker or Redis, from the process we started."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from collections.abc import Callable, Coroutine, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Protocol, TypeVar

import redis
from aiokafka.admin import AIOKafkaAdminClient
from redis.backoff import NoBackoff
from redis.retry import Retry

from app.errors import StackError
from tools.stack.process import ServiceHandle, pid_alive

__all__ = [
    "ATTEMPT_TIMEOUT_S",
    "READY_TIMEOUT_S",
    "Wait",
    "poll",
    "ready_or_stopped",
    "run_sync",
    "wait_broker_ready",
    "wait_redis_ready",
]

T = TypeVar("T")

#: The JVM and the KRaft controller take ~2-4 s to answer on an idle 2-core machine.
READY_TIMEOUT_S = 60.0
_POLL_INTERVAL_S = 0.1
#: One probe may not hang longer than this, so a dead PID is noticed promptly.
ATTEMPT_TIMEOUT_S = 2.0
#: How much of a server's log a readiness error quotes.
_LOG_TAIL_LINES = 20

# Readiness is a protocol call, never an open port: the port opens before a
# server can answer, and an open port can belong to a broker that is still
# shutting down, or to someone else's server. The PID must also stay alive, so
# the answer is known to come from the process we started.


class Wait(Protocol):
    """A readiness probe: ``wait_broker_ready`` or ``wait_redis_ready``, options bound."""

    def __call__(
        self,
        url: str,
        /,
        timeout: float = ...,
        pid: int | None = ...,
        *,
        log_path: Path | None = ...,
    ) -> None: ...


def ready_or_stopped(handle: ServiceHandle, wait: Wait) -> ServiceHandle:
    """Return ``handle`` once it is ready; if it never is, stop it so nothing is left behind."""
    try:
        wait(handle.url, pid=handle.pid, log_path=handle.log_path)
    except BaseException:  # KeyboardInterrupt too: never orphan a server
        handle.stop()
        raise
    return handle


def wait_broker_ready(
    bootstrap: str,
    timeout: float = READY_TIMEOUT_S,
    pid: int | None = None,
    *,
    log_path: Path | None = None,
    client: Mapping[str, Any] | None = None,
) -> None:
    """Block until the broker at ``bootstrap`` answers a Metadata (list topics) request.

    ``client``: aiokafka connection options (TLS, SASL) for a secure broker.
    """
    poll(
        "broker",
        bootstrap,
        lambda limit: run_sync(_list_topics(bootstrap, limit, client or {})),
        timeout,
        pid,
        log_path,
    )


def wait_redis_ready(
    url: str,
    timeout: float = READY_TIMEOUT_S,
    pid: int | None = None,
    *,
    log_path: Path | None = None,
) -> None:
    """Block until Redis at ``url`` answers PING with PONG."""
    poll("redis", url, lambda limit: _ping(url, limit), timeout, pid, log_path)


def poll(
    name: str,
    url: str,
    probe: Callable[[float], object],
    timeout: float,
    pid: int | None,
    log_path: Path | None,
) -> None:
    deadline = time.monotonic() + timeout
    last_error: Exception | None = None
    while True:
        _check_alive(name, url, pid, log_path)
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            why = f"{type(last_error).__name__}: {last_error}" if last_error else "no attempt"
            raise StackError(
                _with_log(
                    f"{name} not ready at {url} after {timeout:g} s (last error: {why})", log_path
                )
            )
        try:
            probe(min(remaining, ATTEMPT_TIMEOUT_S))
        except Exception as exc:  # any failure means "not yet"; the deadline bounds it
            last_error = exc
            time.sleep(min(_POLL_INTERVAL_S, max(0.0, deadline - time.monotonic())))
        else:
            _check_alive(name, url, pid, log_path)
            return


def _check_alive(name: str, url: str, pid: int | None, log_path: Path | None) -> None:
    if pid is not None and not pid_alive(pid):
        raise StackError(
            _with_log(f"{name} (pid {pid}) exited before it was ready at {url}", log_path)
        )


def _with_log(message: str, log_path: Path | None) -> str:
    if log_path is None or not log_path.exists():
        return message
    lines = log_path.read_text(errors="replace").splitlines()[-_LOG_TAIL_LINES:]
    return f"{message}\n--- last {len(lines)} lines of {log_path} ---\n" + "\n".join(lines)


async def _list_topics(bootstrap: str, timeout: float, client: Mapping[str, Any]) -> None:
    admin = AIOKafkaAdminClient(
        bootstrap_servers=bootstrap,
        client_id="fraud-stack-probe",
        request_timeout_ms=max(100, int(timeout * 1000)),
        **client,
    )
    try:
        with _quiet("aiokafka"):
            async with asyncio.timeout(timeout):
                await admin.start()
                await admin.list_topics()
    finally:
        await admin.close()


def _ping(url: str, timeout: float) -> None:
    # No client-side retries: poll retries, under one deadline. A plain client,
    # not app.redis_client's: this probes one redis-server process just spawned
    # (a cluster node before its cluster exists), not the configured store.
    client = redis.Redis.from_url(
        url, socket_connect_timeout=timeout, socket_timeout=timeout, retry=Retry(NoBackoff(), 0)
    )
    try:
        if client.ping() is not True:
            raise StackError(f"PING to {url} did not return PONG")
    finally:
        client.close()


@contextmanager
def _quiet(logger_name: str) -> Iterator[None]:
    """Mute ``logger_name`` below CRITICAL: a refused probe logs an ERROR that means "not yet"."""
    target = logging.getLogger(logger_name)
    previous = target.level
    target.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        target.setLevel(previous)


def run_sync(coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro`` from sync code, also when called inside a running loop (async tests)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, coro).result()

