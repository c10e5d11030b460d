"""The replicated stack's pieces that need no server: Sentinel URLs, the clients
built from them, and the cluster nodes' configuration."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from app.errors import ConfigError
from app.redis_client import async_client, is_cluster, is_sentinel, sentinel_target, sync_client
from app.settings import Settings
from tools import cluster


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("redis+sentinel://a:26379,b:26380,c:26381/fraud/0", ([("a", 26379), ("b", 26380), ("c", 26381)], "fraud", 0, False)),
        ("redis+sentinel://127.0.0.1:1/svc/3", ([("127.0.0.1", 1)], "svc", 3, False)),
        ("rediss+sentinel://s1,s2/fraud", ([("s1", 26379), ("s2", 26379)], "fraud", 0, True)),
    ],
)
def test_sentinel_urls(url: str, expected: tuple[object, ...]) -> None:
    assert sentinel_target(url) == expected
    assert is_sentinel(Settings(redis_url=url)) and not is_cluster(Settings(redis_url=url))


@pytest.mark.parametrize("url", ["redis+sentinel:///fraud/0", "redis+sentinel://a:1", "redis+sentinel://a:x/fraud/0",
                                 "redis+sentinel://a:1/fraud/zero"])  # fmt: skip
def test_a_bad_sentinel_url_is_a_config_error(url: str) -> None:
    with pytest.raises(ConfigError):
        sentinel_target(url)


def test_the_sync_client_asks_the_sentinels_with_the_data_nodes_credentials(tmp_path: Path) -> None:
    secret = tmp_path / "worker.password"
    secret.write_text("s3cret\n")
    settings = Settings(redis_url="redis+sentinel://h1:1,h2:2/fraud/2", redis_username="worker",
                        redis_password_file=secret)  # fmt: skip
    client = sync_client(settings, timeout_s=0.5)
    pool = client.connection_pool
    assert pool.service_name == "fraud" and pool.connection_kwargs["db"] == 2
    assert (pool.connection_kwargs["username"], pool.connection_kwargs["password"]) == ("worker", "s3cret")
    [first, second] = pool.sentinel_manager.sentinels
    kwargs = first.connection_pool.connection_kwargs
    assert (kwargs["host"], kwargs["port"], second.connection_pool.connection_kwargs["port"]) == ("h1", 1, 2)
    assert (kwargs["username"], kwargs["password"], kwargs["socket_timeout"]) == ("worker", "s3cret", 0.5)
    client.close()


def test_the_async_client_keeps_the_pool_bound() -> None:
    async def build() -> tuple[object, ...]:
        client = async_client(Settings(redis_url="redis+sentinel://h1:1/fraud/0", redis_pool_size=5))
        pool = client.connection_pool
        out = (pool.service_name, pool.max_connections, pool.connection_kwargs["socket_timeout"])
        await client.aclose()
        return out

    assert asyncio.run(build()) == ("fraud", 5, Settings().redis_timeout_s)


def test_cluster_ports_and_node_config(tmp_path: Path) -> None:
    layout = cluster.Cluster.at(3, 29092, 29379)
    assert (layout.brokers, layout.controllers) == ((29092, 29094, 29096), (29093, 29095, 29097))
    assert layout.bootstrap == "127.0.0.1:29092,127.0.0.1:29094,127.0.0.1:29096"
    assert layout.redis_url == "redis+sentinel://127.0.0.1:29479,127.0.0.1:29480,127.0.0.1:29481/fraud/0"
    voters = "101@127.0.0.1:29093,102@127.0.0.1:29095,103@127.0.0.1:29097"
    config = cluster._write_config(tmp_path, "broker-2", layout, secure=False)
    props = dict(line.split("=", 1) for line in config.read_text().splitlines())
    assert props["node.id"] == "2" and props["process.roles"] == "broker"
    assert props["controller.quorum.voters"] == voters
    assert props["listeners"] == "PLAINTEXT://127.0.0.1:29094"  # no controller listener on a broker
    assert props["advertised.listeners"] == "PLAINTEXT://127.0.0.1:29094"
    assert (props["min.insync.replicas"], props["default.replication.factor"]) == ("2", "3")
    assert (props["offsets.topic.replication.factor"], props["transaction.state.log.replication.factor"],
            props["transaction.state.log.min.isr"]) == ("3", "3", "2")  # fmt: skip
    assert props["unclean.leader.election.enable"] == "false"
    assert props["log.dirs"] == str(tmp_path / "broker-2" / "kafka-logs")
    config = cluster._write_config(tmp_path, "controller-3", layout, secure=False)
    props = dict(line.split("=", 1) for line in config.read_text().splitlines())
    assert props["node.id"] == "103" and props["process.roles"] == "controller"
    assert props["controller.quorum.voters"] == voters
    assert props["listeners"] == "CONTROLLER://127.0.0.1:29097"
    assert props["listener.security.protocol.map"] == "CONTROLLER:PLAINTEXT"
    assert "advertised.listeners" not in props and "inter.broker.listener.name" not in props
    # The settings a controller applies: the topics' defaults and the brokers' sessions.
    for key in ("default.replication.factor", "unclean.leader.election.enable", "broker.session.timeout.ms"):
        assert props[key] == cluster.CLUSTER_CONFIG[key], key
    # The quorum's timeouts are Kafka's: no controller election comes inside a broker's loss.
    assert not any(key.startswith("controller.quorum.") and key != "controller.quorum.voters" for key in props)
    assert props["log.dirs"] == str(tmp_path / "controller-3" / "kafka-logs")


def test_a_controller_runs_a_small_heap_and_a_broker_the_cluster_node_heap(tmp_path: Path) -> None:
    controller = cluster._jvm(tmp_path, "controller-1")
    assert "-Xmx128m" in controller and "-XX:TieredStopAtLevel=1" in controller
    broker = cluster._jvm(tmp_path, "broker-1")
    assert "-Xmx384m" in broker and "-XX:TieredStopAtLevel=1" not in broker


def test_two_brokers_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    """Three replicas with two in sync need three brokers; one is the single stack."""
    from tools import stack

    assert stack.main(["status", "--brokers", "2"]) == 2
    assert "--brokers is 1 or at least 3" in capsys.readouterr().err


def test_the_active_controller_is_the_controller_that_last_logged_its_activation(tmp_path: Path) -> None:
    """Controller 1 was active, then controller 3 took over; controller 1 was
    restarted since (its log starts afresh): controller 3 is named, whatever the
    log order. The brokers' logs are not read."""
    line = "[2026-12-04 20:{t},000] WARN [QuorumController id={n}] Performing controller activation. Loaded ZK migration state of NONE."
    (tmp_path / "controller-1.log").write_text("[2026-12-04 20:53:40,000] INFO started\n")
    (tmp_path / "controller-2.log").write_text(line.format(t="52:01", n=102) + "\n")
    (tmp_path / "controller-3.log").write_text("noise\n" + line.format(t="53:34", n=103) + "\n")
    (tmp_path / "broker-1.log").write_text(line.format(t="59:59", n=1) + "\n")
    assert cluster.active_controller(tmp_path) == 3
    (tmp_path / "controller-2.log").write_text(line.format(t="54:10", n=102) + "\n")
    assert cluster.active_controller(tmp_path) == 2


def test_a_cluster_on_free_ports_never_gives_one_port_twice() -> None:
    for _ in range(20):
        layout = cluster.Cluster.free()
        ports = [*layout.brokers, *layout.controllers, *layout.redis_nodes, *layout.sentinels]
        assert len(ports) == 12 and len(set(ports)) == 12
