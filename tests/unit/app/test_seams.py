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
from types import SimpleNamespace
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


# --- install_read_committed -----------------------------------------------------------------------


def test_read_committed_is_set_on_the_consumer_faust_builds(app: faust.App) -> None:
    seams.install_read_committed()
    seams.install_read_committed()  # idempotent: wrapped once
    thread_cls = faust_aiokafka.AIOKafkaConsumerThread
    assert getattr(thread_cls._create_worker_consumer, "_fraud_patched", False)
    # faust's thread builds its consumer in on_start through _create_consumer.
    assert "self._create_consumer(" in inspect.getsource(thread_cls.on_start)

    async def build() -> Any:
        thread = app.consumer._thread
        assert isinstance(thread, thread_cls)
        return thread._create_consumer(loop=asyncio.get_running_loop())

    kafka = asyncio.run(build())
    assert isinstance(kafka, AIOKafkaConsumer)
    assert kafka._isolation_level == "read_committed"
    # ...and aiokafka still hands that attribute to its fetcher when it starts.
    assert "isolation_level=self._isolation_level" in inspect.getsource(AIOKafkaConsumer.start)


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


# --- install_commit_past_gaps ---------------------------------------------------------------------


def _read(consumer: Any, tp: Any, offsets: list[int], unacked: tuple[int, ...] = ()) -> None:
    """What faust's ``_drain_messages`` does per message read, then the ack
    (but of ``unacked``): a gap from the last offset read (none after offset 0,
    as upstream)."""

    async def run() -> None:
        last = None
        for offset in offsets:
            if last and offset - last > 1:
                await consumer._add_gap(tp, last + 1, offset)
            last = offset
            if offset not in unacked:
                consumer._acked[tp].append(offset)
                consumer._acked_index[tp].add(offset)

    asyncio.run(run())


def test_commits_pass_the_transaction_markers_faust_never_receives(app: faust.App) -> None:
    """One record per transaction: records at even offsets, commit markers at odd ones."""
    seams.install_commit_past_gaps()
    seams.install_commit_past_gaps()  # idempotent: patched once
    from faust.transport import consumer as faust_consumer

    assert getattr(faust_consumer.Consumer._new_offset, "_fraud_patched", False)
    # Upstream still records a jump as (last read + 1, offset read) through _add_gap.
    assert "await self._add_gap(tp, r_offset + 1, offset)" in inspect.getsource(faust_consumer.Consumer._drain_messages)
    consumer, tp = app.consumer, faust.types.TP("feedback", 0)
    _read(consumer, tp, [0, 2, 4, 6, 8])
    first = consumer._new_offset(tp)
    consumer._committed_offset[tp] = first
    # The first commit stops after offset 0 (no gap is recorded after it); the
    # next takes every record read: unpatched, each took about one more.
    assert (first, consumer._new_offset(tp)) == (1, 9)


def test_a_skipped_run_after_offset_0_does_not_stop_the_commits(app: faust.App) -> None:
    """Offset 0 a record, 1-2 an aborted record and its marker: no gap is recorded
    (upstream), and unpatched the commit never passed offset 1."""
    seams.install_commit_past_gaps()
    consumer, tp = app.consumer, faust.types.TP("feedback", 0)
    _read(consumer, tp, [0, 3, 4])
    consumer._committed_offset[tp] = consumer._new_offset(tp)
    assert consumer._committed_offset[tp] == 1
    assert consumer._new_offset(tp) == 5


def test_offsets_below_a_delivered_unacked_message_are_not_taken_for_skipped(app: faust.App) -> None:
    """Committed 1, offset 4 acked, offset 2 delivered and not acked yet: 1-3
    are not a gap to fill (2 is being processed)."""
    seams.install_commit_past_gaps()
    consumer, tp = app.consumer, faust.types.TP("feedback", 0)

    class Message:  # what faust tracks as delivered and not yet acked
        def __init__(self, offset: int) -> None:
            self.tp, self.offset, self.acked = tp, offset, False

    pending = Message(2)
    consumer._unacked_messages.add(pending)
    consumer._committed_offset[tp] = 1
    consumer._acked[tp].append(4)
    assert consumer._new_offset(tp) is None
    pending.acked = True
    consumer._acked[tp].append(2)
    consumer._committed_offset[tp] = consumer._new_offset(tp)
    assert consumer._committed_offset[tp] == 3
    assert consumer._new_offset(tp) == 5


# --- install_resume_keeps_queues ------------------------------------------------------------------


def test_a_second_resume_keeps_what_the_streams_queues_hold() -> None:
    """faust's recovery resumes the flow when it starts and again after its
    seek; records queued in between must reach the streams. Upstream emptied
    the queues at every resume; a resume after a suspension still does."""
    from mode.utils.queues import FlowControlEvent, FlowControlQueue

    seams.install_resume_keeps_queues()

    async def scenario() -> tuple[int, int]:
        flow = FlowControlEvent(initially_suspended=True)
        queue: FlowControlQueue[int] = FlowControlQueue(flow_control=flow, clear_on_resume=True)
        flow.resume()  # the recovery starts: records flow
        queue.put_nowait(72)
        queue.put_nowait(73)
        flow.resume()  # the recovery completes: already active
        kept = queue.qsize()
        flow.suspend()  # a rebalance
        flow.resume()
        return kept, queue.qsize()

    kept, after_rebalance = asyncio.run(scenario())
    assert kept == 2, "the second resume emptied records no stream had processed"
    assert after_rebalance == 0  # a resume after a suspension clears, as upstream


# --- install_flush_drains_buffer -----------------------------------------------------------------


def test_the_flush_before_a_commit_waits_for_every_buffered_write(app: faust.App) -> None:
    """A table write waits on the broker (a partition's leader lost) while a
    second one is queued behind it: the flush a commit awaits returns only once
    both are handed to aiokafka. Upstream's returned after 0.1 s without a
    message sent, and the commit covered writes never made."""
    from faust.transport.producer import ProducerBuffer

    seams.install_flush_drains_buffer()
    assert getattr(ProducerBuffer._send_pending, "_fraud_patched", False)

    async def scenario() -> tuple[bool, list[int]]:
        release = asyncio.Event()
        handed: list[int] = []

        async def publish_message(fut: Any, wait: bool = False) -> None:  # aiokafka's send, stalled
            await release.wait()
            handed.append(fut.n)

        def write(n: int) -> Any:
            return SimpleNamespace(n=n, message=SimpleNamespace(channel=SimpleNamespace(publish_message=publish_message)))

        buffer = ProducerBuffer()
        buffer.app = app
        await buffer.start()
        try:
            buffer.put(write(1))
            buffer.put(write(2))
            await asyncio.sleep(0.05)  # the first is being handed over, the second queued
            flushing = asyncio.ensure_future(buffer.flush())
            await asyncio.sleep(0.4)
            returned_early = flushing.done()
            release.set()
            await asyncio.wait_for(flushing, 5)
            return returned_early, handed
        finally:
            await buffer.stop()

    returned_early, handed = asyncio.run(scenario())
    assert not returned_early, "the flush returned while writes were still in faust's buffer"
    assert handed == [1, 2]


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
