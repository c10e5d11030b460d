"""The replicated local stack: three Kafka KRaft nodes and a Redis that fails over.

``python -m tools.stack up --brokers 3`` (``make stack-up BROKERS=3``) starts it;
``status --brokers 3`` shows each node, every partition's leader and in-sync
replicas, and which Redis node is primary; ``down --brokers 3`` stops exactly
the PIDs ``up`` wrote. State lives in ``.stack/cluster`` (``--secure``:
``.stack/cluster-secure``), apart from the single node's, so both can exist.

Kafka: three JVMs, each broker *and* controller (``process.roles=broker,controller``,
three voters). Combined roles because this is one 2-core machine: three more
controller JVMs would cost ~1 GB and a core's share for nothing a loopback test
can show; losing a node then loses a broker and a voter together, the harder
case (production separates them: deploy/README.md). Every topic has 3 replicas
and ``min.insync.replicas=2`` (project topics: ``app/topics.py``; internal
ones: the broker settings below); unclean leader election stays off; the
project's producers use ``acks=all``.

Redis: a primary, two replicas and three Sentinels (``tools/redis_ha.py``).

Ports: node ``i`` (from 1) listens on ``broker_port + 2(i-1)``, its controller
on the next port; Redis nodes on ``redis_port + i - 1``, Sentinels on
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
from tools import stack as st

__all__ = [
    "CLUSTER_CONFIG", "DEFAULT_BROKER_PORT", "DEFAULT_REDIS_PORT", "Cluster", "cluster_down", "cluster_status",
    "active_controller", "cli", "cluster_up", "default_state_dir", "describe_partitions", "node_ports", "start_node",
]  # fmt: skip

logger = logging.getLogger(__name__)

DEFAULT_BROKER_PORT = 29092
DEFAULT_REDIS_PORT = 29379
#: Three JVMs share two cores with Redis, the workers and the load: each gets less
#: than the single node's 768 MB (measured: ~250 MB heap in use at 120 TPS).
NODE_HEAP = ("-Xms128m", "-Xmx384m")

#: Settings of a cluster node beyond the single node's (``stack.BROKER_CONFIG``).
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
    # (``broker.session.timeout.ms``, 2 s, is the single node's too: the
    # controller fences a broker whose heartbeats stop that long, then moves its
    # leaderships and drops it from the in-sync replicas, which acks=all writes
    # wait for until then.)
    # The KRaft quorum notices a lost active controller after the fetch timeout
    # and elects another within the election timeout (plus a random backoff);
    # only the new controller fences the dead node, a full broker session
    # after it takes over. A kill -9 of the node that was the active
    # controller, no load, three kills each, alternating in one run
    # (``python -m bench.failover``): its leaderships moved after 3.2-3.3 s
    # with these, 4.5-5.2 s with Kafka's defaults (2 s, 1 s, 1 s).
    "controller.quorum.fetch.timeout.ms": "1000",
    "controller.quorum.election.timeout.ms": "500",
    "controller.quorum.election.backoff.max.ms": "500",
    # A broker fenced after 1.5 s without heartbeats (five missed), not the
    # single node's 2 s: the new controller starts every broker's session
    # afresh when it takes over, so after the controller's own loss this
    # session comes on top of the election (3.2-3.5 s against 3.6-3.9 s with
    # 2 s, no load, three kills each).
    "broker.session.timeout.ms": "1500",
    "broker.heartbeat.interval.ms": "300",
    # Fewer threads than the single node: three JVMs on two cores.
    "num.io.threads": "2",
    "num.replica.fetchers": "1",
}


@dataclass(frozen=True)
class Cluster:
    """Where the cluster listens: ``(port, controller port)`` per node, Redis nodes, Sentinels."""

    nodes: tuple[tuple[int, int], ...]
    redis_nodes: tuple[int, ...]
    sentinels: tuple[int, ...]

    @property
    def bootstrap(self) -> str:
        return ",".join(f"127.0.0.1:{port}" for port, _ in self.nodes)

    @property
    def redis_url(self) -> str:
        return redis_ha.sentinel_url(list(self.sentinels))

    @classmethod
    def at(cls, brokers: int, broker_port: int, redis_port: int) -> Cluster:
        return cls(node_ports(brokers, broker_port), tuple(redis_port + i for i in range(3)),
                   tuple(redis_port + 100 + i for i in range(3)))  # fmt: skip

    @classmethod
    def free(cls, brokers: int = 3) -> Cluster:
        ports = st.free_ports(2 * brokers + 6)  # all different (st.free_ports)
        nodes = tuple((ports[2 * i], ports[2 * i + 1]) for i in range(brokers))
        return cls(nodes, tuple(ports[-6:-3]), tuple(ports[-3:]))


def node_ports(brokers: int, base: int) -> tuple[tuple[int, int], ...]:
    return tuple((base + 2 * i, base + 2 * i + 1) for i in range(brokers))


def default_state_dir(secure: bool) -> Path:
    return st.DEFAULT_STATE_DIR / ("cluster-secure" if secure else "cluster")


# --- up ----------------------------------------------------------------------


def cluster_up(state_dir: Path, cluster: Cluster, *, secure: bool = False) -> dict[str, str]:
    """Start every node and the replicated Redis; create the project's topics (3
    replicas); write and return the env (``KAFKA_BOOTSTRAP``, ``REDIS_URL``, and
    on the secure stack how to reach it). On failure, everything started is stopped.

    Idempotent: when every PID file names a live process of ours, they are reused.
    """
    state_dir = state_dir.resolve()
    state_dir.mkdir(parents=True, exist_ok=True)
    live = _live(state_dir)
    if live and len(live) == len(_names(state_dir)) and (state_dir / "env").exists():
        logger.info("cluster already up in %s (%s)", state_dir, ", ".join(live))
        return st._read_env(state_dir / "env")
    if live:
        raise StackError(f"part of the cluster in {state_dir} runs ({', '.join(live)}): "
                         f"`python -m tools.stack down --brokers {len(cluster.nodes)}` first")  # fmt: skip
    started: list[st.ServiceHandle] = []
    try:
        _start_nodes(state_dir, cluster, secure, started)
        ha = redis_ha.start_redis_ha(list(cluster.redis_nodes), list(cluster.sentinels), state_dir, secure=secure)
        for handle in [*ha.nodes, *ha.sentinels]:
            started.append(handle)
            st._pid_path(state_dir, handle.name).write_text(f"{handle.pid}\n")
        st._run_sync(_provision(state_dir, cluster, secure))
    except BaseException:
        for handle in reversed(started):
            handle.stop()
            st._pid_path(state_dir, handle.name).unlink(missing_ok=True)
        raise
    env = {"KAFKA_BOOTSTRAP": cluster.bootstrap, "REDIS_URL": cluster.redis_url}
    if secure:
        client = kafka_secure.client_env(state_dir, "", cluster.bootstrap)
        env.update({k: v for k, v in client.items() if k not in st._PER_ROLE and k != "FRAUD_KAFKA_BOOTSTRAP"})
    st._write_env(state_dir / "env", env)
    return env


def _start_nodes(state_dir: Path, cluster: Cluster, secure: bool, started: list[st.ServiceHandle]) -> None:
    """Format each node's log dir with one cluster id (concurrently: a JVM each),
    start all (a quorum needs two voters up to answer), wait for each."""
    for port, controller in cluster.nodes:
        st._ensure_port_free(port, "broker")
        st._ensure_port_free(controller, "broker controller")
    if secure:
        kafka_secure.ensure_material(state_dir)
    cluster_id = st.new_cluster_id()
    configs = [_write_node_config(state_dir, i, cluster, secure) for i in range(1, len(cluster.nodes) + 1)]
    fresh = [i for i, _ in enumerate(configs, 1) if not (_node_dir(state_dir, i) / "kafka-logs" / "meta.properties").exists()]
    extra = kafka_secure.format_scram_args(state_dir) if secure else []
    with concurrent.futures.ThreadPoolExecutor(max_workers=len(configs)) as pool:
        jobs = [pool.submit(st._format_log_dir, _jvm(state_dir, i), configs[i - 1], _node_log(state_dir, i), extra, cluster_id)
                for i in fresh]  # fmt: skip
        for job in jobs:
            job.result()
    for i in range(1, len(configs) + 1):
        handle = _spawn_node(state_dir, i, cluster.nodes[i - 1][0])
        started.append(handle)
        st._pid_path(state_dir, handle.name).write_text(f"{handle.pid}\n")
    options = _admin_options(state_dir, cluster.bootstrap, secure)
    for handle in started:
        st.wait_broker_ready(handle.url, pid=handle.pid, log_path=handle.log_path, client=options)


def start_node(state_dir: Path, index: int) -> st.ServiceHandle:
    """(Re)start node ``index`` from its config and log dir (after a ``kill -9``,
    as the fault tests do); return once it answers metadata. Its PID file is rewritten."""
    state_dir = state_dir.resolve()
    config = _node_dir(state_dir, index) / "server.properties"
    props = dict(line.split("=", 1) for line in config.read_text().splitlines() if "=" in line)
    port = int(props["advertised.listeners"].rsplit(":", 1)[1])
    handle = _spawn_node(state_dir, index, port)
    st._pid_path(state_dir, handle.name).write_text(f"{handle.pid}\n")
    secure = "SASL_SSL" in props["listeners"]
    options = _admin_options(state_dir, handle.url, secure)
    st.wait_broker_ready(handle.url, pid=handle.pid, log_path=handle.log_path, client=options)
    return handle


def _spawn_node(state_dir: Path, index: int, port: int) -> st.ServiceHandle:
    config = _node_dir(state_dir, index) / "server.properties"
    return st._spawn(f"broker-{index}", [*_jvm(state_dir, index), "kafka.Kafka", str(config)],
                     f"127.0.0.1:{port}", _node_log(state_dir, index))  # fmt: skip


def _write_node_config(state_dir: Path, index: int, cluster: Cluster, secure: bool) -> Path:
    port, controller = cluster.nodes[index - 1]
    node_dir = _node_dir(state_dir, index)
    node_dir.mkdir(parents=True, exist_ok=True)
    props = st._broker_properties(port, controller, node_dir / "kafka-logs")
    props.update(CLUSTER_CONFIG)
    props["node.id"] = str(index)
    props["controller.quorum.voters"] = ",".join(f"{i}@127.0.0.1:{c}" for i, (_, c) in enumerate(cluster.nodes, 1))
    if secure:
        props.update(kafka_secure.secure_properties(state_dir, port, controller))
    config = node_dir / "server.properties"
    st._write_private(config, "".join(f"{key}={value}\n" for key, value in props.items()))
    (node_dir / "broker-log4j.properties").write_text(st._BROKER_LOG4J)
    return config


def _jvm(state_dir: Path, index: int) -> list[str]:
    log4j = _node_dir(state_dir, index) / "broker-log4j.properties"
    return [st._java_binary(), *NODE_HEAP, "-XX:+UseG1GC", "-Djava.awt.headless=true",
            f"-Dlog4j.configuration=file:{log4j}", "-cp", st._kafka_classpath()]  # fmt: skip


#: The line a node logs when it becomes the active controller (its log is at WARN).
_ACTIVATION = re.compile(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+)\] .*Performing controller activation")


def active_controller(state_dir: Path, nodes: int = 3) -> int:
    """The node that last became the active KRaft controller, from the nodes'
    logs (Kafka's admin API names a random broker as the controller under KRaft).
    A restarted node's log starts afresh; the active controller's activation is
    always in its own log, written after its last start."""
    found = [
        (m.group(1), index)
        for index in range(1, nodes + 1)
        for line in _node_log(state_dir, index).read_text(errors="replace").splitlines()
        if (m := _ACTIVATION.match(line))
    ]
    if not found:
        raise StackError(f"no node in {state_dir} logged a controller activation")
    return max(found)[1]


def _node_dir(state_dir: Path, index: int) -> Path:
    return state_dir / f"node-{index}"


def _node_log(state_dir: Path, index: int) -> Path:
    return state_dir / f"broker-{index}.log"


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
    await _wait_brokers(settings, len(cluster.nodes))
    if secure:
        await st.provision_secure(settings)
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
    env = st._read_env(state_dir / "env")
    secure = "FRAUD_KAFKA_SASL_MECHANISM" in env
    lines: list[str] = []
    ok = True
    for name in _names(state_dir):
        pid = st._read_pid(st._pid_path(state_dir, name))
        alive = pid is not None and st._runs(pid, _program(name))
        ok &= alive
        lines.append(f"{name:<11} pid {pid if alive else '-':<8} {'running' if alive else 'NOT running'}")
    if not env:
        return [*lines, "(no env: the cluster is not up)"], False
    try:
        partitions = st._run_sync(describe_partitions(_admin_settings(state_dir, env["KAFKA_BOOTSTRAP"], secure)))
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
        secret = st.redis_password_path(state_dir, "admin").read_text().strip()
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
    Sentinels first (no failover while the data nodes stop), then Redis, then Kafka."""
    state_dir = state_dir.resolve()
    for kind in ("sentinel", "redis", "broker"):
        handles = []
        for name in _names(state_dir):
            if name.split("-")[0] != kind:
                continue
            pid_path = st._pid_path(state_dir, name)
            pid = st._read_pid(pid_path)
            if pid is not None and st._runs(pid, _program(name)):
                handles.append(st.ServiceHandle(name, pid, "", state_dir / f"{name}.log"))
            pid_path.unlink(missing_ok=True)
        _stop_together(handles)
    (state_dir / "env").unlink(missing_ok=True)


def _stop_together(handles: list[st.ServiceHandle], timeout: float = 20.0) -> None:
    """SIGTERM all at once, then wait. NOTE: one by one, the last Kafka node hangs
    in its controlled shutdown: with two voters gone there is no controller to
    acknowledge it (measured: SIGTERM ignored for 30 s)."""
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, len(handles))) as pool:
        for handle, _ in zip(handles, pool.map(lambda h: h.stop(timeout), handles), strict=True):
            logger.info("stopped %s (pid %d)", handle.name, handle.pid)


def _names(state_dir: Path) -> list[str]:
    """The services whose PID files are in ``state_dir`` (``broker-1``, ``redis-2``, ``sentinel-3``...)."""
    return sorted(p.stem for p in state_dir.glob("*.pid") if p.stem.split("-")[0] in ("broker", "redis", "sentinel")
                  and "-" in p.stem)  # fmt: skip


def _live(state_dir: Path) -> list[str]:
    out = []
    for name in _names(state_dir):
        pid = st._read_pid(st._pid_path(state_dir, name))
        if pid is not None and st._runs(pid, _program(name)):
            out.append(f"{name} (pid {pid})")
    return out


def _program(name: str) -> str:
    """What a live PID of ``name`` runs (its command line says so)."""
    return {"broker": "kafka.Kafka", "redis": "redis-server", "sentinel": "redis-sentinel"}[name.split("-")[0]]


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
        env = st.role_env(state_dir, args.kafka_user, args.redis_user)
        print("".join(f"export {k}={shlex.quote(v)}\n" for k, v in env.items()), end="")
        return 0
    lines, ok = cluster_status(state_dir)
    print("\n".join(lines), file=sys.stdout)
    return 0 if ok else 1
