"""docker-compose.yml, the Prometheus config and the KEDA example agree with the code.

The compose file is validated by Debian's ``docker-compose config`` (no Docker
engine needed); what it prints, resolved, is then checked against what a user
running ``docker compose up --scale worker=N`` depends on.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from agents.metrics import WorkerMetrics
from app.settings import Settings

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
COMPOSE = shutil.which("docker-compose")


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    if COMPOSE is None:
        pytest.skip("docker-compose is not installed (Debian: apt-get install docker-compose; `make setup` does)")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FRAUD_", "COMPOSE_"))}
    done = subprocess.run(
        [COMPOSE, "-f", str(REPO / "docker-compose.yml"), "config"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, f"docker-compose config refused the file:\n{done.stderr}"
    return yaml.safe_load(done.stdout)


KAFKA_NODES = ("kafka-1", "kafka-2", "kafka-3")
CONTROLLERS = ("controller-1", "controller-2", "controller-3")
SENTINELS = ("sentinel-1", "sentinel-2", "sentinel-3")


def test_services(compose: dict[str, Any]) -> None:
    assert set(compose["services"]) == {*CONTROLLERS, *KAFKA_NODES, "topics", "redis", "redis-replica-1",
                                        "redis-replica-2", *SENTINELS, "worker", "feedback", "gateway",
                                        "prometheus"}  # fmt: skip


def test_images_are_pinned(compose: dict[str, Any]) -> None:
    for name, service in compose["services"].items():
        image = service["image"]
        repo, _, tag = image.rpartition(":")
        assert repo and tag and tag != "latest" and "/" not in tag, f"{name}: image {image!r} is not pinned"
    base = re.search(r"^FROM (\S+)", (REPO / "Dockerfile").read_text(), re.M)
    assert base and re.search(r":\d+\.\d+\.\d+", base.group(1)), "the Dockerfile's base image is not pinned"


#: Per process, not cluster-wide: each side names its own (compose adds a host listener to the brokers).
_PER_PROCESS = ("node.id", "process.roles", "listeners", "advertised.listeners", "listener.security.protocol.map",
                "controller.quorum.voters", "log.dirs")  # fmt: skip


def _same_as_the_local_cluster(name: str, env: dict[str, Any], props: dict[str, str]) -> None:
    """Every setting ``env`` states that the local cluster's process of that role has too is equal."""
    for key, value in props.items():
        compose_key = "KAFKA_" + key.upper().replace(".", "_")
        if key not in _PER_PROCESS and compose_key in env:
            assert str(env[compose_key]).lower() == value.lower(), f"{name}: {compose_key} differs from the local cluster"
    for key in env:  # and nothing the local cluster's process lacks (a setting only one of them runs with)
        if key.startswith("KAFKA_") and key != "KAFKA_HEAP_OPTS":
            prop = key.removeprefix("KAFKA_").lower().replace("_", ".")
            assert prop in props or prop in _PER_PROCESS, f"{name}: {key} is not a setting of the local cluster's"


def test_kafka_is_three_controllers_and_three_brokers_replicating_every_topic(compose: dict[str, Any],
                                                                              tmp_path: Path) -> None:  # fmt: skip
    """Three dedicated KRaft controllers (the voters) and three brokers; 3
    replicas and 2 in sync for every topic, the internal ones included; no
    unclean election; each process with the settings of the local cluster's
    (tools/cluster.py) of its role."""
    from tools import cluster

    services = compose["services"]
    layout = cluster.Cluster.at(3, 29092, 29379)
    envs = [services[name]["environment"] for name in (*CONTROLLERS, *KAFKA_NODES)]
    assert sorted(int(env["KAFKA_NODE_ID"]) for env in envs) == [1, 2, 3, 101, 102, 103]
    assert [cluster.controller_id(i) for i in (1, 2, 3)] == [101, 102, 103]  # as the local cluster numbers them
    voters = {str(env["KAFKA_CONTROLLER_QUORUM_VOTERS"]) for env in envs}
    assert voters == {"101@controller-1:9093,102@controller-2:9093,103@controller-3:9093"}
    assert len({env["CLUSTER_ID"] for env in envs}) == 1
    for index, name in enumerate(CONTROLLERS, 1):
        env = services[name]["environment"]
        assert services[name]["image"].startswith("apache/kafka:")
        assert env["KAFKA_PROCESS_ROLES"] == "controller" and int(env["KAFKA_NODE_ID"]) == cluster.controller_id(index)
        assert env["KAFKA_LISTENERS"] == "CONTROLLER://:9093" and "ports" not in services[name]
        assert "--bootstrap-controller localhost:9093" in " ".join(services[name]["healthcheck"]["test"])
        _same_as_the_local_cluster(name, env, cluster.controller_properties(tmp_path, index, layout))
    host_ports = set()
    for index, name in enumerate(KAFKA_NODES, 1):
        env = services[name]["environment"]
        assert services[name]["image"].startswith("apache/kafka:")
        assert env["KAFKA_PROCESS_ROLES"] == "broker" and int(env["KAFKA_NODE_ID"]) == index
        assert "CONTROLLER" not in env["KAFKA_LISTENERS"]
        assert f"PLAINTEXT://{name}:9092" in env["KAFKA_ADVERTISED_LISTENERS"]
        host_ports.add(env["KAFKA_ADVERTISED_LISTENERS"].rsplit(":", 1)[1])
        assert not any("zookeeper" in k.lower() or "zookeeper" in str(v) for k, v in env.items())
        assert str(env["KAFKA_AUTO_CREATE_TOPICS_ENABLE"]).lower() == "false"  # topics come from app/topics.py
        assert set(services[name]["depends_on"]) == set(CONTROLLERS)  # a broker registers with the quorum
        _same_as_the_local_cluster(name, env, cluster.broker_properties(tmp_path, index, layout))
        for key in ("offsets.topic.replication.factor", "transaction.state.log.replication.factor",
                    "transaction.state.log.min.isr", "default.replication.factor", "min.insync.replicas",
                    "unclean.leader.election.enable", "broker.session.timeout.ms",
                    "broker.heartbeat.interval.ms"):  # fmt: skip
            assert "KAFKA_" + key.upper().replace(".", "_") in env, f"{name}: {key} not stated"
    assert len(host_ports) == 3  # tools on the host reach each broker
    assert set(services["topics"]["depends_on"]) == set(KAFKA_NODES)
    assert services["worker"]["environment"]["FRAUD_REPLICATION_FACTOR"] == "3"


def test_redis_is_a_primary_with_two_replicas_under_three_sentinels(compose: dict[str, Any]) -> None:
    from app.redis_client import sentinel_target
    from app.settings import Settings

    services = compose["services"]
    for name in ("redis-replica-1", "redis-replica-2"):
        command = services[name]["command"]
        assert command[command.index("--replicaof") + 1 :][:2] == ["redis", "6379"], name
    url = services["worker"]["environment"]["REDIS_URL"]
    sentinels, service, db, tls = sentinel_target(url)
    assert [host for host, _ in sentinels] == list(SENTINELS) and db == 0 and not tls
    for name in SENTINELS:
        script = " ".join(services[name]["command"])
        port = next(p for h, p in sentinels if h == name)
        assert f"'port {port}'" in script
        # Quorum 2 of 3: one Sentinel lost still fails over; one alone never does.
        assert f"'sentinel monitor {service} redis 6379 2'" in script
        assert "exec redis-sentinel /tmp/sentinel.conf" in script
    # The URL is one the project's client factory takes (and not a Redis Cluster's).
    assert Settings(redis_url=url).redis_url == url


def test_topics_created_once_by_the_project_command_before_workers(compose: dict[str, Any]) -> None:
    services = compose["services"]
    assert services["topics"]["command"] == ["fraud-pipeline", "topics"]
    assert services["topics"]["restart"] == "no"
    for name in ("worker", "feedback", "gateway"):
        assert services[name]["depends_on"]["topics"]["condition"] == "service_completed_successfully", name
        for sentinel in SENTINELS:  # Redis is reached through them
            assert services[name]["depends_on"][sentinel]["condition"] == "service_healthy", name


def test_workers_scale(compose: dict[str, Any]) -> None:
    worker = compose["services"]["worker"]
    assert "container_name" not in worker and "ports" not in worker, "replicas would collide"
    command = worker["command"]
    assert command[:2] == ["fraud-pipeline", "worker"]
    # Scoring replicas run the decision path only; the feedback loop runs once, in its own group.
    assert command[command.index("--role") + 1] == "score"
    feedback = compose["services"]["feedback"]["command"]
    assert feedback[:2] == ["fraud-pipeline", "worker"] and feedback[feedback.index("--role") + 1] == "feedback"
    port = command[command.index("--web-port") + 1]
    assert worker["environment"]["FRAUD_WEB_HOST"] == "0.0.0.0"  # Prometheus scrapes it from another container
    assert str(port) in [str(p) for p in worker["expose"]]
    env = worker["environment"]
    assert env["KAFKA_BOOTSTRAP"] == ",".join(f"{node}:9092" for node in KAFKA_NODES)
    assert env["REDIS_URL"].startswith("redis+sentinel://")
    assert "FRAUD_CLIENT_KEYS" in env  # passed through from the shell
    assert f"127.0.0.1:{port}/metrics" in " ".join(worker["healthcheck"]["test"])
    # One image, built from this repository, for every service that runs the project's code.
    ours = {n: s for n, s in compose["services"].items() if "build" in s}
    assert set(ours) == {"topics", "worker", "feedback", "gateway"} and len({s["image"] for s in ours.values()}) == 1


def test_each_service_is_its_role_on_a_secured_cluster_and_plaintext_by_default(compose: dict[str, Any]) -> None:
    """One principal per role (tools/kafka_acls.py), no password in the environment,
    and nothing that switches SASL/TLS on unless the shell asks for it."""
    from tools.kafka_acls import ROLES
    from tools.kafka_secure import ADMIN

    services = compose["services"]
    users = {name: services[name]["environment"]["FRAUD_KAFKA_SASL_USERNAME"]
             for name in ("topics", "worker", "feedback", "gateway")}  # fmt: skip
    assert users == {"topics": ADMIN, "worker": ROLES["scoring-worker"],
                     "feedback": ROLES["feedback-worker"], "gateway": ROLES["gateway"]}  # fmt: skip
    for name in users:
        env = services[name]["environment"]
        assert not [k for k in env if k.endswith("PASSWORD")], name  # only password files
        assert "FRAUD_KAFKA_SASL_PASSWORD_FILE" in env and "FRAUD_KAFKA_SSL_CAFILE" in env
        # Empty means unset (app/settings.py): the plaintext broker of this file needs none of it.
        assert env["FRAUD_KAFKA_SASL_MECHANISM"] == "" and env["FRAUD_KAFKA_SSL"] == ""
    assert services["worker"]["environment"]["FRAUD_REDIS_USERNAME"] == ""  # open Redis by default
    assert "FRAUD_DECISION_SIGNING_KEY_FILE" in services["worker"]["environment"]
    assert "FRAUD_DECISION_PUBLIC_KEYS_FILE" in services["gateway"]["environment"]


def test_gateway(compose: dict[str, Any]) -> None:
    gateway = compose["services"]["gateway"]
    assert gateway["command"] == ["fraud-pipeline", "gateway", "--port", "8080"]
    assert any(str(p).split(":")[-1].startswith("8080") for p in gateway["ports"])
    assert gateway["environment"]["KAFKA_BOOTSTRAP"] == compose["services"]["worker"]["environment"]["KAFKA_BOOTSTRAP"]


def _mounts(service: dict[str, Any]) -> dict[str, str]:
    out = {}
    for v in service["volumes"]:
        source, target = (v["source"], v["target"]) if isinstance(v, dict) else v.split(":")[:2]
        out[target] = source
    return out


def test_prometheus_finds_every_worker_by_dns(compose: dict[str, Any]) -> None:
    prometheus = compose["services"]["prometheus"]
    mounts = _mounts(prometheus)
    assert Path(mounts["/etc/prometheus/prometheus.yml"]).resolve() == DEPLOY / "prometheus.yml"
    config = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    worker_port = compose["services"]["worker"]["command"][-1]
    [job] = [j for j in config["scrape_configs"] if j["job_name"] == "fraud-worker"]
    [sd] = job["dns_sd_configs"]
    assert sd["names"] == ["worker"] and sd["type"] == "A" and str(sd["port"]) == str(worker_port)
    assert job["metrics_path"] == "/metrics"
    for rule_file in config["rule_files"]:
        assert rule_file in mounts, f"{rule_file} is not mounted into the container"
        assert Path(mounts[rule_file]).is_file()


def _exported_names() -> set[str]:
    names = set()
    for family in WorkerMetrics(Settings()).registry.collect():
        names.add(family.name)
        suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count")}.get(family.type, ())
        names.update(family.name + s for s in suffixes)
    return names


def test_recording_rules_use_metrics_the_worker_exports() -> None:
    rules = yaml.safe_load((DEPLOY / "prometheus-rules.yml").read_text())
    exported = _exported_names()
    records = set()
    for group in rules["groups"]:
        for rule in group["rules"]:
            if "record" in rule:
                records.add(rule["record"])
            for name in re.findall(r"\bfraud(?::[a-z_]+)+|\bfraud_[a-z_]+", rule["expr"]):
                assert name in exported or name in records, f"{rule.get('record', rule.get('alert'))} uses {name}, which nothing defines"
    assert "fraud:desired_workers" in records


def test_keda_matches_the_settings(compose: dict[str, Any]) -> None:
    scaled = yaml.safe_load((DEPLOY / "keda-scaledobject.yaml").read_text())
    settings = Settings()
    assert scaled["kind"] == "ScaledObject"
    spec = scaled["spec"]
    partitions = int(compose["services"]["worker"]["environment"]["FRAUD_PARTITIONS"])
    assert spec["maxReplicaCount"] == partitions == settings.partitions  # a worker past the partitions idles
    assert spec["minReplicaCount"] >= 1
    [kafka] = [t for t in spec["triggers"] if t["type"] == "kafka"]
    meta = kafka["metadata"]
    # The scoring workers' group (agents/wiring.py), whose lag is what they have not decided.
    assert meta["consumerGroup"] == f"{settings.app_id}-score" and meta["topic"] == settings.topic_transactions
    assert meta["allowIdleConsumers"] == "false" and int(meta["lagThreshold"]) > 0
    assert meta["bootstrapServers"] == compose["services"]["worker"]["environment"]["KAFKA_BOOTSTRAP"]


def test_the_image_copies_every_package_the_project_installs() -> None:
    """A package left out of the image installs nothing and fails only at import, in production."""
    import tomllib

    include = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    packages = {name.rstrip("*") for name in include}
    copied = set(re.findall(r"^COPY (\w+) \./\1$", (REPO / "Dockerfile").read_text(), re.M))
    assert packages <= copied, f"not copied into the image: {sorted(packages - copied)}"


def test_a_new_cluster_id_never_reads_as_an_option(monkeypatch: pytest.MonkeyPatch) -> None:
    """A UUID whose base64 starts with "-" made the storage tool's format fail."""
    import uuid

    from tools.stack import broker

    dashed = uuid.UUID(bytes=b"\xfb" + bytes(15))  # base64 "-w..."
    draws = iter([dashed, uuid.UUID(int=1)])
    monkeypatch.setattr(broker.uuid, "uuid4", lambda: next(draws))
    cluster_id = broker.new_cluster_id()
    assert not cluster_id.startswith("-") and len(cluster_id) == 22


def test_the_readme_says_the_topology_and_how_to_size_it() -> None:
    """The topology table names what the compose file sets; sizing gives a method
    and points at the measured figures rather than copying them."""
    text = (DEPLOY / "README.md").read_text()
    topology = text.split("## Topology", 1)[1].split("\n## ", 1)[0]
    for needle in ("3 KRaft controllers", "process.roles=controller", "3 brokers", "min.insync.replicas=2", "acks=all", "unclean.leader.election.enable=false",
                   "3 Sentinels", "redis+sentinel://"):  # fmt: skip
        assert needle in topology, needle
    sizing = text.split("## Sizing brokers and partitions for 5,000 TPS", 1)[1].split("\n## ", 1)[0]
    assert "../docs/performance.md" in sizing and (REPO / "docs" / "performance.md").is_file()
    for part in ("**Workers**", "**Partitions**", "**Broker CPU**", "**Redis**"):
        assert part in sizing, part


PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None, reason="promtool is not installed (Debian: apt-get install prometheus; `make test-tools` does)"
)


@needs_promtool
def test_prometheus_loads_the_rules_file() -> None:
    """What Prometheus itself checks at start: the syntax, every expression parses."""
    assert PROMTOOL is not None
    done = subprocess.run([PROMTOOL, "check", "rules", str(DEPLOY / "prometheus-rules.yml")],
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr


@needs_promtool
def test_every_rule_gives_what_its_test_expects_on_known_series() -> None:
    """deploy/prometheus-rules.test.yml evaluates each recording rule on known
    series and each alert before and after its `for:`; a rule no test
    evaluates fails here too."""
    assert PROMTOOL is not None
    tests = yaml.safe_load((DEPLOY / "prometheus-rules.test.yml").read_text())
    tested = {case["expr"] for test in tests["tests"] for case in test.get("promql_expr_test", [])}
    tested |= {case["alertname"] for test in tests["tests"] for case in test.get("alert_rule_test", [])}
    rules = yaml.safe_load((DEPLOY / "prometheus-rules.yml").read_text())
    names = {rule.get("record") or rule.get("alert") for group in rules["groups"] for rule in group["rules"]}
    assert names <= tested, f"rules no promtool test evaluates: {sorted(names - tested)}"
    done = subprocess.run([PROMTOOL, "test", "rules", str(DEPLOY / "prometheus-rules.test.yml")],
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr


def metrics_table() -> dict[str, str]:
    """deploy/README.md's metrics table: each metric it names (first column) -> its type."""
    text = (DEPLOY / "README.md").read_text().split("## Metrics", 1)[1].split("\n## ", 1)[0]
    out = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")] if line.startswith("| `") else []
        for name in re.findall(r"`((?:fraud|process)_[a-z_]+)", cells[0] if cells else ""):
            out[name] = cells[1]
    return out


def metric_family(name: str) -> str:
    """The metric family a documented name belongs to (counters are documented with ``_total``)."""
    return re.sub(r"_(total|bucket|sum|count)$", "", name)


def test_the_deploy_readme_names_every_worker_metric_and_only_those() -> None:
    """Both ways: an operator reading the table finds every `fraud_*` family a
    worker serves, and nothing the worker does not serve."""
    served = {family.name: family.type for family in WorkerMetrics(Settings()).registry.collect()}
    table = metrics_table()
    for name, kind in table.items():
        assert metric_family(name) in served, f"deploy/README.md names {name}, which no worker serves"
        assert served[metric_family(name)] in kind, f"{name}: the table says {kind}, the worker serves a {served[metric_family(name)]}"
    documented = {metric_family(name) for name in table}
    assert not {f for f in served if f.startswith("fraud_")} - documented, "served but not in deploy/README.md"


def rules_metric_names() -> set[str]:
    """Every metric (not a recording rule's own name) an expression of deploy/prometheus-rules.yml reads."""
    rules = yaml.safe_load((DEPLOY / "prometheus-rules.yml").read_text())
    names = set()
    for group in rules["groups"]:
        for rule in group["rules"]:
            names.update(re.findall(r"\b(?:fraud|process)_[a-z_]+", re.sub(r"\bfraud(?::[a-z_]+)+", "", rule["expr"])))
    return names


def test_the_rules_read_only_metrics_a_worker_serves() -> None:
    served = {family.name for family in WorkerMetrics(Settings()).registry.collect()}
    assert {metric_family(n) for n in rules_metric_names()} <= served
