"""Canaries for app/seams.py: one per reach into faust's or aiokafka's internals.

Each test runs the seam against the real, pinned classes (built without a
broker) and fails when an upgrade renames, moves or stops consulting what the
seam touches, instead of the seam turning into a silent no-op.
"""

from __future__ import annotations

import asyncio
import inspect
import subprocess
import sys
from pathlib import Path
from typing import Any

import faust
import pytest
from aiokafka import AIOKafkaConsumer
from aiokafka.client import AIOKafkaClient
from aiokafka.cluster import ClusterMetadata
from aiokafka.errors import KafkaError
from faust.transport.drivers import aiokafka as faust_aiokafka

from app import seams

#: Nothing listens here: every object is built, none connects.
NOWHERE = "127.0.0.1:1"


@pytest.fixture
def app(tmp_path: Path) -> faust.App:
    return faust.App("seams-canary", broker=f"kafka://{NOWHERE}", store="memory://", datadir=str(tmp_path))


# --- install_wait_topic_visible -------------------------------------------------------------------


def test_topic_creation_returns_once_every_broker_knows_the_topic(app: faust.App) -> None:
    """A broker that does not know the topic yet is asked again; faust's own
    creation runs first (here it finds the topic in the client's metadata and
    skips the request)."""
    seams.install_wait_topic_visible()
    seams.install_wait_topic_visible()  # idempotent: wrapped once
    transport_cls = faust_aiokafka.Transport
    assert getattr(transport_cls._really_create_topic, "_fraud_patched", False)
    # faust's create_topic reaches it through _create_topic's stampede wrapper.
    assert "self._really_create_topic" in inspect.getsource(transport_cls._create_topic)

    asked: list[int] = []

    class Broker:
        def __init__(self, node: int) -> None:
            self.nodeId = node

    class Cluster:
        def topics(self) -> set[str]:
            return {"t-new"}

        def brokers(self) -> list[Broker]:
            return [Broker(1), Broker(2)]

    class Response:
        def __init__(self, known: bool) -> None:
            self.topics = [(0 if known else 3, "t-new", False, [])]

    class Client:
        cluster = Cluster()

        async def send(self, node: int, request: Any) -> Response:
            asked.append(node)
            return Response(node == 1 or asked.count(2) > 1)

    class Owner:
        log = faust_aiokafka.logger

    asyncio.run(app.transport._really_create_topic(Owner(), Client(), "t-new", 8, 3))
    assert asked == [1, 2, 2]


# --- cluster_metadata -----------------------------------------------------------------------------


def test_cluster_metadata_is_aiokafka_s_metadata_request() -> None:
    assert list(inspect.signature(AIOKafkaClient.fetch_all_metadata).parameters) == ["self"]
    assert callable(ClusterMetadata.partitions_for_topic)

    async def run() -> None:
        kafka = AIOKafkaConsumer(bootstrap_servers=NOWHERE)
        try:
            assert isinstance(kafka._client, AIOKafkaClient)
            # Unbootstrapped, it knows no broker: aiokafka's own error, not an AttributeError.
            with pytest.raises(KafkaError, match="cluster metadata"):
                await asyncio.wait_for(seams.cluster_metadata(kafka), 10)
        finally:
            await kafka.stop()

    asyncio.run(run())


# --- send_raw -------------------------------------------------------------------------------------


def test_send_raw_matches_faust_s_positional_producer_send(app: faust.App) -> None:
    producer = app.producer
    assert type(producer) is faust_aiokafka.Producer
    params = inspect.signature(faust_aiokafka.Producer.send).parameters
    positional = [n for n, p in params.items() if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]
    assert positional == ["self", "topic", "key", "value", "partition", "timestamp", "headers"]
    assert all(p.default is inspect.Parameter.empty for n, p in params.items() if n in positional)
    sent: list[tuple[Any, ...]] = []

    class AIOKafkaProducer:  # what faust's Producer wraps once started
        async def send(self, topic: str, value: Any, **kwargs: Any) -> str:
            sent.append((topic, value, kwargs))
            return "future"

    producer._producer = AIOKafkaProducer()
    assert asyncio.run(seams.send_raw(producer, "decisions", b"key", b"value")) == "future"
    assert sent == [("decisions", b"value", {"key": b"key", "partition": None, "timestamp_ms": None, "headers": None})]


# --- the module itself ----------------------------------------------------------------------------


def test_seams_load_faust_only_when_a_faust_seam_runs() -> None:
    """The gateway and the tools import app.topics (and so app.seams) and never load faust."""
    code = "import sys, app.topics, app.seams; print('faust' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# --- admin_request --------------------------------------------------------------------------------


def test_admin_request_is_the_helper_every_public_admin_method_uses() -> None:
    """If aiokafka renames ``_send_request`` or grows a public ``create_acls``,
    this fails: move the secure stack to the public method then."""
    from aiokafka.admin import AIOKafkaAdminClient
    from aiokafka.protocol.admin import CreateAclsRequest

    assert not hasattr(AIOKafkaAdminClient, "create_acls")
    params = list(inspect.signature(AIOKafkaAdminClient._send_request).parameters)
    assert params[:2] == ["self", "request"]
    assert "_send_request" in inspect.getsource(AIOKafkaAdminClient.describe_configs)  # public methods use it
    assert CreateAclsRequest.API_KEY == 30  # Kafka's CreateAcls

    sent: list[Any] = []

    class Admin:
        async def _send_request(self, request: Any) -> str:
            sent.append(request)
            return "response"

    assert asyncio.run(seams.admin_request(Admin(), "req")) == "response"
    assert sent == ["req"]
