"""Every reach into faust's and aiokafka's private internals, in one place.

Each seam names the upstream code it depends on and why the public API does not
suffice; tests/unit/app/test_seams.py holds a canary per seam that fails when an
upgrade makes the seam a silent no-op or breaks it. The versions are pinned
exactly in pyproject.toml for the same reason (faust-streaming 0.15.3,
aiokafka 0.14.0, mode-streaming 0.7.1).

The seams:

- :func:`install_read_committed`: patches faust's
  ``AIOKafkaConsumerThread._create_worker_consumer`` to set aiokafka's
  ``AIOKafkaConsumer._isolation_level`` (workers read committed data only).
- :func:`install_wait_topic_visible`: patches faust's
  ``Transport._really_create_topic`` to return once every broker knows the
  topic it created (on a cluster, the worker subscribes to it right after).
- :func:`install_commit_past_gaps`: patches faust's ``Consumer._add_gap`` and
  ``Consumer._new_offset`` so offsets the consumer never sees (transaction
  markers, aborted records) do not hold its commits back.
- :func:`install_flush_drains_buffer`: patches faust's
  ``ProducerBuffer.flush`` and ``_send_pending`` so that the flush before a
  commit waits for every table write still in faust's own buffer.
- :func:`install_resume_keeps_queues`: patches mode's
  ``FlowControlEvent.resume`` so that resuming a flow already active keeps
  what the streams' queues hold.
- :func:`cluster_metadata`: aiokafka's ``AIOKafkaConsumer._client`` and
  ``AIOKafkaClient.fetch_all_metadata`` (partition counts of any topic).
- :func:`admin_request`: aiokafka's ``AIOKafkaAdminClient._send_request``
  (CreateAcls has a request class but no public admin method).
- :func:`send_raw`: faust's transport ``Producer.send``, called with its six
  positional parameters (public, but positional: a reordering would swap
  fields silently).

The scoring path (app/eos.py) runs on librdkafka's public API and needs none.
faust is imported inside the seams that need it, never at module level: the
gateway and the tools import this module (through app/topics.py) and do not
otherwise load faust.
"""

from __future__ import annotations

from collections.abc import Awaitable
from typing import Any

__all__ = [
    "admin_request", "cluster_metadata", "install_commit_past_gaps", "install_flush_drains_buffer",
    "install_read_committed", "install_resume_keeps_queues", "install_wait_topic_visible", "send_raw",
]  # fmt: skip


# --- the worker consumer's isolation level --------------------------------------------------------


def install_read_committed() -> None:
    """Make faust's worker consumer read with ``isolation_level=read_committed``.

    Upstream: faust-streaming 0.15.3, ``faust.transport.drivers.aiokafka.
    AIOKafkaConsumerThread._create_worker_consumer`` (called by its
    ``_create_consumer`` from ``on_start``), and aiokafka 0.14.0
    ``AIOKafkaConsumer._isolation_level`` (handed to its ``Fetcher`` in
    ``start()``).

    NOTE: faust reads committed data only in its own exactly-once mode
    (``processing_guarantee="exactly_once"``, which this project does not use:
    the scoring path commits its own transactions, app/eos.py), and offers no
    setting for the isolation level. faust's consumer reads ``labels`` for the
    merchant tally, and a producer of labels may write in transactions: an
    aborted transaction's records must stay invisible to the tally. The
    consumer is built before it starts, and aiokafka hands
    ``_isolation_level`` to its fetcher at start, so setting it on the new
    consumer is enough.
    """
    from faust.transport.drivers import aiokafka as faust_aiokafka

    thread_cls = faust_aiokafka.AIOKafkaConsumerThread
    original = thread_cls._create_worker_consumer
    if getattr(original, "_fraud_patched", False):
        return

    def _create_worker_consumer(self: Any, transport: Any) -> Any:
        consumer = original(self, transport)
        consumer._isolation_level = "read_committed"
        return consumer

    _create_worker_consumer._fraud_patched = True  # type: ignore[attr-defined]
    thread_cls._create_worker_consumer = _create_worker_consumer  # type: ignore[method-assign]


# --- faust's own topics, visible before it subscribes to them --------------------------------------

#: How long a created topic may take to reach every broker's metadata before
#: faust goes on anyway (KRaft brokers apply the controller's record in
#: milliseconds to a few hundred; a loaded 2-core machine is the slow case).
TOPIC_VISIBLE_WAIT_S = 15.0


def install_wait_topic_visible() -> None:
    """Make faust's topic creation return only once every broker has the topic.

    Upstream: faust-streaming 0.15.3, ``faust.transport.drivers.aiokafka.
    Transport._really_create_topic`` (behind ``Transport.create_topic``, which
    declares the changelog, repartition and assignor topics at start).

    NOTE: on a KRaft cluster CreateTopics answers once the controller has the
    topic; each broker learns it a moment later. faust subscribes to the
    topics it just declared, and a consumer whose metadata came from a broker
    that did not know one yet ignores it in the assignment ("Ignoring missing
    topic"): a worker on the 3-node stack then never got its changelog
    partitions and never became ready (measured: no progress in 180 s). On
    one broker the answer and the metadata come from the same node.
    """
    import asyncio
    import time

    from aiokafka.protocol.metadata import MetadataRequest
    from faust.transport.drivers import aiokafka as faust_aiokafka

    transport_cls = faust_aiokafka.Transport
    original = transport_cls._really_create_topic
    if getattr(original, "_fraud_patched", False):
        return

    async def _really_create_topic(self: Any, owner: Any, client: Any, topic: str, *args: Any, **kwargs: Any) -> None:
        await original(self, owner, client, topic, *args, **kwargs)
        deadline = time.monotonic() + TOPIC_VISIBLE_WAIT_S
        nodes = [broker.nodeId for broker in client.cluster.brokers()]
        while nodes and time.monotonic() < deadline:
            missing = []
            for node in nodes:
                try:
                    response = await client.send(node, MetadataRequest([topic]))
                    known = any(t[1] == topic and t[0] == 0 for t in response.topics)
                except Exception:  # a broker that cannot answer now: asked again
                    known = False
                if not known:
                    missing.append(node)
            nodes = missing
            if nodes:
                await asyncio.sleep(0.05)
        if nodes:
            owner.log.warning("topic %r not yet known to brokers %s", topic, nodes)

    _really_create_topic._fraud_patched = True  # type: ignore[attr-defined]
    transport_cls._really_create_topic = _really_create_topic  # type: ignore[method-assign]


# --- faust's offset commits past transaction markers ----------------------------------------------


def install_commit_past_gaps() -> None:
    """Let faust's consumer commit past the offsets it never receives.

    Upstream: faust-streaming 0.15.3, ``faust.transport.consumer.Consumer``:
    ``_drain_messages`` calls ``_add_gap(tp, last_read + 1, offset)`` when a
    message's offset jumps, and ``_new_offset`` commits the first run of
    consecutive offsets among the acked ones and those gaps.

    NOTE: a topic written in Kafka transactions (``labels`` from a
    transactional producer; ``feedback``, which faust read before the feedback
    loop moved to app/at_least_once.py) has a commit marker after each
    transaction's records in every partition, and aborted records a
    ``read_committed`` consumer skips: the offsets a consumer receives jump by
    one or more. Two faults upstream (faust-streaming #606 is the open report
    of wrong commits around gaps):

    - ``_add_gap`` records ``[from, to]`` inclusive, so the offset of the
      message just read sits in the gap and, once acked, in the acked list
      too; the duplicate ends the run of consecutive offsets there. Each
      commit then moved a partition past about one transaction: after a
      demo-like run of 1,200 decisions the feedback group had committed 101
      of ``feedback``'s 2,399 offsets, everything processed. Here the gap is
      ``[from, to)``: only the offsets skipped.
    - a jump right after offset 0 records no gap at all (the last read offset
      0 is taken for "none"), and ``_new_offset`` returns None for good once
      the lowest acked offset is more than one past the committed one. Here
      ``_new_offset`` first fills ``[committed, lowest acked)`` as a gap when
      no message below the lowest acked offset is delivered and unacked: the
      consumer receives a partition's messages in offset order, so those
      offsets were skipped, or processed and acked already.
    """
    import asyncio

    from faust.transport import consumer as faust_consumer

    consumer_cls = faust_consumer.Consumer
    original_new_offset = consumer_cls._new_offset
    if getattr(original_new_offset, "_fraud_patched", False):
        return

    async def _add_gap(self: Any, tp: Any, offset_from: int, offset_to: int) -> None:
        committed = self._committed_offset[tp]
        if committed is not None:
            offset_from = max(offset_from, committed + 1)
        if offset_from < offset_to:  # offset_to is the message just read: not a gap
            gap_for_tp = self._gap[tp]
            gap_for_tp.addi(offset_from, offset_to)
            await asyncio.sleep(0)  # as upstream: the loop answers health checks meanwhile
            gap_for_tp.merge_overlaps()

    def _new_offset(self: Any, tp: Any) -> int | None:
        acked = self._acked[tp]
        committed = self._committed_offset[tp]
        if acked and committed is not None:
            lowest = min(acked)
            if lowest - committed > 1 and not any(
                m.tp == tp and m.offset < lowest and not m.acked for m in list(self._unacked_messages)
            ):
                gap_for_tp = self._gap[tp]
                gap_for_tp.addi(committed, lowest)
                gap_for_tp.merge_overlaps()
        result: int | None = original_new_offset(self, tp)
        return result

    _new_offset._fraud_patched = True  # type: ignore[attr-defined]
    consumer_cls._add_gap = _add_gap  # type: ignore[method-assign]
    consumer_cls._new_offset = _new_offset  # type: ignore[method-assign]


# --- the producer buffer's flush before a commit -------------------------------------------------


def install_flush_drains_buffer() -> None:
    """Make faust's flush before a commit wait for every buffered table write.

    Upstream: faust-streaming 0.15.3, ``faust.transport.producer.ProducerBuffer``:
    a table's changelog writes go to it (``Table.send_changelog`` calls
    ``send_soon``), and its ``_handle_pending`` task takes each one off the
    queue and awaits ``_send_pending`` (aiokafka's ``send``) for it. Before
    committing a source's offsets, ``Consumer._commit_offsets`` awaits
    ``Producer.flush``: ``ProducerBuffer.flush``, then aiokafka's own flush
    (which waits for what aiokafka holds to be acknowledged).

    NOTE: two faults upstream made that flush return with writes unsent, and
    the commit then covered the labels whose counts they held:

    - ``flush`` (``flush_atmost(None)``) returns as soon as 0.1 s pass with
      no message sent. While a partition's leader is lost, aiokafka's
      ``send`` waits for room in that partition's batch, which a write of the
      merchant tally (its recent verdicts, kilobytes) fills at once, for
      seconds; the writes queued behind it stayed in faust's buffer.
    - the buffer's ``size`` counts the queue only: the write being handed to
      aiokafka has left the queue and is in neither.

    A worker stopped then would lose those writes with their labels'
    offsets committed. (The merchant tally short of a few labels after a
    broker loss and a restart, RELIABILITY.md known gap 6, has another
    cause: those labels were never forwarded at all.) Here the flush waits
    while the queue holds a write or one is being handed over, for as long as
    the broker takes (a commit that waits is retried work, never lost work);
    once the buffer is not running (stopping, or its sending task crashed) it
    raises as upstream's does while writes are queued, so the commit fails
    rather than skips them.
    """
    import asyncio

    from faust.transport.producer import ProducerBuffer

    original_send = ProducerBuffer._send_pending
    if getattr(original_send, "_fraud_patched", False):
        return

    async def _send_pending(self: Any, fut: Any) -> None:
        self._fraud_handing_over = True
        try:
            await original_send(self, fut)
        finally:
            self._fraud_handing_over = False

    async def flush(self: Any) -> None:
        while self.size or getattr(self, "_fraud_handing_over", False):
            if self.state != "running":  # stopping or crashed: as upstream's
                if self.size:
                    raise RuntimeError("Cannot flush: Producer not Running")
                return
            self.message_sent.clear()
            try:
                await asyncio.wait_for(self.message_sent.wait(), timeout=0.1)
            except TimeoutError:
                continue  # a send waits on the broker: keep waiting (the commit waits with it)

    _send_pending._fraud_patched = True  # type: ignore[attr-defined]
    ProducerBuffer._send_pending = _send_pending  # type: ignore[method-assign]
    ProducerBuffer.flush = flush  # type: ignore[method-assign]


# --- flow control resumed twice -----------------------------------------------------------------


def install_resume_keeps_queues() -> None:
    """Resuming faust's flow control while it is active leaves the streams' queues alone.

    Upstream: mode-streaming 0.7.1, ``mode.utils.queues.FlowControlEvent.resume``
    empties every queue it manages each time it is called; faust-streaming
    0.15.3's channels are such queues (``clear_on_resume=True``), and its
    ``Recovery`` resumes ``app.flow_control`` when it starts restoring tables
    and again in ``on_recovery_completed``, after seeking the stream
    partitions to their committed offsets.

    NOTE: between the two calls the consumer already delivers the stream
    partitions' records, and the streams process them; the second call emptied
    whatever was still queued. Those records were not delivered again: the
    seek had reset the consumer's read offsets to the committed ones, but the
    drain of the batch fetched before it moved them on past the records
    emptied, and the same records fetched again from the committed offset
    were dropped as read already. The commits then stepped over them (upstream
    ``Consumer._new_offset`` lets a run begin one past the committed offset,
    and the gap fill of :func:`install_commit_past_gaps` takes offsets never
    delivered for skipped): a restarted worker's merchant tally never counted
    a few labels (RELIABILITY.md, known gap 6; a trace of the consumer showed
    offsets 72 and 73 handed to the drain and never reaching the stream).
    Here a resume empties the queues only when the flow was suspended (a
    rebalance: what was queued belongs to the old assignment, and is fetched
    again after the seek), as upstream does.
    """
    from mode.utils.queues import FlowControlEvent

    original = FlowControlEvent.resume
    if getattr(original, "_fraud_patched", False):
        return

    def resume(self: Any) -> None:
        if self.is_active():
            return  # already resumed: what the queues hold is this assignment's, not yet processed
        original(self)

    resume._fraud_patched = True  # type: ignore[attr-defined]
    FlowControlEvent.resume = resume  # type: ignore[method-assign]


# --- metadata -------------------------------------------------------------------------------------


async def cluster_metadata(consumer: Any) -> Any:
    """Metadata of every topic of the cluster (a ``ClusterMetadata``).

    Upstream: aiokafka 0.14.0, ``AIOKafkaConsumer._client`` (its
    ``AIOKafkaClient``) and ``AIOKafkaClient.fetch_all_metadata``.

    NOTE: a consumer without a subscription tracks no topics, so its public
    ``partitions_for_topic`` stays None until it is assigned partitions, which
    needs their numbers first. tests/integration/test_gateway.py and
    test_autoscale_broker.py fail too if this stops working.
    """
    return await consumer._client.fetch_all_metadata()


# --- producing ------------------------------------------------------------------------------------


async def admin_request(admin: Any, request: Any) -> Any:
    """Send a request the admin client has no public method for (CreateAcls).

    Upstream: aiokafka 0.14.0, ``aiokafka.admin.AIOKafkaAdminClient._send_request``
    (the helper every public admin method uses: picks a broker, sends, returns
    the response). aiokafka has ``CreateAclsRequest`` in its protocol but no
    ``create_acls``; the secure local stack needs it to apply its ACL table.
    """
    response = await admin._send_request(request)
    return response


async def send_raw(producer: Any, topic: str, key: bytes | None, value: bytes) -> Awaitable[Any]:
    """Hand one record to faust's transport producer, to be partitioned by key;
    returns its delivery future (``RecordMetadata``).

    Upstream: faust-streaming 0.15.3, ``faust.transport.drivers.aiokafka.
    Producer.send(topic, key, value, partition, timestamp, headers, *, transactional_id)``.

    NOTE: public, but every parameter but ``transactional_id`` is positional
    and required: a reordering upstream would swap key and value silently.
    ``Topic.send`` would be the documented path; app/produce.py says why it is
    bypassed.
    """
    result: Awaitable[Any] = await producer.send(topic, key, value, None, None, None)
    return result
