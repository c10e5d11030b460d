"""The replicated local stack: three Kafka brokers, three dedicated KRaft
controllers, and a Redis that fails over.

``python -m tools.stack up --brokers 3`` (``make stack-up BROKERS=3``) starts it;
``status --brokers 3`` shows each process (which controller is active), every
partition's leader and in-sync replicas, and which Redis node is primary;
``down --brokers 3`` stops exactly the PIDs ``up`` wrote (the controllers'
included). State lives in ``.stack/cluster`` (``--secure``:
``.stack/cluster-secure``), apart from the single node's, so both can exist.

Kafka: six JVMs. Three brokers (``process.roles=broker``, node ids 1-3, named
``broker-<i>``) hold the partitions; three controllers
(``process.roles=controller``, node ids 101-103, named ``controller-<i>``,
a small heap) are the KRaft quorum's voters. Killing a broker never takes the
quorum's leader with it: the active controller, alive, fences the dead broker
``broker.session.timeout.ms`` after its last heartbeat and moves its
leaderships. Killing the active controller moves no leadership: the other two
elect a new one while the brokers keep serving. Every topic has 3 replicas and
``min.insync.replicas=2`` (project topics: ``app/topics.py``; internal ones:
the settings below); unclean leader election stays off; the project's
producers use ``acks=all``.

Redis: a primary, two replicas and three Sentinels (``tools/redis_ha.py``).

Ports: broker ``i`` (from 1) listens on ``broker_port + 2(i-1)``, controller
``i`` on the next port; Redis nodes on ``redis_port + i - 1``, Sentinels on
``redis_port + 100 + i - 1``. The defaults (29092, 29379) are off the single
stack's, so the two never collide; tests pass free ports.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import logging
import re
import shlex
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiokafka.admin import AIOKafkaAdminClient

from app.errors import StackError
from app.settings import Settings
from app.topics import ensure_topics, kafka_auth
from tools import kafka_secure, redis_ha
from tools.stack.broker import (
    base_properties,
    check_formatted_by,
    format_log_dir,
    java_binary,
    kafka_classpath,
    log_config_flag,
    new_cluster_id,
    write_log_config,
)
from tools.stack.ports import ensure_port_free, free_ports
from tools.stack.process import ServiceHandle, runs, spawn
from tools.stack.readiness import READY_TIMEOUT_S, poll, run_sync, wait_broker_ready
from tools.stack.secure import PER_ROLE, provision_secure, redis_password_path, role_env
from tools.stack.state import DEFAULT_STATE_DIR, pid_path, read_env, read_pid, write_env, write_private

__all__ = [
    "CLUSTER_CONFIG", "DEFAULT_BROKER_PORT", "DEFAULT_REDIS_PORT", "Cluster", "cluster_down", "cluster_status",
    "CONTROLLERS", "CONTROLLER_ID_BASE", "active_controller", "broker_properties", "cli", "cluster_up", "controller_id",
    "controller_properties", "default_state_dir", "describe_partitions", "start_node",
]  # fmt: skip

logger = logging.getLogger(__name__)

DEFAULT_BROKER_PORT = 29092
DEFAULT_REDIS_PORT = 29379
#: Six JVMs share two cores with Redis, the workers and the load: a broker gets
#: less than the single node's 768 MB (measured: ~250 MB heap in use at 120 TPS).
#: The whole heap is taken and touched at start (``-Xms`` = ``-Xmx``, as Kafka's
#: own start script sizes it, and ``AlwaysPreTouch``): a node's memory is then
#: what it is from its first second, not a staircase as G1 grows the heap under
#: load, which would read as a leak in an hour's soak.
NODE_HEAP = ("-Xms384m", "-Xmx384m", "-XX:+AlwaysPreTouch")
#: A controller holds the cluster's metadata only (a few topics, their
#: partitions, the brokers' registrations, the ACLs and SCRAM credentials).
CONTROLLER_HEAP = ("-Xms32m", "-Xmx128m")
#: Controller ``i``'s node id is ``CONTROLLER_ID_BASE + i``: brokers keep ids 1-3,
#: the ids the partitions' leaders and replicas are shown with.
CONTROLLER_ID_BASE = 100

#: Settings of the cluster's brokers and controllers beyond the single node's
#: (``tools.stack.broker.BROKER_CONFIG``). Both roles get all of them: a controller applies
#: the topic defaults (``default.replication.factor``, unclean election) and the
#: broker sessions, a broker the rest.
CLUSTER_CONFIG: dict[str, str] = {
    # Internal topics (group offsets, transaction state) replicated like the
    # project's: the coordinator of a transactional id or a group can be lost.
    "offsets.topic.replication.factor": "3",
    "transaction.state.log.replication.factor": "3",
    "transaction.state.log.min.isr": "2",
    "default.replication.factor": "3",
    "min.insync.replicas": "2",
    # Kafka's default, stated: a replica that was out of sync never becomes leader
    # (it would lose acknowledged decisions).
    "unclean.leader.election.enable": "false",
    # A broker fenced after 1.5 s without heartbeats (five missed), not the
    # single node's 2 s: the active controller then moves its leaderships and
    # drops it from the in-sync replicas, which acks=all writes wait for until
    # then. With 3 s, losing the leader of most partitions stopped decisions
    # for 5.6 s (the acceptance is 5 s). The controllers are never a broker, so
    # no controller election comes before this fencing, and the KRaft quorum's
    # own timeouts stay at Kafka's defaults (fetch 2 s, election 1 s, backoff up
    # to 1 s): losing the active controller stops no decision (RELIABILITY.md),
    # and shortened ones start elections nobody needed on a busy machine.
    "broker.session.timeout.ms": "1500",
    "broker.heartbeat.interval.ms": "300",
    # Fewer threads than the single node: six JVMs on two cores.
    "num.io.threads": "2",
    "num.replica.fetchers": "1",
}


#: The KRaft quorum's voters, whatever the number of brokers: one may be lost.
CONTROLLERS = 3


@dataclass(frozen=True)
class Cluster:
    """Where the cluster listens: each broker's port, each controller's, the Redis nodes', the Sentinels'."""

    brokers: tuple[int, ...]
    controllers: tuple[int, ...]
    redis_nodes: tuple[int, ...]
    sentinels: tuple[int, ...]

    @property
    def bootstrap(self) -> str:
        return ",".join(f"127.0.0.1:{port}" for port in self.brokers)

    @property
    def quorum_voters(self) -> str:
        """``controller.quorum.voters``: ``<node id>@host:port`` of each controller."""
        return ",".join(f"{controller_id(i)}@127.0.0.1:{port}" for i, port in enumerate(self.controllers, 1))

    @property
    def redis_url(self) -> str:
        return redis_ha.sentinel_url(list(self.sentinels))

    @classmethod
    def at(cls, brokers: int, broker_port: int, redis_port: int) -> Cluster:
        return cls(tuple(broker_port + 2 * i for i in range(brokers)),
                   tuple(broker_port + 2 * i + 1 for i in range(CONTROLLERS)),
                   tuple(redis_port + i for i in range(3)), tuple(redis_port + 100 + i for i in range(3)))  # fmt: skip

    @classmethod
    def free(cls, brokers: int = 3) -> Cluster:
        ports = free_ports(brokers + CONTROLLERS + 6)  # all different (free_ports)
        return cls(tuple(ports[:brokers]), tuple(ports[brokers : brokers + CONTROLLERS]), tuple(ports[-6:-3]),
                   tuple(ports[-3:]))  # fmt: skip


def controller_id(index: int) -> int:
    """Controller ``index``'s (from 1) KRaft node id."""
    return CONTROLLER_ID_BASE + index


def default_state_dir(secure: bool) -> Path:
    return DEFAULT_STATE_DIR / ("cluster-secure" if secure else "cluster")


# --- up ----------------------------------------------------------------------


def cluster_up(state_dir: Path, cluster: Cluster, *, secure: bool = False) -> dict[str, str]:
    """Start the controllers, the brokers and the replicated Redis; create the
    project's topics (3 replicas); write and return the env (``KAFKA_BOOTSTRAP``,
    ``REDIS_URL``, and on the secure stack how to reach it). On failure,
    everything started is stopped.

    Idempotent: when every PID file names a live process of ours, they are reused.
    """
    state_dir = state_dir.resolve()
    state_dir.mkdir(parents=True, exist_ok=True)
    live = _live(state_dir)
    if live and len(live) == len(_names(state_dir)) and (state_dir / "env").exists():
        logger.info("cluster already up in %s (%s)", state_dir, ", ".join(live))
        return read_env(state_dir / "env")
    if live:
        raise StackError(f"part of the cluster in {state_dir} runs ({', '.join(live)}): "
                         f"`python -m tools.stack down --brokers {len(cluster.brokers)}` first")  # fmt: skip
    started: list[ServiceHandle] = []
    try:
        with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
            # Redis needs no JVM: it starts while they do (~2.5 s less to wait).
            # If it fails, it stops what it started; Kafka is stopped below.
            redis_job = pool.submit(redis_ha.start_redis_ha, list(cluster.redis_nodes), list(cluster.sentinels),
                                    state_dir, secure=secure)  # fmt: skip
            kafka_error: BaseException | None = None
            try:
                _start_kafka(state_dir, cluster, secure, started)
            except BaseException as exc:  # Redis's handles are recorded first, so they are stopped too
                kafka_error = exc
            ha = redis_job.result()
        for handle in [*ha.nodes, *ha.sentinels]:
            started.append(handle)
            pid_path(state_dir, handle.name).write_text(f"{handle.pid}\n")
        if kafka_error is not None:
            raise kafka_error
        run_sync(_provision(state_dir, cluster, secure))
    except BaseException:
        for handle in reversed(started):
            handle.stop()
            pid_path(state_dir, handle.name).unlink(missing_ok=True)
        raise
    env = {"KAFKA_BOOTSTRAP": cluster.bootstrap, "REDIS_URL": cluster.redis_url}
    if secure:
        client = kafka_secure.client_env(state_dir, "", cluster.bootstrap)
        env.update({k: v for k, v in client.items() if k not in PER_ROLE and k != "FRAUD_KAFKA_BOOTSTRAP"})
    write_env(state_dir / "env", env)
    return env


def _start_kafka(state_dir: Path, cluster: Cluster, secure: bool, started: list[ServiceHandle]) -> None:
    """Format each process's log dir with one cluster id (concurrently: a JVM
    each), start the controllers and the brokers, wait for each (a broker
    answers once the quorum has a leader: two controllers up)."""
    for port in cluster.brokers:
        ensure_port_free(port, "broker")
    for port in cluster.controllers:
        ensure_port_free(port, "controller")
    if secure:
        kafka_secure.ensure_material(state_dir)
    cluster_id = new_cluster_id()
    names = [*(f"controller-{i}" for i in range(1, len(cluster.controllers) + 1)),
             *(f"broker-{i}" for i in range(1, len(cluster.brokers) + 1))]  # fmt: skip
    configs = {name: _write_config(state_dir, name, cluster, secure) for name in names}
    fresh = [name for name in names if not (_node_dir(state_dir, name) / "kafka-logs" / "meta.properties").exists()]
    # The SCRAM credentials go into the metadata log, which the controllers write.
    scram = kafka_secure.format_scram_args(state_dir) if secure else []
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, len(fresh))) as pool:
        jobs = [pool.submit(format_log_dir, _jvm(state_dir, name, tool=True), configs[name], _node_log(state_dir, name),
                            scram if name.startswith("controller") else [], cluster_id)
                for name in fresh]  # fmt: skip
        for job in jobs:
            job.result()
    handles = []
    for name in names:
        handle = _spawn_node(state_dir, name)
        started.append(handle)
        handles.append(handle)
        pid_path(state_dir, handle.name).write_text(f"{handle.pid}\n")
    for handle in handles:
        _wait_ready(state_dir, handle, secure)


def start_node(state_dir: Path, index: int, role: str = "broker") -> ServiceHandle:
    """(Re)start broker (or controller) ``index`` from its config and log dir
    (after a ``kill -9``, as the fault tests do); return once it answers (a
    broker: metadata; a controller: ApiVersions). Its PID file is rewritten."""
    state_dir = state_dir.resolve()
    handle = _spawn_node(state_dir, f"{role}-{index}")
    pid_path(state_dir, handle.name).write_text(f"{handle.pid}\n")
    secure = "SASL_PLAINTEXT" in _read_config(state_dir, handle.name)["listener.security.protocol.map"]
    _wait_ready(state_dir, handle, secure)
    return handle


def _read_config(state_dir: Path, name: str) -> dict[str, str]:
    config = _node_dir(state_dir, name) / "server.properties"
    return dict(line.split("=", 1) for line in config.read_text().splitlines() if "=" in line)


def _spawn_node(state_dir: Path, name: str) -> ServiceHandle:
    """Start broker or controller ``name`` (``broker-2``, ``controller-1``); its URL is where it listens."""
    check_formatted_by(_node_dir(state_dir, name))
    config = _node_dir(state_dir, name) / "server.properties"
    port = _read_config(state_dir, name)["listeners"].split(",")[0].rsplit(":", 1)[1]
    return spawn(name, [*_jvm(state_dir, name), "kafka.Kafka", str(config)], f"127.0.0.1:{port}",
                     _node_log(state_dir, name))  # fmt: skip


def _wait_ready(state_dir: Path, handle: ServiceHandle, secure: bool) -> None:
    if handle.name.startswith("controller"):
        _poll_controller(state_dir, handle, secure)
    else:
        options = _admin_options(state_dir, handle.url, secure)
        wait_broker_ready(handle.url, pid=handle.pid, log_path=handle.log_path, client=options)


def _poll_controller(state_dir: Path, handle: ServiceHandle, secure: bool) -> None:
    """Until the controller answers ApiVersions on its listener (on the secure
    stack after SASL PLAIN as ``admin``, as the brokers reach it). A controller
    answers no Metadata request; the quorum's leader shows in the brokers'
    readiness."""
    from aiokafka.conn import create_conn

    host, port = handle.url.rsplit(":", 1)
    options: dict[str, Any] = {}
    if secure:
        options = {"security_protocol": "SASL_PLAINTEXT", "sasl_mechanism": "PLAIN",
                   "sasl_plain_username": kafka_secure.ADMIN,
                   "sasl_plain_password": kafka_secure.password_file(state_dir, kafka_secure.ADMIN).read_text().strip()}  # fmt: skip

    async def api_versions(limit: float) -> None:
        conn = await create_conn(host, int(port), client_id="fraud-stack-probe",
                                 request_timeout_ms=max(100, int(limit * 1000)), **options)  # fmt: skip
        conn.close()

    poll("controller", handle.url, lambda limit: run_sync(api_versions(limit)), READY_TIMEOUT_S,
             handle.pid, handle.log_path)  # fmt: skip


def broker_properties(state_dir: Path, index: int, cluster: Cluster) -> dict[str, str]:
    """Broker ``index``'s plaintext settings (``process.roles=broker``, node id ``index``)."""
    port = cluster.brokers[index - 1]
    props = base_properties(port, cluster.controllers[0], _node_dir(state_dir, f"broker-{index}") / "kafka-logs")
    props.update(CLUSTER_CONFIG)
    props.update({"process.roles": "broker", "node.id": str(index), "controller.quorum.voters": cluster.quorum_voters,
                  "listeners": f"PLAINTEXT://127.0.0.1:{port}"})  # fmt: skip
    return props


def controller_properties(state_dir: Path, index: int, cluster: Cluster) -> dict[str, str]:
    """Controller ``index``'s plaintext settings (``process.roles=controller``,
    node id :func:`controller_id`): the controller listener only."""
    port = cluster.controllers[index - 1]
    props = base_properties(port, port, _node_dir(state_dir, f"controller-{index}") / "kafka-logs")
    props.update(CLUSTER_CONFIG)
    for key in ("advertised.listeners", "inter.broker.listener.name"):  # a broker's, refused on a controller
        del props[key]
    props.update({"process.roles": "controller", "node.id": str(controller_id(index)),
                  "controller.quorum.voters": cluster.quorum_voters, "listeners": f"CONTROLLER://127.0.0.1:{port}",
                  "listener.security.protocol.map": "CONTROLLER:PLAINTEXT"})  # fmt: skip
    return props


def _write_config(state_dir: Path, name: str, cluster: Cluster, secure: bool) -> Path:
    role, index = name.split("-")[0], int(name.split("-")[1])
    node_dir = _node_dir(state_dir, name)
    node_dir.mkdir(parents=True, exist_ok=True)
    if role == "broker":
        props = broker_properties(state_dir, index, cluster)
        if secure:
            props.update(kafka_secure.secure_properties(state_dir, cluster.brokers[index - 1], None))
    else:
        props = controller_properties(state_dir, index, cluster)
        if secure:
            props.update(kafka_secure.secure_properties(state_dir, None, cluster.controllers[index - 1]))
    config = node_dir / "server.properties"
    write_private(config, "".join(f"{key}={value}\n" for key, value in props.items()))
    write_log_config(node_dir)
    return config


def _jvm(state_dir: Path, name: str, *, tool: bool = False) -> list[str]:
    """The JVM of broker or controller ``name``, or (``tool``) of a storage tool run for it.

    A controller and a tool run C1-compiled code only, with the serial
    collector: their work is small, and the JIT's and G1's threads would take
    the cores from the brokers at every start (six JVMs at once)."""
    if tool or name.startswith("controller"):
        flags = [*CONTROLLER_HEAP, "-XX:TieredStopAtLevel=1", "-XX:+UseSerialGC"]
    else:
        flags = [*NODE_HEAP, "-XX:+UseG1GC"]
    return [java_binary(), *flags, "-Djava.awt.headless=true", log_config_flag(_node_dir(state_dir, name)),
            "-cp", kafka_classpath()]  # fmt: skip


#: The line a controller logs when it becomes the active one (its log is at WARN).
_ACTIVATION = re.compile(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+)\] .*Performing controller activation")


def active_controller(state_dir: Path, controllers: int = CONTROLLERS) -> int:
    """The controller (its index, from 1: ``controller-<i>``) that last became
    the active KRaft controller, from the controllers' logs (Kafka's admin API
    names a random broker as the controller under KRaft). A restarted
    controller's log starts afresh; the active one's activation is always in
    its own log, written after its last start."""
    found = [
        (m.group(1), index)
        for index in range(1, controllers + 1)
        if (log := _node_log(state_dir, f"controller-{index}")).exists()
        for line in log.read_text(errors="replace").splitlines()
        if (m := _ACTIVATION.match(line))
    ]
    if not found:
        raise StackError(f"no controller in {state_dir} logged its activation")
    return max(found)[1]


def _node_dir(state_dir: Path, name: str) -> Path:
    """Broker or controller ``name``'s config and log dir (``broker-1``, ``controller-3``)."""
    return state_dir / name


def _node_log(state_dir: Path, name: str) -> Path:
    return state_dir / f"{name}.log"


def _admin_settings(state_dir: Path, bootstrap: str, secure: bool) -> Settings:
    if secure:
        return kafka_secure.client_settings(state_dir, kafka_secure.ADMIN, bootstrap)
    return Settings(kafka_bootstrap=bootstrap)


def _admin_options(state_dir: Path, bootstrap: str, secure: bool) -> dict[str, Any]:
    return kafka_auth(_admin_settings(state_dir, bootstrap, secure)) if secure else {}


async def _provision(state_dir: Path, cluster: Cluster, secure: bool) -> None:
    """Wait until every node is registered (a topic with 3 replicas needs 3
    brokers), then create the project's topics, and on the secure stack the ACLs."""
    settings = _admin_settings(state_dir, cluster.bootstrap, secure)
    await _wait_brokers(settings, len(cluster.brokers))
    if secure:
        await provision_secure(settings)
    else:
        await ensure_topics(settings, wait_s=30.0)
    await _create_internal_topics(settings)


async def _create_internal_topics(settings: Settings) -> None:
    """``__consumer_offsets`` and ``__transaction_state`` exist from the first
    coordinator lookup of a group / a transactional id: made here, so ``status``
    shows their replicas and the first worker does not wait for them."""
    import asyncio
    import time

    from aiokafka import AIOKafkaProducer
    from aiokafka.errors import KafkaError

    admin = AIOKafkaAdminClient(bootstrap_servers=settings.kafka_bootstrap, **kafka_auth(settings))
    await admin.start()
    deadline = time.monotonic() + 60
    try:
        while True:
            try:  # "not available" while the topic's partitions get their leaders
                await admin.find_coordinator("fraud-stack-probe")
                break
            except KafkaError:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.2)
    finally:
        await admin.close()
    producer = AIOKafkaProducer(bootstrap_servers=settings.kafka_bootstrap, transactional_id="fraud-stack-probe",
                                **kafka_auth(settings))  # fmt: skip
    await producer.start()  # InitProducerId (retried by the client): the transaction coordinator, hence its topic
    await producer.stop()


async def _wait_brokers(settings: Settings, count: int, timeout: float = 60.0) -> None:
    import asyncio
    import time

    deadline = time.monotonic() + timeout
    seen = 0
    while time.monotonic() < deadline:
        admin = AIOKafkaAdminClient(bootstrap_servers=settings.kafka_bootstrap, **kafka_auth(settings))
        try:
            await admin.start()
            seen = len((await admin.describe_cluster())["brokers"])
        except Exception:  # not yet: the deadline bounds it
            seen = 0
        finally:
            await admin.close()
        if seen >= count:
            return
        await asyncio.sleep(0.2)
    raise StackError(f"only {seen} of {count} brokers registered after {timeout:g} s")


# --- status ------------------------------------------------------------------


async def describe_partitions(settings: Settings, topics: Sequence[str] | None = None) -> dict[str, list[dict[str, Any]]]:
    """``{topic: [{partition, leader, replicas, isr}, ...]}`` for ``topics`` (default:
    every topic, the internal ones too), sorted by partition."""
    admin = AIOKafkaAdminClient(bootstrap_servers=settings.kafka_bootstrap, **kafka_auth(settings))
    await admin.start()
    try:
        names = list(topics) if topics is not None else sorted(await admin.list_topics())
        described = await admin.describe_topics(names)
    finally:
        await admin.close()
    return {
        t["topic"]: sorted(({"partition": p["partition"], "leader": p["leader"], "replicas": list(p["replicas"]),
                             "isr": list(p["isr"])} for p in t["partitions"]), key=lambda p: p["partition"])
        for t in described
    }  # fmt: skip


def cluster_status(state_dir: Path) -> tuple[list[str], bool]:
    """Printable lines (nodes, partitions, Redis) and whether everything is up and fully replicated."""
    state_dir = state_dir.resolve()
    env = read_env(state_dir / "env")
    secure = "FRAUD_KAFKA_SASL_MECHANISM" in env
    lines: list[str] = []
    ok = True
    try:
        active = f"controller-{active_controller(state_dir)}"
    except (StackError, OSError):
        active = ""
    for name in _names(state_dir):
        pid = read_pid(pid_path(state_dir, name))
        alive = pid is not None and runs(pid, _program(name))
        ok &= alive
        role = {"broker": f"node id {name.split('-')[1]}",
                "controller": f"node id {controller_id(int(name.split('-')[1]))}"}.get(name.split("-")[0], "")  # fmt: skip
        role += ", active" if alive and name == active else ""
        lines.append(f"{name:<13} pid {pid if alive else '-':<8} {'running' if alive else 'NOT running':<12}{role}".rstrip())
    if not env:
        return [*lines, "(no env: the cluster is not up)"], False
    try:
        partitions = run_sync(describe_partitions(_admin_settings(state_dir, env["KAFKA_BOOTSTRAP"], secure)))
    except Exception as exc:  # reported, not raised: status is for looking
        lines.append(f"kafka: no answer from {env['KAFKA_BOOTSTRAP']} ({type(exc).__name__}: {exc})")
        ok = False
    else:
        lines.append("topic partitions: partition:leader/in-sync replicas (* under-replicated)")
        for topic, parts in partitions.items():
            cells = []
            for p in parts:
                short = len(p["isr"]) < len(p["replicas"])
                ok &= not short and p["leader"] >= 0
                cells.append(f"{p['partition']}:{p['leader']}/{','.join(map(str, p['isr']))}{'*' if short else ''}")
            lines.append(f"  {topic:<20} " + " ".join(cells))
    lines.append(_redis_line(state_dir, env))
    return lines, ok


def _redis_line(state_dir: Path, env: dict[str, str]) -> str:
    sentinels = [f"redis://127.0.0.1:{port}/0" for port in _sentinel_ports(env.get("REDIS_URL", ""))]
    if (state_dir / "redis-users" / "admin.password").exists() and "FRAUD_KAFKA_SASL_MECHANISM" in env:
        secret = redis_password_path(state_dir, "admin").read_text().strip()
        sentinels = [u.replace("redis://", f"redis://admin:{secret}@") for u in sentinels]
    try:
        view = redis_ha.topology(sentinels)
    except StackError as exc:
        return f"redis: {exc}"
    return f"redis: primary {view.primary} ({view.flags}), in-sync replicas {view.replicas}, {view.sentinels + 1} Sentinels"


def _sentinel_ports(url: str) -> list[int]:
    hosts = url.partition("://")[2].partition("/")[0]
    return [int(h.rsplit(":", 1)[1]) for h in hosts.split(",") if ":" in h]


# --- down --------------------------------------------------------------------


def cluster_down(state_dir: Path) -> None:
    """Stop the processes the PID files in ``state_dir`` name (if still ours):
    Sentinels first (no failover while the data nodes stop), then Redis, then
    the brokers (their controlled shutdown needs the controllers), then the
    controllers."""
    state_dir = state_dir.resolve()
    for kind in ("sentinel", "redis", "broker", "controller"):
        handles = []
        for name in _names(state_dir):
            if name.split("-")[0] != kind:
                continue
            pid_file = pid_path(state_dir, name)
            pid = read_pid(pid_file)
            if pid is not None and runs(pid, _program(name)):
                handles.append(ServiceHandle(name, pid, "", state_dir / f"{name}.log"))
            pid_file.unlink(missing_ok=True)
        _stop_together(handles)
    (state_dir / "env").unlink(missing_ok=True)


def _stop_together(handles: list[ServiceHandle], timeout: float = 20.0) -> None:
    """SIGTERM all at once, then wait (six JVMs one by one would take their sum)."""
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, len(handles))) as pool:
        for handle, _ in zip(handles, pool.map(lambda h: h.stop(timeout), handles), strict=True):
            logger.info("stopped %s (pid %d)", handle.name, handle.pid)


def _names(state_dir: Path) -> list[str]:
    """The services whose PID files are in ``state_dir`` (``broker-1``, ``controller-1``, ``redis-2``, ``sentinel-3``...)."""
    return sorted(p.stem for p in state_dir.glob("*.pid")
                  if p.stem.split("-")[0] in ("broker", "controller", "redis", "sentinel") and "-" in p.stem)  # fmt: skip


def _live(state_dir: Path) -> list[str]:
    out = []
    for name in _names(state_dir):
        pid = read_pid(pid_path(state_dir, name))
        if pid is not None and runs(pid, _program(name)):
            out.append(f"{name} (pid {pid})")
    return out


def _program(name: str) -> str:
    """What a live PID of ``name`` runs (its command line says so)."""
    return {"broker": "kafka.Kafka", "controller": "kafka.Kafka", "redis": "redis-server",
            "sentinel": "redis-sentinel"}[name.split("-")[0]]  # fmt: skip


# --- CLI (``python -m tools.stack ... --brokers 3``) -------------------------


def cli(args: argparse.Namespace) -> int:
    """``up``, ``down``, ``status`` or ``env`` of the cluster that ``args`` name."""
    state_dir: Path = args.state_dir or default_state_dir(args.secure)
    if args.command == "up":
        other = default_state_dir(not args.secure)
        if args.state_dir is None and _live(other):
            raise StackError(f"the cluster in {other} holds the ports: stop it first "
                             f"(`python -m tools.stack down --brokers {args.brokers}{'' if args.secure else ' --secure'}`)")  # fmt: skip
        cluster = Cluster.at(args.brokers, args.broker_port or DEFAULT_BROKER_PORT, args.redis_port or DEFAULT_REDIS_PORT)
        env = cluster_up(state_dir, cluster, secure=args.secure)
        print("".join(f"export {k}={shlex.quote(v)}\n" for k, v in env.items()), end="")
        logger.info("cluster up (state in %s): %s", state_dir, ", ".join(f"{k}={v}" for k, v in env.items()))
        return 0
    if args.command == "down":
        cluster_down(state_dir)
        return 0
    if args.command == "env":
        env = role_env(state_dir, args.kafka_user, args.redis_user)
        print("".join(f"export {k}={shlex.quote(v)}\n" for k, v in env.items()), end="")
        return 0
    lines, ok = cluster_status(state_dir)
    print("\n".join(lines), file=sys.stdout)
    return 0 if ok else 1
