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
fetches from Maven Central into ``.kafka/<version>/lib`` (``deploy/kafka/pom.xml``
names the default version, ``KAFKA_VERSION`` another), run by the machine's Java 17+ as one process acting as broker and
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

The package, one module per concern (each imports only those above it)::

    state.py         the state dir: PID files, ``env``, files only the owner reads
    ports.py         the fixed ports of ``up`` and free ports on loopback for tests
    process.py       spawning servers, signalling them by PID, reaping them
    readiness.py     waiting for a protocol answer from the process we started
    secure.py        Redis ACL users, the secure broker's topics and ACLs, a role's settings
    broker.py        the single-node Kafka broker (KRaft) and its configuration
    redis_server.py  redis-server
    lifecycle.py     ``up`` / ``down`` / ``status`` of the broker and Redis together
    cli.py           ``python -m tools.stack`` (``__main__.py`` adds ``--brokers 3``)
"""

from app.errors import StackError
from tools.stack.broker import skipped_markers, start_broker
from tools.stack.cli import main
from tools.stack.lifecycle import stack_down, stack_status, stack_up
from tools.stack.ports import DEFAULT_BROKER_PORT, DEFAULT_REDIS_PORT, free_port, free_ports
from tools.stack.process import ServiceHandle, pid_alive
from tools.stack.readiness import wait_broker_ready, wait_redis_ready
from tools.stack.redis_server import start_redis
from tools.stack.secure import provision_secure, redis_password_path, role_env
from tools.stack.state import DEFAULT_SECURE_STATE_DIR, DEFAULT_STATE_DIR, read_pid

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
    "read_pid",
    "redis_password_path",
    "role_env",
    "skipped_markers",
    "stack_down",
    "stack_status",
    "stack_up",
    "start_broker",
    "start_redis",
    "wait_broker_ready",
    "wait_redis_ready",
]
