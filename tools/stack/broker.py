"""The single-node broker: Apache Kafka (KRaft, broker and controller in one JVM)."""

from __future__ import annotations

import base64
import os
import re
import shutil
import subprocess
import uuid
from collections.abc import Sequence
from functools import partial
from pathlib import Path

from app.errors import StackError
from app.topics import kafka_auth
from tools import kafka_secure
from tools.stack.ports import ensure_port_free, free_port
from tools.stack.process import ServiceHandle, spawn
from tools.stack.readiness import Wait, ready_or_stopped, run_sync, wait_broker_ready
from tools.stack.secure import provision_secure
from tools.stack.state import DEFAULT_STATE_DIR, write_private

__all__ = [
    "BROKER_CONFIG",
    "BROKER_HEAP",
    "BROKER_LOG4J",
    "BROKER_LOG4J2",
    "FORMATTED_BY",
    "KAFKA_HOME",
    "base_properties",
    "check_formatted_by",
    "default_kafka_version",
    "format_log_dir",
    "java_binary",
    "kafka_classpath",
    "kafka_lib_dir",
    "kafka_version",
    "lib_kafka_version",
    "log_config_flag",
    "new_cluster_id",
    "start_broker",
    "write_log_config",
]

_REPO = Path(__file__).resolve().parents[2]
#: Where ``make setup`` puts each Kafka version's class path: ``<version>/lib``,
#: one folder per version, so that switching versions never mixes their jars.
KAFKA_HOME = _REPO / ".kafka"


def default_kafka_version() -> str:
    """The version ``make setup`` fetches unless ``KAFKA_VERSION`` names another:
    deploy/kafka/pom.xml's, read here so that the pom stays its only statement.

    NOTE: read when asked, not at import: an installed copy of ``tools`` (the
    container image) has no deploy/ beside it and never starts a broker.
    """
    pom = _REPO / "deploy" / "kafka" / "pom.xml"
    found = re.search(r"<kafka.version>([^<]+)</kafka.version>", pom.read_text()) if pom.exists() else None
    if found is None:
        raise StackError(f"{pom} names no <kafka.version>: set KAFKA_VERSION")
    return found.group(1)


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

#: WARN and up, plus the server's start and stop lines and the transaction
#: marker sender's notes (rare: its queues, and markers it skipped for a
#: partition without a leader, which leave a hanging transaction on Kafka
#: 4.4.0: RELIABILITY.md): the broker's log stays readable. Kafka 3.x logs
#: through slf4j and reload4j (log4j 1 syntax); 4.x through log4j2
#: (:data:`BROKER_LOG4J2`, the same levels and line format).
BROKER_LOG4J = """\
log4j.rootLogger=WARN, stdout
log4j.appender.stdout=org.apache.log4j.ConsoleAppender
log4j.appender.stdout.layout=org.apache.log4j.PatternLayout
log4j.appender.stdout.layout.ConversionPattern=[%d] %p %m (%c)%n
log4j.logger.kafka.server.KafkaRaftServer=INFO
log4j.logger.org.apache.kafka.controller=WARN
log4j.logger.kafka.coordinator.transaction=WARN
log4j.logger.kafka.coordinator.transaction.TransactionMarkerChannelManager=INFO
"""

#: :data:`BROKER_LOG4J` for Kafka 4.x, in log4j2's properties syntax. The line
#: format is the same: ``tools/cluster.py`` reads the controllers' activation
#: times from it. ``status = warn``: log4j2's own notes stay out of the log;
#: no shutdown hook: log4j2's would stop logging while the broker's controlled
#: shutdown still logs (and restart it, with a warning of its own).
BROKER_LOG4J2 = """\
status = warn
shutdownHook = disable
appender.stdout.type = Console
appender.stdout.name = STDOUT
appender.stdout.layout.type = PatternLayout
appender.stdout.layout.pattern = [%d] %p %m (%c)%n
rootLogger.level = WARN
rootLogger.appenderRef.stdout.ref = STDOUT
logger.server.name = kafka.server.KafkaRaftServer
logger.server.level = INFO
logger.markers.name = kafka.coordinator.transaction.TransactionMarkerChannelManager
logger.markers.level = INFO
"""


#: What the broker's transaction marker sender logs when it completes a
#: transaction without writing its markers to some partitions (it takes a
#: partition without a leader for a deleted one): each such partition is left
#: with a hanging transaction (RELIABILITY.md, known gaps).
SKIPPED_MARKERS = "these partitions are likely deleted already and hence can be skipped"


def skipped_markers(workdir: Path) -> list[str]:
    """The lines of ``workdir``'s broker log (since its last start) where the
    broker skipped transaction markers: see :data:`SKIPPED_MARKERS`."""
    path = workdir / "broker.log"
    if not path.exists():
        return []
    return [line for line in path.read_text(errors="replace").splitlines() if SKIPPED_MARKERS in line]


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
    ensure_port_free(port, "broker")
    ensure_port_free(controller_port, "broker controller")
    workdir = workdir.resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    classpath, java = kafka_classpath(), java_binary()
    config = workdir / "server.properties"
    props = base_properties(port, controller_port, workdir / "kafka-logs")
    format_args: list[str] = []
    formatted = (workdir / "kafka-logs" / "meta.properties").exists()
    if formatted:
        check_formatted_by(workdir)
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
    write_private(config, "".join(f"{key}={value}\n" for key, value in props.items()))
    jvm = [java, *BROKER_HEAP, "-XX:+UseG1GC", "-Djava.awt.headless=true",
           write_log_config(workdir), "-cp", classpath]  # fmt: skip
    if not formatted:
        format_log_dir(jvm, config, workdir / "broker.log", format_args)
    handle = spawn("broker", [*jvm, "kafka.Kafka", str(config)], f"127.0.0.1:{port}", workdir / "broker.log")
    if not secure:
        return ready_or_stopped(handle, wait_broker_ready)
    admin = kafka_secure.client_settings(workdir, kafka_secure.ADMIN, handle.url)
    wait: Wait = partial(wait_broker_ready, client=kafka_auth(admin))
    ready_or_stopped(handle, wait)
    try:
        run_sync(provision_secure(admin))
    except BaseException:
        handle.stop()
        raise
    return handle


def base_properties(port: int, controller_port: int, log_dir: Path) -> dict[str, str]:
    """``BROKER_CONFIG`` with one node's listeners and log dir (the replicated stack builds on it)."""
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


def format_log_dir(
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
    write_private(argfile, "".join(_java_argfile_quote(a) + "\n" for a in arguments))
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
    (config.parent / FORMATTED_BY).write_text(lib_kafka_version() + "\n")


#: Beside a node's ``kafka-logs``: the Kafka version that formatted it.
FORMATTED_BY = "kafka-version"


def check_formatted_by(directory: Path) -> None:
    """Refuse to start a Kafka older than the one that formatted ``directory/kafka-logs``.

    NOTE: Kafka does not downgrade: 3.9.1 on a log dir 4.4.0 formatted exits at
    once with "Can't read version 4 of BrokerEndpoint" in its log. Said here
    first, with what to do. A dir formatted before the version was recorded is
    not checked.
    """
    stamp = directory / FORMATTED_BY
    if not stamp.exists():
        return
    formatted, running = stamp.read_text().strip(), lib_kafka_version()
    if _release(running) < _release(formatted):
        raise StackError(
            f"{directory} was formatted by Kafka {formatted}, which {running} cannot read (Kafka does not "
            f"downgrade): use another state dir, or remove it (rm -rf {directory}), or run KAFKA_VERSION={formatted}"
        )


def _release(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", version)[:3])


def _java_argfile_quote(argument: str) -> str:
    """One argument as a Java ``@file`` holds it: in double quotes, where a
    backslash escapes (paths with spaces, ``#`` or quotes stay one argument)."""
    return '"' + argument.replace("\\", "\\\\").replace('"', '\\"') + '"'


def kafka_version() -> str:
    """The Kafka version to run: ``$KAFKA_VERSION`` (as ``make setup`` reads it), else the pom's."""
    version = os.environ.get("KAFKA_VERSION") or default_kafka_version()
    if not re.fullmatch(r"\d+\.\d+\.\d+", version):
        raise StackError(f"KAFKA_VERSION={version!r}: a release number like 4.4.0 or 3.9.1 expected")
    return version


def kafka_lib_dir() -> Path:
    """``$FRAUD_KAFKA_LIB`` (a folder of jars), else ``.kafka/<kafka_version()>/lib`` from ``make setup``."""
    given = os.environ.get("FRAUD_KAFKA_LIB")
    return Path(given) if given else KAFKA_HOME / kafka_version() / "lib"


def kafka_classpath() -> str:
    """The broker's class path: every jar in :func:`kafka_lib_dir`."""
    lib = kafka_lib_dir()
    if not any(lib.glob("kafka_2.13-*.jar")):
        setup = "make setup" if "FRAUD_KAFKA_LIB" in os.environ else f"KAFKA_VERSION={kafka_version()} make setup"
        raise StackError(
            f"no Apache Kafka jars in {lib}: run `{setup}` (Maven fetches them per deploy/kafka/pom.xml)"
        )
    return f"{lib}/*"


def lib_kafka_version(lib: Path | None = None) -> str:
    """The version of the broker jar in ``lib`` (default :func:`kafka_lib_dir`): what will run."""
    jars = sorted((lib or kafka_lib_dir()).glob("kafka_2.13-*.jar"))
    if not jars:
        kafka_classpath()  # raises, naming the set-up to run
    return jars[0].name.removeprefix("kafka_2.13-").removesuffix(".jar")


def log_config_flag(directory: Path) -> str:
    """The JVM flag that names the quiet logging configuration in ``directory``
    (:func:`write_log_config` writes it) for the Kafka version in the class path.

    NOTE: the flag must match the logging back end in the jars. 3.x reads
    ``-Dlog4j.configuration`` (reload4j); 4.x ignores it and reads
    ``-Dlog4j2.configurationFile``. Given the other one, the broker falls back
    to its library's defaults: log4j2 logs errors only, after a "No
    configuration found" notice; reload4j nothing, after a "no appenders" warning.
    """
    if _logs_through_log4j2():
        return f"-Dlog4j2.configurationFile={directory / 'broker-log4j2.properties'}"
    return f"-Dlog4j.configuration=file:{directory / 'broker-log4j.properties'}"


def write_log_config(directory: Path) -> str:
    """Write the configuration :func:`log_config_flag` names; return that flag."""
    if _logs_through_log4j2():
        (directory / "broker-log4j2.properties").write_text(BROKER_LOG4J2)
    else:
        (directory / "broker-log4j.properties").write_text(BROKER_LOG4J)
    return log_config_flag(directory)


def _logs_through_log4j2() -> bool:
    return int(lib_kafka_version().split(".")[0]) >= 4


def java_binary() -> str:
    home = os.environ.get("JAVA_HOME")
    found = str(Path(home) / "bin" / "java") if home else shutil.which("java")
    if not found or not os.access(found, os.X_OK):
        raise StackError("java is not on PATH: Kafka needs Java 17+ (Debian: apt-get install default-jre-headless)")
    return found
