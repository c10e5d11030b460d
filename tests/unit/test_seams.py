"""Canaries for app/seams.py: one per reach into faust's, mode's or aiokafka's internals.

Each test runs the seam against the real, pinned classes (built without a
broker) and fails when an upgrade renames, moves or stops consulting what the
seam touches, instead of the seam turning into a silent no-op.
"""

from __future__ import annotations

import asyncio
import inspect
import subprocess
import sys
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import faust
import pytest
from aiokafka import AIOKafkaConsumer
from aiokafka.client import AIOKafkaClient
from aiokafka.cluster import ClusterMetadata
from aiokafka.consumer.fetcher import Fetcher
from aiokafka.errors import KafkaError
from aiokafka.structs import TopicPartition
from faust.exceptions import ConsumerNotStarted
from faust.transport import consumer as faust_consumer
from faust.transport.drivers import aiokafka as faust_aiokafka
from faust.types import TP
from mode.threads import QueueServiceThread

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


# --- untrack_read_offsets -------------------------------------------------------------------------


def test_untracked_read_offsets_replace_the_map_of_the_consumer_faust_builds(app: faust.App) -> None:
    seams.untrack_read_offsets(app, "untracked")
    consumer = app.consumer  # built through App._new_consumer
    assert isinstance(consumer, faust_consumer.Consumer)
    assert isinstance(consumer._read_offset, seams.ReadOffsets)
    # faust assigns the map once, in __init__: nothing replaces it after it is built.
    assert inspect.getsource(faust_consumer.Consumer).count("self._read_offset = ") == 1


def test_faust_fetch_loop_consults_the_replaced_read_offsets(app: faust.App) -> None:
    """faust's own seek to the committed offsets (which fills the map with
    ``update``), then its own fetch loop, fed records below them and a re-read
    (3 after 12) on two topics: it drops the tracked topic's and delivers every
    record of the untracked one."""
    seams.untrack_read_offsets(app, "untracked")
    untracked, tracked = TP("untracked", 0), TP("tracked", 0)
    delivered: list[tuple[str, int]] = []

    async def run() -> None:
        consumer = app.consumer  # built on the running loop: the fetch loop waits on it
        fetcher = SimpleNamespace(_stopped=asyncio.Event())

        async def seek_to_committed() -> dict[Any, int]:  # the broker round trip
            return {untracked: 10, tracked: 10}

        async def getmany(timeout: float) -> Any:
            for offset in (5, 12, 3):
                for tp in (untracked, tracked):
                    yield tp, SimpleNamespace(tp=tp, topic=tp.topic, offset=offset, key=None, value=None)
            fetcher._stopped.set()

        async def callback(message: Any) -> None:
            delivered.append((message.topic, message.offset))

        consumer.seek_to_committed = seek_to_committed
        await consumer.perform_seek()
        consumer.getmany = getmany
        consumer.callback = callback
        await asyncio.wait_for(consumer._drain_messages(fetcher), 10)

    asyncio.run(run())
    assert delivered == [("untracked", 5), ("untracked", 12), ("tracked", 12), ("untracked", 3)]


# --- worker_consumer / on_consumer_thread ---------------------------------------------------------


def test_worker_consumer_and_its_thread_are_faust_s(app: faust.App) -> None:
    """faust's consumer thread, started without connecting: the seam finds the
    aiokafka consumer it built and runs code on that thread with it."""
    assert QueueServiceThread.call_thread is faust_aiokafka.AIOKafkaConsumerThread.call_thread
    assert list(inspect.signature(QueueServiceThread.call_thread).parameters) == ["self", "fun", "args", "kwargs"]

    async def run() -> None:
        thread = app.consumer._thread
        with pytest.raises(ConsumerNotStarted):
            seams.worker_consumer(app)  # reaches faust's _ensure_consumer

        async def on_start() -> None:  # faust's on_start, less the connection
            thread._consumer = thread._create_consumer(loop=thread.thread_loop)

        thread.on_start = on_start
        await thread.start()
        try:
            kafka = seams.worker_consumer(app)
            assert isinstance(kafka, AIOKafkaConsumer)
            seen: dict[str, Any] = {}

            async def probe(consumer: Any) -> int:
                seen["thread"], seen["consumer"] = threading.get_ident(), consumer
                return 7

            assert await asyncio.wait_for(seams.on_consumer_thread(app, probe), 10) == 7
            assert seen["consumer"] is kafka
            assert seen["thread"] != threading.get_ident()
        finally:
            await thread.stop()

    asyncio.run(run())


# --- consumer_flowing -----------------------------------------------------------------------------


def test_consumer_flowing_follows_faust_s_flow_and_rebalancing(app: faust.App) -> None:
    consumer = app.consumer
    assert seams.consumer_flowing(app)
    consumer.stop_flow()
    assert not seams.consumer_flowing(app)  # a renamed flag would read as flowing
    consumer.resume_flow()
    assert seams.consumer_flowing(app)
    app.rebalancing = True
    assert not seams.consumer_flowing(app)
    assert "rebalancing" in faust.types.AppT.__annotations__


# --- faust_partition_flags ------------------------------------------------------------------------


def test_faust_partition_flags_follow_faust_s_own_bookkeeping(app: faust.App) -> None:
    consumer = app.consumer
    tp = TP("t", 0)
    assert seams.faust_partition_flags(consumer, tp) == {"active": False, "paused": False, "buffered": False}
    consumer.resume_partitions({tp})
    assert seams.faust_partition_flags(consumer, tp) == {"active": True, "paused": False, "buffered": False}
    consumer.on_buffer_full(tp)
    assert seams.faust_partition_flags(consumer, tp) == {"active": False, "paused": False, "buffered": True}
    consumer.on_buffer_drop(tp)
    consumer.pause_partitions({tp})
    assert seams.faust_partition_flags(consumer, tp) == {"active": False, "paused": True, "buffered": False}


# --- aiokafka_partition_state ---------------------------------------------------------------------


def test_aiokafka_partition_state_reads_a_real_consumer() -> None:
    async def run() -> dict[str, Any]:
        kafka = AIOKafkaConsumer(bootstrap_servers=NOWHERE)
        tp = TopicPartition("t", 0)
        kafka.assign([tp])
        kafka.pause(tp)
        # What start() builds after connecting: the fetcher over the consumer's subscription.
        assert "self._fetcher = Fetcher(" in inspect.getsource(AIOKafkaConsumer.start)
        kafka._fetcher = Fetcher(kafka._client, kafka._subscription)
        try:
            kafka.seek(tp, 5)
            return seams.aiokafka_partition_state(kafka, SimpleNamespace(topic="t", partition=0))
        finally:
            await kafka._fetcher.close()
            await kafka.stop()

    assert asyncio.run(run()) == {"paused": True, "position": 5, "buffered_fetch": False}


# --- faust_committed_offsets ----------------------------------------------------------------------


def test_faust_committed_offsets_is_what_faust_records_at_commit(app: faust.App) -> None:
    consumer = app.consumer
    tp = TP("t", 0)
    committed: list[Any] = []

    async def commit(offsets: Any) -> bool:  # the broker round trip
        committed.append(dict(offsets))
        return True

    async def flush() -> None:
        pass

    async def run() -> None:
        consumer.assignment = lambda: {tp}
        consumer._commit = commit
        app.producer.flush = flush
        assert await consumer._commit_offsets({tp: 42})

    asyncio.run(run())
    assert committed == [{tp: 42}]
    assert seams.faust_committed_offsets(consumer)[tp] == 42
    assert seams.faust_committed_offsets(object()) == {}


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


def test_offset_commits_are_sent_as_v3_with_the_generation_of_a_group_member() -> None:
    """The handler aiokafka's sender looks up by name builds TxnOffsetCommit v3
    with the generation and member id of a GroupMember group id, and a refused
    generation makes the transaction abortable (not the producer fatal)."""
    from aiokafka.producer import sender as aiokafka_sender
    from aiokafka.producer.transaction_manager import TransactionManager, TransactionState
    from aiokafka.structs import OffsetAndMetadata

    from app.group_fencing import GenerationFenced, GroupMember, TxnOffsetCommitRequest_v3, TxnOffsetCommitResponse_v3

    seams.install_group_fenced_offset_commits()
    assert "TxnOffsetCommitHandler(self" in inspect.getsource(aiokafka_sender.Sender._do_txn_offset_commit)

    async def scenario() -> tuple[Any, Any, BaseException | None, set[Any]]:
        txn = TransactionManager("t-id", 10_000)
        txn.set_pid_and_epoch(7, 3)
        txn.begin_transaction()
        tp = TopicPartition("transactions", 0)
        txn.maybe_add_partition_to_txn(TopicPartition("decisions", 1))
        txn.partition_added(TopicPartition("decisions", 1))
        group = GroupMember("g", 5, "member-1")
        fut = txn.add_offsets_to_txn({tp: OffsetAndMetadata(12, "")}, group)
        txn.consumer_group_added(group)
        sender = SimpleNamespace(_txn_manager=txn, _retry_backoff=0.01)
        handler = aiokafka_sender.TxnOffsetCommitHandler(sender, {tp: OffsetAndMetadata(12, "")}, group)
        wire = handler.create_request().build(TxnOffsetCommitRequest_v3)
        refused = TxnOffsetCommitResponse_v3(0, [("transactions", [(0, 22, {})], {})], {})
        assert handler.handle_response(refused) is None
        error = fut.exception()
        return wire, txn.state, error, set(txn.txn_partitions)

    wire, state, error, partitions = asyncio.run(scenario())
    assert (wire.generation_id, wire.member_id, wire.group_id) == (5, "member-1", "g")
    assert wire.topics == [("transactions", [(0, 12, -1, "", {})], {})]
    assert state == TransactionState.ABORTABLE_ERROR
    assert isinstance(error, GenerationFenced)
    # What the transaction touched is kept, so that its abort reaches the broker.
    assert partitions == {TopicPartition("decisions", 1)}


def test_group_membership_reads_aiokafka_s_coordinator() -> None:
    from aiokafka.consumer.group_coordinator import GroupCoordinator

    init = inspect.getsource(GroupCoordinator.__init__)
    assert "self.generation" in init and "self.member_id" in init
    assert "async def _send_req" in inspect.getsource(GroupCoordinator)
    consumer = SimpleNamespace(_coordinator=SimpleNamespace(generation=4, member_id="m-4"))
    app = SimpleNamespace(consumer=SimpleNamespace(_thread=SimpleNamespace(_ensure_consumer=lambda: consumer)))
    assert seams.group_membership(app) == (4, "m-4")
