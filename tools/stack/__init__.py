"""The local stack: an Apache Kafka broker (KRaft, one node) and Redis on loopback.

Used as a library by the pytest fixtures (``tests/conftest.py``) and by hand::

    eval "$(python -m tools.stack up)"   # starts both, prints ``export KAFKA_BOOTSTRAP=...`` lines
    python -m tools.stack status          # each service: pid, url, ready or not
    python -m tools.stack down            # stops exactly the PIDs that ``up`` wrote

``up`` keeps its state in ``.stack/``: ``broker.pid`` and ``redis.pid`` (the only
processes ``down`` ever signals), ``broker.log``, ``redis.log`` and ``env``. When
``KAFKA_BOOTSTRAP`` or ``REDIS_URL`` is set (CI service containers, docker compose)
that service is taken as given and only waited for.

The broker is Apache Kafka's own ``kafka.Kafka`` from the jars ``make setup``
fetches from Maven Central into ``.kafka/lib`` (``deploy/kafka/pom.xml`` pins the
version), run by the machine's Java 17+ as one process acting as broker and
KRaft controller. Its log directory lives in the state dir (``kafka-logs``),
formatted on first start; topic data survives a restart of the broker, and
retention by time and size keeps the disk flat on long runs (``BROKER_CONFIG``).

``up --brokers 3`` runs the replicated stack instead: three Kafka brokers, three
dedicated KRaft controllers and a Redis primary with two replicas and three Sentinels (``tools/cluster.py``, its
own state dir); ``status --brokers 3`` / ``down --brokers 3`` act on it.

``up --secure`` runs the broker with TLS, SASL/SCRAM-SHA-512 users per role and
ACLs (``tools/kafka_secure.py``, ``tools/kafka_acls.py``, SECURITY.md) and Redis
with ACL users per role, in its own state dir (``.stack/secure``: a plaintext
broker's formatted log dir cannot become secure). Its ``env`` holds no password:
each process names its own user and password file (:func:`role_env`).
``down --secure`` / ``status --secure`` act on that state dir. Without
``--secure`` the stack stays plaintext on loopback in ``.stack``.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import concurrent.futures
import hashlib
import logging
import os
import random
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Coroutine, Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Protocol, TypeVar

import redis
from aiokafka.admin import AIOKafkaAdminClient
from redis.backoff import NoBackoff
from redis.retry import Retry

from app.errors import StackError
from app.settings import Settings
from app.topics import ensure_topics, kafka_auth
from tools import kafka_acls, kafka_secure

__all__ = [
    "DEFAULT_BROKER_PORT",
    "DEFAULT_REDIS_PORT",
    "DEFAULT_SECURE_STATE_DIR",
    "DEFAULT_STATE_DIR",
    "ServiceHandle",
    "StackError",
    "free_port",
    "free_ports",
    "main",
    "pid_alive",
    "provision_secure",
    "redis_password_path",
    "role_env",
    "stack_down",
    "stack_status",
    "stack_up",
    "start_broker",
    "start_redis",
    "wait_broker_ready",
    "wait_redis_ready",
]

logger = logging.getLogger(__name__)

T = TypeVar("T")

DEFAULT_STATE_DIR = Path(".stack")
#: The secure stack's: its broker's log dir holds SCRAM users, a plaintext one's none,
#: so neither can start on the other's (``make demo`` and ``make demo SECURE=0`` alternate).
DEFAULT_SECURE_STATE_DIR = DEFAULT_STATE_DIR / "secure"
#: Fixed ports for ``up`` (tests use free ports), off the standard 9092/6379 so a
#: system Kafka or Redis on this machine is never mistaken for ours.
DEFAULT_BROKER_PORT = 19092
DEFAULT_REDIS_PORT = 16379

#: Kafka's controlled shutdown on SIGTERM takes 1-5 s with clients connected.
STOP_TIMEOUT_S = 30.0
#: The JVM and the KRaft controller take ~2-4 s to answer on an idle 2-core machine.
READY_TIMEOUT_S = 60.0
_POLL_INTERVAL_S = 0.1
#: One probe may not hang longer than this, so a dead PID is noticed promptly.
_ATTEMPT_TIMEOUT_S = 2.0
#: A PID file's process gets this long to prove it is ready before ``up`` replaces it.
_REUSE_TIMEOUT_S = 3.0
_LOG_TAIL_LINES = 20

#: Where ``make setup`` puts the broker's class path (``deploy/kafka/pom.xml``).
KAFKA_LIB_DIR = Path(__file__).resolve().parents[2] / ".kafka" / "lib"
#: Heap for a 2-core machine shared with the workers, Redis and the load generator.
BROKER_HEAP = ("-Xms256m", "-Xmx768m")

#: The single-node broker's settings beyond listeners and paths. Each one that
#: differs from Kafka's default says why.
BROKER_CONFIG: dict[str, str] = {
    "process.roles": "broker,controller",
    "node.id": "1",
    "controller.listener.names": "CONTROLLER",
    "listener.security.protocol.map": "PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT",
    "inter.broker.listener.name": "PLAINTEXT",
    # One broker: the internal topics cannot have 3 replicas (the defaults make
    # InitProducerId and the first consumer group fail).
    "offsets.topic.replication.factor": "1",
    "offsets.topic.num.partitions": "8",
    "transaction.state.log.replication.factor": "1",
    "transaction.state.log.min.isr": "1",
    "transaction.state.log.num.partitions": "8",
    # The default waits 3 s before the first assignment of every new group.
    "group.initial.rebalance.delay.ms": "0",
    # Topics are created explicitly with their partition counts (app/topics.py).
    "auto.create.topics.enable": "false",
    "num.partitions": "1",
    # A flat disk on long runs: 1 h or 128 MiB per partition, 32 MiB segments.
    "log.retention.ms": "3600000",
    "log.retention.bytes": str(128 * 1024 * 1024),
    "log.segment.bytes": str(32 * 1024 * 1024),
    "log.retention.check.interval.ms": "60000",
    # Recovery after a kill -9 of the broker: no fsync per message (the OS page
    # cache is the durability here, as on any single-node dev broker).
    "num.recovery.threads.per.data.dir": "1",
    "num.network.threads": "2",
    "num.io.threads": "4",
    # KIP-890's produce-time check answers aiokafka's transactional produce with
    # retriable NOT_ENOUGH_REPLICAS (and a warning each) while the previous
    # transaction's markers are written; no latency gain was measured either
    # way (docs/local-broker.md).
    "transaction.partition.verification.enable": "false",
    # A worker killed inside a transaction holds back every read_committed
    # consumer of the partitions it wrote until the broker aborts it (after the
    # producer's 10 s transaction timeout, app/eos.py). The broker looks
    # for such transactions every 10 s by default, so the stall was 10-20 s; a
    # restarted worker fences its own at once (its transactional id is stable).
    "transaction.abort.timed.out.transaction.cleanup.interval.ms": "1000",
    # A broker restarted after a kill -9 cannot register until the controller
    # has expired its dead incarnation's session (DUPLICATE_BROKER_REGISTRATION,
    # retried with a doubling backoff): with the default 9 s session that was
    # 13 of the 18 s between the restart and the first answer. On a cluster the
    # same timeout is how soon a dead broker is fenced and loses its
    # leaderships: on the 3-node stack a kill -9 of the leader of most
    # partitions stopped decisions for 5.6 s with 3 s (two runs; the
    # acceptance is 5 s), so 2 s: four missed heartbeats (the cluster shortens
    # it further: tools/cluster.py). Defaults 9 s / 2 s heartbeats.
    "broker.session.timeout.ms": "2000",
    "broker.heartbeat.interval.ms": "500",
}

_BROKER_LOG4J = """\
log4j.rootLogger=WARN, stdout
log4j.appender.stdout=org.apache.log4j.ConsoleAppender
log4j.appender.stdout.layout=org.apache.log4j.PatternLayout
log4j.appender.stdout.layout.ConversionPattern=[%d] %p %m (%c)%n
log4j.logger.kafka.server.KafkaRaftServer=INFO
log4j.logger.org.apache.kafka.controller=WARN
log4j.logger.kafka.coordinator.transaction=WARN
"""


# --- processes ---------------------------------------------------------------


#: Servers this process started, by PID. Polling their Popen reaps them when they
#: exit (a zombie still passes ``kill(pid, 0)``), and holding them keeps Popen from
#: warning that a running child was dropped (``up`` leaves its servers running).
_children: dict[int, subprocess.Popen[bytes]] = {}


@dataclass
class ServiceHandle:
    """A service process started by this module (or named by one of its PID files)."""

    name: str
    pid: int
    url: str
    log_path: Path

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> None:
        """SIGTERM, wait up to ``timeout`` seconds, then SIGKILL. A no-op if it is gone."""
        if not pid_alive(self.pid):
            return
        _signal(self.pid, signal.SIGTERM)
        if _wait_exit(self.pid, timeout):
            return
        logger.warning(
            "%s (pid %d) ignored SIGTERM for %.0f s; killing it", self.name, self.pid, timeout
        )
        _signal(self.pid, signal.SIGKILL)
        if not _wait_exit(self.pid, 5.0):
            raise StackError(f"{self.name} (pid {self.pid}) is still running after SIGKILL")


def pid_alive(pid: int) -> bool:
    """Whether ``pid`` runs. A child of this process that exited is reaped and counts as gone."""
    child = _children.get(pid)
    if child is not None:
        return child.poll() is None
    try:
        reaped, _ = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        reaped = 0  # not our child: its own parent reaps it
    if reaped:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # it exists, owned by another user
    return not _zombie(pid)


def _zombie(pid: int) -> bool:
    """An exited process that its parent (another process) has not reaped yet: gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False  # no /proc (macOS), or it was just reaped
    return stat.rpartition(")")[2].split()[:1] == ["Z"]


def _wait_exit(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while pid_alive(pid):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
    return True


def _signal(pid: int, sig: signal.Signals) -> None:
    with suppress(ProcessLookupError):  # it exited in the meantime
        os.kill(pid, sig)


def _runs(pid: int, program: str) -> bool:
    """Whether ``pid`` is alive and runs ``program``.

    A PID file can outlive its process and the PID be reused by something else:
    we signal a PID from a file only if its command line still names our program.
    """
    if not pid_alive(pid):
        return False
    proc = Path(f"/proc/{pid}/cmdline")
    if Path("/proc/self").exists():
        try:
            cmdline = proc.read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            return False
    else:  # macOS: no /proc
        result = subprocess.run(
            ["ps", "-o", "command=", "-p", str(pid)], capture_output=True, text=True, check=False
        )
        cmdline = result.stdout
    return program in cmdline


def _spawn(
    name: str, argv: Sequence[str], url: str, log_path: Path, env: dict[str, str] | None = None
) -> ServiceHandle:
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("wb") as log:
        # start_new_session: Ctrl-C in a terminal goes to the foreground process
        # group, so it interrupts the test run or the CLI, not the servers they
        # started mid-test; those are stopped by PID.
        process = subprocess.Popen(
            list(argv),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            cwd=log_path.parent,
            env=env,
        )
    _children[process.pid] = process
    logger.debug("started %s (pid %d): %s", name, process.pid, shlex.join(argv))
    return ServiceHandle(name, process.pid, url, log_path)


class _Wait(Protocol):
    def __call__(
        self,
        url: str,
        /,
        timeout: float = ...,
        pid: int | None = ...,
        *,
        log_path: Path | None = ...,
    ) -> None: ...


def _ready_or_stopped(handle: ServiceHandle, wait: _Wait) -> ServiceHandle:
    """Return ``handle`` once it is ready; if it never is, stop it so nothing is left behind."""
    try:
        wait(handle.url, pid=handle.pid, log_path=handle.log_path)
    except BaseException:  # KeyboardInterrupt too: never orphan a server
        handle.stop()
        raise
    return handle


# --- ports -------------------------------------------------------------------


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now, its next port free too."""
    return free_ports(1)[0]


#: Where the kernel's ephemeral range starts when /proc does not say (Linux's default).
_EPHEMERAL_LOW = 32768
#: How far below the ephemeral range ports are drawn from.
_PORT_SPAN = 12000


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return _EPHEMERAL_LOW


def _probe(port: int) -> socket.socket | None:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind(("127.0.0.1", port))
    except OSError:
        sock.close()
        return None
    return sock


def free_ports(n: int) -> list[int]:
    """``n`` different ports that nothing listens on now, each with its next port
    free too: a broker's KRaft controller listens on the port after the broker's
    (``stack_up``), so any of them can be a broker's.

    Every probe is held until all are chosen. NOTE: ``free_port()`` called twice
    can return one port twice (the first is free again once its probe closes);
    ask for all the ports a test needs in one call. Seen once: a test's gateway
    failed to bind its gRPC port while its other gateway answered there.

    The ports are drawn at random from below the kernel's ephemeral range, not
    by binding port 0: an ephemeral port is also what every outgoing connection
    takes, so between the probe and the server's bind, one of the many client
    connections a parallel test run opens could take it. Seen once, on the port
    after a broker's, which was not probed then: its controller failed to bind.
    """
    high = _ephemeral_low() - 2  # a port and its next one, both below the range
    low = max(1024, high - _PORT_SPAN)
    rng = random.Random()  # seeded from the OS: parallel test workers draw differently
    held: list[socket.socket] = []
    chosen: list[int] = []
    try:
        for _ in range(100 * n + 100):
            if len(chosen) == n:
                break
            if high - low >= 1000:
                port = rng.randint(low, high)
            else:  # a machine whose ephemeral range starts low: let the kernel pick
                with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                    sock.bind(("127.0.0.1", 0))
                    port = int(sock.getsockname()[1])
            pair = [_probe(port), _probe(port + 1)]
            held.extend(sock for sock in pair if sock is not None)
            if None not in pair:
                chosen.append(port)
        if len(chosen) < n:
            raise StackError(f"found {len(chosen)} of {n} free ports on 127.0.0.1 between {low} and {high + 1}")
        return chosen
    finally:
        for sock in held:
            sock.close()


def _ensure_port_free(port: int, name: str) -> None:
    """Fail early if ``port`` is taken: a probe would otherwise pass against the wrong server."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        # NOTE: SO_REUSEADDR as the servers set it: leftovers in TIME_WAIT from the
        # last run do not count as taken, only a listener does.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError as exc:
            raise StackError(
                f"cannot start {name}: 127.0.0.1:{port} is in use ({exc.strerror}); "
                "`python -m tools.stack status` (`status --secure`: the secure stack) shows whether it is ours"
            ) from exc


# --- readiness ---------------------------------------------------------------
# Readiness is a protocol call, never an open port: the port opens before a
# server can answer, and an open port can belong to a broker that is still
# shutting down, or to someone else's server. The PID must also stay alive, so
# the answer is known to come from the process we started.


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
    _poll(
        "broker",
        bootstrap,
        lambda limit: _run_sync(_list_topics(bootstrap, limit, client or {})),
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
    _poll("redis", url, lambda limit: _ping(url, limit), timeout, pid, log_path)


def _poll(
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
            probe(min(remaining, _ATTEMPT_TIMEOUT_S))
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
    # No client-side retries: _poll retries, under one deadline. A plain client,
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


def _run_sync(coro: Coroutine[Any, Any, T]) -> T:
    """Run ``coro`` from sync code, also when called inside a running loop (async tests)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(asyncio.run, coro).result()


# --- starting ----------------------------------------------------------------


def start_broker(
    port: int | None = None,
    workdir: Path = DEFAULT_STATE_DIR,
    controller_port: int | None = None,
    *,
    secure: bool = False,
) -> ServiceHandle:
    """Start Apache Kafka on 127.0.0.1:``port`` (a free one if None); return once it serves metadata.

    One JVM, broker and KRaft controller (on ``controller_port``, the port after
    the broker's if None, as ``stack_up`` places it). ``workdir/kafka-logs`` is
    formatted on first use and kept: a restart finds its topics, offsets and
    transactions again. Logs to ``workdir/broker.log``.
    The handle's ``url`` is the bootstrap ``127.0.0.1:PORT``.

    ``secure``: SASL/SCRAM-SHA-512 over TLS, ACLs per role, and the project's
    topics created by the super user (``tools/kafka_secure.py`` says where the
    CA, certificate and passwords are; ``kafka_secure.client_env`` gives a
    role's settings). Off by default: most tests run on loopback, where
    plaintext is faster to start and to read; ``make demo`` runs it
    (``stack up --secure``).
    """
    port = port or free_port()
    controller_port = controller_port or port + 1  # as stack_up places it; free_port() keeps it free
    _ensure_port_free(port, "broker")
    _ensure_port_free(controller_port, "broker controller")
    workdir = workdir.resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    classpath, java = _kafka_classpath(), _java_binary()
    config = workdir / "server.properties"
    props = _broker_properties(port, controller_port, workdir / "kafka-logs")
    format_args: list[str] = []
    formatted = (workdir / "kafka-logs" / "meta.properties").exists()
    if secure and formatted and not kafka_secure.password_file(workdir, kafka_secure.ADMIN).exists():
        raise StackError(f"{workdir} holds a plaintext broker's log dir (no SCRAM users): use another state dir")
    if secure and formatted:
        # SCRAM users are created when the log dir is formatted: a role added since has none.
        missing = [u for u in kafka_secure.USERS if not kafka_secure.password_file(workdir, u).exists()]
        if missing:
            raise StackError(
                f"{workdir} was formatted before the SCRAM user(s) {', '.join(missing)} existed: "
                f"remove it (rm -rf {workdir}) and start again"
            )
    if secure:
        kafka_secure.ensure_material(workdir)
        props.update(kafka_secure.secure_properties(workdir, port, controller_port))
        format_args = kafka_secure.format_scram_args(workdir)
    _write_private(config, "".join(f"{key}={value}\n" for key, value in props.items()))
    log4j = workdir / "broker-log4j.properties"
    log4j.write_text(_BROKER_LOG4J)
    jvm = [java, *BROKER_HEAP, "-XX:+UseG1GC", "-Djava.awt.headless=true",
           f"-Dlog4j.configuration=file:{log4j}", "-cp", classpath]  # fmt: skip
    if not formatted:
        _format_log_dir(jvm, config, workdir / "broker.log", format_args)
    handle = _spawn("broker", [*jvm, "kafka.Kafka", str(config)], f"127.0.0.1:{port}", workdir / "broker.log")
    if not secure:
        return _ready_or_stopped(handle, wait_broker_ready)
    admin = kafka_secure.client_settings(workdir, kafka_secure.ADMIN, handle.url)
    wait: _Wait = partial(wait_broker_ready, client=kafka_auth(admin))
    _ready_or_stopped(handle, wait)
    try:
        _run_sync(provision_secure(admin))
    except BaseException:
        handle.stop()
        raise
    return handle


async def provision_secure(admin_settings: Settings) -> None:
    """As the super user (``admin_settings`` carries its connection): the topics
    ``admin_settings`` names, then every role's ACLs for those names and its app id."""
    await ensure_topics(admin_settings, wait_s=30.0)
    admin = AIOKafkaAdminClient(bootstrap_servers=admin_settings.kafka_bootstrap, **kafka_auth(admin_settings))
    await admin.start()
    try:
        await kafka_acls.create_acls(admin, kafka_acls.acls(admin_settings))
    finally:
        await admin.close()


def _write_private(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` readable by the owner only (it may hold passwords)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    path.chmod(0o600)


def _broker_properties(port: int, controller_port: int, log_dir: Path) -> dict[str, str]:
    props = {
        **BROKER_CONFIG,
        "controller.quorum.voters": f"1@127.0.0.1:{controller_port}",
        "listeners": f"PLAINTEXT://127.0.0.1:{port},CONTROLLER://127.0.0.1:{controller_port}",
        "advertised.listeners": f"PLAINTEXT://127.0.0.1:{port}",
        "log.dirs": str(log_dir),
    }
    return props


def new_cluster_id() -> str:
    """A KRaft cluster id: a random UUID in URL-safe base64 (22 characters).

    NOTE: never one starting with "-": the storage tool's argument parser would
    read it as an option and fail the format (1 time in 64). Kafka's own
    ``Uuid.randomUuid`` skips those for the same reason.
    """
    while True:
        cluster_id = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
        if not cluster_id.startswith("-"):
            return cluster_id


def _format_log_dir(
    jvm: Sequence[str], config: Path, log_path: Path, extra: Sequence[str] = (), cluster_id: str | None = None
) -> None:
    """``kafka-storage format`` with a new cluster id (a base64 UUID, 22 characters);
    ``extra``: more options (the secure broker's ``--add-scram`` credentials, which
    are never written to the log).

    NOTE: the main class and its arguments go in a Java argument file (``@file``,
    0600, removed afterwards), not on the command line: ``/proc/<pid>/cmdline`` is
    readable by every local user, and ``--add-scram`` carries every user's password.
    The launcher expands ``@`` files only up to the main class, so the class is in
    the file too.
    """
    cluster_id = cluster_id or new_cluster_id()
    argfile = config.parent / "format.args"
    arguments = ["kafka.tools.StorageTool", "format", "-t", cluster_id, "-c", str(config), *extra]
    _write_private(argfile, "".join(_java_argfile_quote(a) + "\n" for a in arguments))
    try:
        result = subprocess.run(
            [*jvm, f"@{argfile}"], stdin=subprocess.DEVNULL, capture_output=True, text=True, check=False, timeout=120,
        )  # fmt: skip
    finally:
        argfile.unlink(missing_ok=True)
    with log_path.open("a") as log:
        log.write(result.stdout + result.stderr)
    if result.returncode != 0:
        raise StackError(f"formatting the broker's log dir failed:\n{result.stdout}{result.stderr}")


def _java_argfile_quote(argument: str) -> str:
    """One argument as a Java ``@file`` holds it: in double quotes, where a
    backslash escapes (paths with spaces, ``#`` or quotes stay one argument)."""
    return '"' + argument.replace("\\", "\\\\").replace('"', '\\"') + '"'


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
    _ensure_port_free(port, name)
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
        admin = admin or _write_acl(acl_file, workdir)
        if program is None:  # a Sentinel takes its users from its config file
            argv += ["--aclfile", str(acl_file.resolve())]
        url = f"redis://admin:{admin}@127.0.0.1:{port}/0"
    handle = _spawn(name, argv, url, workdir / f"{name}.log")
    return _ready_or_stopped(handle, wait_redis_ready)


def redis_password_path(workdir: Path, role: str) -> Path:
    """Where ``start_redis(secure=True)`` wrote the password of ``role``'s ACL user."""
    return workdir / "redis-users" / f"{role}.password"


def _write_acl(acl_file: Path, workdir: Path) -> str:
    """An ACL file of the role users and ``admin``, passwords stored as SHA-256; returns admin's password."""
    from app.redis_acl import ROLE_CODE, acl_rule

    lines = ["user default off"]
    admin = ""
    for role in (*ROLE_CODE, "admin"):
        password = secrets.token_hex(24)
        path = redis_password_path(workdir, role)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(password + "\n")
        # admin's channels: the Sentinels (as admin) talk through __sentinel__:hello.
        rules = "resetchannels &__sentinel__:* ~* +@all" if role == "admin" else acl_rule(role)
        digest = hashlib.sha256(password.encode()).hexdigest()
        lines.append(f"user {role} on #{digest} {rules}")
        if role == "admin":
            admin = password
    acl_file.write_text("\n".join(lines) + "\n")
    acl_file.chmod(0o600)
    return admin


def _kafka_classpath() -> str:
    """``$FRAUD_KAFKA_LIB`` (a folder of jars), else ``.kafka/lib`` from ``make setup``."""
    lib = Path(os.environ.get("FRAUD_KAFKA_LIB") or KAFKA_LIB_DIR)
    if not any(lib.glob("kafka_2.13-*.jar")):
        raise StackError(
            f"no Apache Kafka jars in {lib}: run `make setup` (Maven fetches them per deploy/kafka/pom.xml)"
        )
    return f"{lib}/*"


def _java_binary() -> str:
    home = os.environ.get("JAVA_HOME")
    found = str(Path(home) / "bin" / "java") if home else shutil.which("java")
    if not found or not os.access(found, os.X_OK):
        raise StackError("java is not on PATH: Kafka needs Java 17+ (Debian: apt-get install default-jre-headless)")
    return found


def _redis_binary() -> str:
    found = shutil.which("redis-server")
    if found is None:
        raise StackError(
            "redis-server is not on PATH: `apt-get install redis-server` or `brew install redis`"
        )
    return found


# --- the stack: up / down / status -------------------------------------------


@dataclass(frozen=True)
class _Service:
    name: str  # names the PID and log files
    env_var: str  # set -> the service is external: wait for it, never start or stop it
    program: str  # what a live PID from our PID file must be running
    url: Callable[[int], str]
    start: Callable[[int | None, Path, bool], ServiceHandle]
    wait: _Wait


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
            _pid_path(state_dir, handle.name).unlink(missing_ok=True)
        raise
    if secure:
        client = kafka_secure.client_env(state_dir.resolve(), "", env["KAFKA_BOOTSTRAP"])
        env.update({k: v for k, v in client.items() if k not in _PER_ROLE and k != "FRAUD_KAFKA_BOOTSTRAP"})
    _write_env(state_dir / "env", env)
    return env


#: Settings each role sets for itself on the secure stack.
_PER_ROLE = ("FRAUD_KAFKA_SASL_USERNAME", "FRAUD_KAFKA_SASL_PASSWORD_FILE")


def role_env(state_dir: Path, kafka_user: str | None = None, redis_user: str | None = None) -> dict[str, str]:
    """The settings by which one process of the secure stack in ``state_dir`` is
    ``kafka_user`` on the broker (a SCRAM user: ``kafka_acls.ROLES``' values) and
    ``redis_user`` on Redis (``app.redis_keys.ACL_KEY_PATTERNS``' keys): user
    names and password files, never a password."""
    state_dir = state_dir.resolve()
    env: dict[str, str] = {}
    if kafka_user is not None:
        if kafka_user not in kafka_secure.USERS:
            raise StackError(f"no Kafka user {kafka_user!r} on the secure broker (users: {', '.join(kafka_secure.USERS)})")
        env["FRAUD_KAFKA_SASL_USERNAME"] = kafka_user
        env["FRAUD_KAFKA_SASL_PASSWORD_FILE"] = str(kafka_secure.password_file(state_dir, kafka_user))
    if redis_user is not None:
        path = redis_password_path(state_dir, redis_user)
        if not path.is_file():
            raise StackError(f"no Redis user {redis_user!r} in {state_dir}: is the secure stack up there?")
        env["FRAUD_REDIS_USERNAME"] = redis_user
        env["FRAUD_REDIS_PASSWORD_FILE"] = str(path)
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
    _pid_path(state_dir, svc.name).write_text(f"{handle.pid}\n")
    # The secure Redis's handle carries the admin's credentials: the env gets the plain URL.
    return url if svc.name == "redis" else handle.url


def _reuse(svc: _Service, state_dir: Path, url: str, secure: bool = False) -> bool:
    """Whether the process in ``svc``'s PID file is ours, alive and ready at ``url``."""
    pid_path = _pid_path(state_dir, svc.name)
    pid = _read_pid(pid_path)
    if pid is None:
        return False
    if not _runs(pid, svc.program):
        pid_path.unlink()  # stale: gone, or the PID now belongs to something else
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
        pid_path.unlink(missing_ok=True)
        return False
    logger.info("%s already up (pid %d) at %s", svc.name, pid, url)
    return True


def _running(state_dir: Path) -> list[str]:
    """``name (pid N)`` of each service whose PID file in ``state_dir`` names a live process of ours."""
    out = []
    for svc in _SERVICES:
        pid = _read_pid(_pid_path(state_dir, svc.name))
        if pid is not None and _runs(pid, svc.program):
            out.append(f"{svc.name} (pid {pid})")
    return out


def stack_down(state_dir: Path = DEFAULT_STATE_DIR) -> None:
    """Stop the processes the PID files in ``state_dir`` name (if still ours); remove the files."""
    for svc in _SERVICES:
        pid_path = _pid_path(state_dir, svc.name)
        pid = _read_pid(pid_path)
        if pid is None:
            continue
        if _runs(pid, svc.program):
            ServiceHandle(svc.name, pid, "", state_dir / f"{svc.name}.log").stop()
            logger.info("stopped %s (pid %d)", svc.name, pid)
        else:
            logger.info(
                "%s: pid %d is not a running %s; removing the stale PID file",
                svc.name,
                pid,
                svc.program,
            )
        pid_path.unlink(missing_ok=True)
    (state_dir / "env").unlink(missing_ok=True)


def stack_status(
    state_dir: Path = DEFAULT_STATE_DIR,
) -> list[tuple[str, int | None, str | None, bool]]:
    """``(name, pid, url, ready)`` per service; pid is None for external or stopped services."""
    env = _read_env(state_dir / "env")
    rows: list[tuple[str, int | None, str | None, bool]] = []
    for svc in _SERVICES:
        pid = _read_pid(_pid_path(state_dir, svc.name))
        pid = pid if pid is not None and _runs(pid, svc.program) else None
        url = env.get(svc.env_var)
        secure = "FRAUD_KAFKA_SASL_MECHANISM" in env
        options = _wait_options(svc, state_dir, secure)
        probe = None if url is None else _probe_url(svc, state_dir, url, secure)
        rows.append((svc.name, pid, url, probe is not None and _is_ready(svc, probe, pid, options)))
    return rows


def _is_ready(svc: _Service, url: str, pid: int | None, options: Mapping[str, Any] | None = None) -> bool:
    try:
        svc.wait(url, timeout=_ATTEMPT_TIMEOUT_S, pid=pid, **(options or {}))
    except StackError:
        return False
    return True


def _pid_path(state_dir: Path, name: str) -> Path:
    return state_dir / f"{name}.pid"


def _read_pid(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (FileNotFoundError, ValueError):
        return None


def _write_env(path: Path, env: dict[str, str]) -> None:
    path.write_text("".join(f"export {key}={shlex.quote(value)}\n" for key, value in env.items()))


def _read_env(path: Path) -> dict[str, str]:
    if not path.exists():
        return {}
    pairs = (
        shlex.split(line)[-1].partition("=")
        for line in path.read_text().splitlines()
        if line.strip()
    )
    return {key: value for key, _, value in pairs}


# --- CLI ---------------------------------------------------------------------


def main(argv: Sequence[str] | None = None, cluster_cli: Callable[[argparse.Namespace], int] | None = None) -> int:
    """``python -m tools.stack up|down|status|env``; ``up`` and ``env`` print ``export`` lines for ``eval``.

    ``cluster_cli``: what runs ``--brokers 3`` (``tools.cluster.cli``; passed in by
    ``python -m tools.stack`` and the CLI, since tools.cluster builds on this module).
    """
    parser = argparse.ArgumentParser(
        prog="python -m tools.stack", description=__doc__.splitlines()[0]
    )
    parser.add_argument("command", choices=("up", "down", "status", "env"))
    parser.add_argument(
        "--secure", action="store_true",
        help="the secure stack (SASL/SCRAM over TLS, ACLs, Redis users per role), state in "
        f"{DEFAULT_SECURE_STATE_DIR} unless --state-dir",
    )  # fmt: skip
    parser.add_argument(
        "--brokers", type=int, default=1,
        help="1: one Kafka node and one Redis; 3 (or more): a KRaft cluster (3 replicas, min ISR 2) and a Redis "
        "primary with 2 replicas and 3 Sentinels (tools/cluster.py), state in .stack/cluster[-secure]",
    )  # fmt: skip
    parser.add_argument(
        "--state-dir", type=Path, help=f"PID, log and env files (default {DEFAULT_STATE_DIR})"
    )
    parser.add_argument("--broker-port", type=int, help=f"up: the broker's port (default {DEFAULT_BROKER_PORT}; "
                        "a cluster's first node: 29092, the next ones 2 ports apart)")  # fmt: skip
    parser.add_argument("--redis-port", type=int, help=f"up: Redis's port (default {DEFAULT_REDIS_PORT}; "
                        "a cluster's first Redis node: 29379)")  # fmt: skip
    parser.add_argument("--kafka-user", help="env: the process's SCRAM user on the secure broker")
    parser.add_argument("--redis-user", help="env: the process's ACL user on the secure Redis")
    args = parser.parse_args(argv)
    # Messages to stderr, so stdout of `up` stays fit for eval.
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    # The client library's own INFO lines ("Authenticated as admin ...") are noise here.
    logging.getLogger("aiokafka").setLevel(logging.WARNING)
    if args.brokers == 2 or args.brokers < 1:
        print("error: --brokers is 1 or at least 3 (3 replicas with min.insync.replicas=2)", file=sys.stderr)
        return 2
    try:
        if args.brokers >= 3:
            if cluster_cli is None:
                raise StackError("--brokers 3 runs through `python -m tools.stack` (tools/cluster.py)")
            return cluster_cli(args)
        state_dir: Path = args.state_dir or (DEFAULT_SECURE_STATE_DIR if args.secure else DEFAULT_STATE_DIR)
        if args.command == "up":
            return _cmd_up(
                state_dir, secure=args.secure, broker_port=args.broker_port or DEFAULT_BROKER_PORT,
                redis_port=args.redis_port or DEFAULT_REDIS_PORT,
                other=None if args.state_dir else (DEFAULT_STATE_DIR if args.secure else DEFAULT_SECURE_STATE_DIR),
            )  # fmt: skip
        if args.command == "env":
            env = role_env(state_dir, args.kafka_user, args.redis_user)
            print("".join(f"export {key}={shlex.quote(value)}\n" for key, value in env.items()), end="")
            return 0
        return _COMMANDS[args.command](state_dir)
    except StackError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


def _cmd_up(
    state_dir: Path,
    *,
    secure: bool = False,
    broker_port: int = DEFAULT_BROKER_PORT,
    redis_port: int = DEFAULT_REDIS_PORT,
    other: Path | None = None,
) -> int:
    """``other``: the default state dir of the other kind of stack, which uses the same ports."""
    if other is not None and (running := _running(other)):
        kind = "secure" if other == DEFAULT_SECURE_STATE_DIR else "plaintext"
        raise StackError(
            f"the {kind} stack ({other}: {', '.join(running)}) holds the ports: stop it first "
            f"(`python -m tools.stack down{' --secure' if kind == 'secure' else ''}`)"
        )
    env = stack_up(state_dir, secure=secure, broker_port=broker_port, redis_port=redis_port)
    print((state_dir / "env").read_text(), end="")
    logger.info(
        "stack up: %s (env in %s)", ", ".join(f"{k}={v}" for k, v in env.items()), state_dir / "env"
    )
    if secure:
        logger.info(
            "secure stack: each process takes its role's users, e.g. "
            "`eval \"$(python -m tools.stack env --state-dir %s --kafka-user scoring --redis-user worker)\"` "
            "(Kafka users: %s; Redis users: %s)",
            state_dir, ", ".join(f"{role}={user}" for role, user in kafka_acls.ROLES.items()),
            ", ".join(_redis_roles()),
        )  # fmt: skip
    return 0


def _redis_roles() -> list[str]:
    from app.redis_keys import ACL_KEY_PATTERNS

    return [*ACL_KEY_PATTERNS, "admin"]


def _cmd_down(state_dir: Path) -> int:
    stack_down(state_dir)
    return 0


def _cmd_status(state_dir: Path) -> int:
    rows = stack_status(state_dir)
    for name, pid, url, ready in rows:
        pid_text = "-" if pid is None else str(pid)
        state = "ready" if ready else "NOT ready"
        print(f"{name:<7} pid {pid_text:<8} {url or '(not configured)':<28} {state}")
    return 0 if all(ready for *_, ready in rows) else 1


_COMMANDS: dict[str, Callable[[Path], int]] = {
    "down": _cmd_down,
    "status": _cmd_status,
}

