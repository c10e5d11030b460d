"""Every reach into faust's, mode's and aiokafka's private internals, in one place.

Each seam names the upstream code it depends on and why the public API does not
suffice; tests/unit/test_seams.py holds a canary per seam that fails when an
upgrade makes the seam a silent no-op or breaks it. The versions are pinned
exactly in pyproject.toml for the same reason (faust-streaming 0.15.3,
aiokafka 0.14.0, mode-streaming 0.7.1).

The seams:

- :func:`install_read_committed`: patches faust's
  ``AIOKafkaConsumerThread._create_worker_consumer`` to set aiokafka's
  ``AIOKafkaConsumer._isolation_level`` (workers read committed data only).
- :func:`untrack_read_offsets` (with :class:`ReadOffsets`): wraps faust's
  ``App._new_consumer`` to replace ``Consumer._read_offset``, the map faust's
  fetch loop (``Consumer._drain_messages``) drops records by.
- :func:`worker_consumer` and :func:`on_consumer_thread`: the aiokafka consumer
  behind faust's (``ThreadDelegateConsumer._thread``,
  ``AIOKafkaConsumerThread._ensure_consumer``), and mode's
  ``QueueServiceThread.call_thread`` to run code on that consumer's thread.
- :func:`consumer_flowing`: faust's undocumented ``Consumer.flow_active`` and
  ``App.rebalancing`` flags.
- :func:`faust_partition_flags`: faust's ``Consumer._active_partitions``,
  ``_paused_partitions`` and ``_buffered_partitions`` (stall diagnostics).
- :func:`aiokafka_partition_state`: aiokafka's ``AIOKafkaConsumer._subscription``
  (per-partition fetch state) and ``_fetcher._records`` (stall diagnostics).
- :func:`faust_committed_offsets`: faust's ``Consumer._committed_offset``
  (the lag metric's fallback when faust commits).
- :func:`cluster_metadata`: aiokafka's ``AIOKafkaConsumer._client`` and
  ``AIOKafkaClient.fetch_all_metadata`` (partition counts of any topic).
- :func:`admin_request`: aiokafka's ``AIOKafkaAdminClient._send_request``
  (CreateAcls has a request class but no public admin method).
- :func:`install_group_fenced_offset_commits`: replaces aiokafka's
  ``producer.sender.TxnOffsetCommitHandler`` (TxnOffsetCommit v3 with the
  group generation, KIP-447) and wraps ``TransactionManager.error_transaction``
  (so that an abort after an abortable error reaches the broker).
- :func:`group_membership` and :func:`fetch_stable_offsets`: aiokafka's
  ``AIOKafkaConsumer._coordinator`` (generation, member id, and requests to the
  group coordinator: OffsetFetch with ``require_stable``).
- :func:`send_raw`: faust's transport ``Producer.send``, called with its six
  positional parameters (public, but positional: a reordering would swap
  fields silently).

faust is imported inside the seams that need it, never at module level: the
gateway and the tools import this module (through app/topics.py) and do not
otherwise load faust.
"""

from __future__ import annotations

import asyncio
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, TypeVar

from aiokafka.structs import TopicPartition

from app import group_fencing

__all__ = [
    "ReadOffsets",
    "admin_request",
    "aiokafka_partition_state",
    "cluster_metadata",
    "consumer_flowing",
    "faust_committed_offsets",
    "faust_partition_flags",
    "fetch_stable_offsets",
    "group_membership",
    "install_group_fenced_offset_commits",
    "install_read_committed",
    "on_consumer_thread",
    "send_raw",
    "untrack_read_offsets",
    "worker_consumer",
]

T = TypeVar("T")


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
    app/transactional.py says why), and offers no setting for the isolation
    level. Everything the scoring agent writes is transactional, and the
    feedback loop's agents read ``feedback`` from the same consumer: an aborted
    batch's records must stay invisible to them. The consumer is built before
    it starts, and aiokafka hands ``_isolation_level`` to its fetcher at start,
    so setting it on the new consumer is enough.
    tests/integration/test_exactly_once.py checks it end to end.
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


# --- faust's per-partition read offsets -----------------------------------------------------------


class ReadOffsets(defaultdict):  # type: ignore[type-arg]
    """faust's per-partition "read up to here" map, blind to one topic.

    faust drops a fetched record whose offset is below the last one it
    delivered for the partition. After a seek back, records fetched before the
    seek (later offsets) arrive first, so faust dropped every re-read record up
    to them: the rewind never took (measured: 6 s of failed seeks, then loss).
    The scoring agent orders and de-duplicates `transactions` itself
    (app/offsets.py), so for that topic faust is told it has read nothing and
    delivers everything.
    """

    def __init__(self, topic: str) -> None:
        super().__init__(lambda: None)
        self.topic = topic

    def __getitem__(self, tp: Any) -> Any:
        if tp.topic == self.topic:
            return None
        return super().__getitem__(tp)

    def __setitem__(self, tp: Any, offset: Any) -> None:
        if tp.topic != self.topic:
            super().__setitem__(tp, offset)


def untrack_read_offsets(app: Any, topic: str) -> None:
    """Make the consumer faust builds for ``app`` deliver every record of ``topic``
    (see :class:`ReadOffsets`).

    Upstream: faust-streaming 0.15.3, ``faust.app.base.App._new_consumer``
    (what the ``App.consumer`` property calls to build its consumer) and
    ``faust.transport.consumer.Consumer._read_offset`` (a ``defaultdict``
    whose ``__getitem__``/``__setitem__`` ``Consumer._drain_messages`` binds
    once, when its fetch loop starts).

    NOTE: faust has no option to deliver records below the read offset; the
    drop is inline in ``_drain_messages``. The map is replaced as the consumer
    is built, before its fetch loop can bind the original.
    """
    build = app._new_consumer

    def _new_consumer() -> Any:
        consumer = build()
        consumer._read_offset = ReadOffsets(topic)
        return consumer

    app._new_consumer = _new_consumer


# --- the aiokafka consumer behind faust's ---------------------------------------------------------


def worker_consumer(app: Any) -> Any:
    """The aiokafka consumer faust's consumer delegates to; raises faust's
    ``ConsumerNotStarted`` before it starts.

    Upstream: faust-streaming 0.15.3, ``faust.transport.consumer.
    ThreadDelegateConsumer._thread`` (the ``AIOKafkaConsumerThread``) and
    ``faust.transport.drivers.aiokafka.AIOKafkaConsumerThread._ensure_consumer``.

    NOTE: faust exposes no committed-offset read for a partition, nor the
    aiokafka consumer itself. Its I/O must run on the consumer's own thread
    (:func:`on_consumer_thread`); the reads of its state for diagnostics
    (:func:`aiokafka_partition_state`) are from the caller's thread.
    """
    return app.consumer._thread._ensure_consumer()


async def on_consumer_thread(app: Any, fn: Callable[[Any], Awaitable[T]]) -> T:
    """Await ``fn(consumer)`` on the thread (and event loop) of the aiokafka
    consumer behind ``app.consumer``, as faust's own calls to it are made.

    Upstream: mode-streaming 0.7.1, ``mode.threads.QueueServiceThread.call_thread``
    (inherited by faust's ``AIOKafkaConsumerThread``), plus :func:`worker_consumer`.

    NOTE: the aiokafka consumer belongs to that thread's loop; awaiting its
    coroutines from the agent's loop is not safe. The consumer is looked up
    first, so an unstarted one raises before anything is queued.
    """
    thread = app.consumer._thread
    consumer = worker_consumer(app)
    result: T = await thread.call_thread(fn, consumer)
    return result


def consumer_flowing(app: Any) -> bool:
    """Not in a rebalance or recovery: faust pauses and resumes partitions then.

    Upstream: faust-streaming 0.15.3, ``faust.transport.consumer.Consumer.flow_active``
    (cleared by ``stop_flow()``, set by ``resume_flow()``) and
    ``faust.app.base.App.rebalancing`` (declared on ``AppT``), neither documented.

    NOTE: faust offers no public "is the consumer flowing" query. Missing
    attributes read as flowing, as before this seam existed: the watchdog must
    keep working, and the canary test catches a rename.
    """
    return bool(getattr(app.consumer, "flow_active", True)) and not getattr(app, "rebalancing", False)


# --- stall diagnostics ----------------------------------------------------------------------------


def faust_partition_flags(consumer: Any, tp: Any) -> dict[str, bool]:
    """Whether faust's fetcher asks for ``tp`` (active), has it paused, or has
    taken it out because its stream buffer is full (buffered).

    Upstream: faust-streaming 0.15.3, ``faust.transport.consumer.Consumer.
    _active_partitions`` (None until first computed), ``_paused_partitions``
    and ``_buffered_partitions``.

    NOTE: faust has no public view of these sets; they are what decides which
    partitions its fetcher requests from aiokafka. Diagnostics only: callers
    must not let a failure here stop them.
    """
    return {
        "active": tp in (consumer._active_partitions or ()),
        "paused": tp in consumer._paused_partitions,
        "buffered": tp in consumer._buffered_partitions,
    }


def aiokafka_partition_state(kafka: Any, tp: Any) -> dict[str, Any]:
    """aiokafka's own view of ``tp``: paused, fetch position (None when it has
    none) and whether fetched records wait in its buffer.

    Upstream: aiokafka 0.14.0, ``AIOKafkaConsumer._subscription`` (a
    ``SubscriptionState``: ``.subscription.assignment.state_value(tp)``, a
    ``TopicPartitionState`` with ``paused``, ``has_valid_position``,
    ``position``) and ``AIOKafkaConsumer._fetcher._records`` (the ``Fetcher``'s
    buffer, created in ``start()``).

    NOTE: the public ``position()`` does not fit: it is a coroutine, to be run
    on the consumer's own thread, that waits up to the request timeout for a
    partition without a position; a diagnostic needs the state as it is, at
    once. Nothing public tells whether fetched records are buffered.
    Diagnostics only: callers must not let a failure here stop them.
    """
    part = TopicPartition(tp.topic, tp.partition)
    state = kafka._subscription.subscription.assignment.state_value(part)
    return {
        "paused": state.paused,
        "position": state.position if state.has_valid_position else None,
        "buffered_fetch": part in kafka._fetcher._records,
    }


# --- metrics --------------------------------------------------------------------------------------


def faust_committed_offsets(consumer: Any) -> Mapping[Any, int | None]:
    """The offsets faust last committed per partition (Kafka semantics: the next
    to read); empty when the consumer has no such record.

    Upstream: faust-streaming 0.15.3, ``faust.transport.consumer.Consumer.
    _committed_offset`` (updated by ``perform_seek`` and after each commit).

    NOTE: the public ``Consumer.committed`` path asks the broker, a round trip
    per scrape. Never raises: a scrape must not fail on it.
    """
    committed: Mapping[Any, int | None] = getattr(consumer, "_committed_offset", {})
    return committed


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


# --- the group-generation fence of transactional offsets (KIP-447) ------------------------------


def install_group_fenced_offset_commits() -> None:
    """Make aiokafka's transactional producers send their offsets as
    TxnOffsetCommit v3, with the group generation and member id of a
    :class:`app.group_fencing.GroupMember` group id, and treat the group
    coordinator's refusal as the end of the transaction, not of the producer.

    Upstream: aiokafka 0.14.0, ``aiokafka.producer.sender.TxnOffsetCommitHandler``
    (looked up by name in ``Sender._do_txn_offset_commit``), its
    ``create_request`` / ``handle_response``, the sender's ``_txn_manager``
    (``transactional_id``, ``producer_id``, ``producer_epoch``,
    ``error_transaction``).

    NOTE: aiokafka builds TxnOffsetCommit v0 only (no generation: no fence but
    the transactional id), and any error code it does not know stops the
    producer's sender for good. A generation the group has left
    (``ILLEGAL_GENERATION``, ``UNKNOWN_MEMBER_ID``, ``FENCED_INSTANCE_ID``) is
    what Kafka's own client reports as an abortable ``CommitFailedException``:
    here the transaction's offsets future fails with
    :class:`app.group_fencing.GenerationFenced` and the producer can abort and go on.
    tests/unit/test_seams.py and tests/integration/test_exactly_once.py fail if
    this stops working.
    """
    from aiokafka.producer import sender as aiokafka_sender

    _keep_aborted_transactions_abortable()
    original = aiokafka_sender.TxnOffsetCommitHandler
    if getattr(original, "_fraud_patched", False):
        return

    class GroupFencedTxnOffsetCommitHandler(original):  # type: ignore[valid-type,misc]
        _fraud_patched = True

        def create_request(self) -> Any:
            txn = self._sender._txn_manager
            topics: dict[str, list[tuple[int, int, str]]] = {}
            for tp, offset in sorted(self._offsets.items()):
                topics.setdefault(tp.topic, []).append((tp.partition, offset.offset, offset.metadata))
            return group_fencing.TxnOffsetCommitV3Request(
                transactional_id=txn.transactional_id,
                group_id=self._group_id,
                producer_id=txn.producer_id,
                producer_epoch=txn.producer_epoch,
                topics=list(topics.items()),
            )

        def handle_response(self, resp: Any) -> Any:
            errors = group_fencing.txn_offset_commit_errors(resp)
            codes = {code for _topic, parts in errors for _p, code in parts}
            if codes & group_fencing.GENERATION_FENCE_ERRORS:
                self._sender._txn_manager.error_transaction(
                    group_fencing.GenerationFenced(
                        f"group {self._group_id!r} refused the offsets (error codes {sorted(codes)})"
                    )
                )
                return None
            if group_fencing.CONCURRENT_TRANSACTIONS in codes:
                return self._default_backoff  # asked again after the backoff
            return super().handle_response(_Errors(errors))

    aiokafka_sender.TxnOffsetCommitHandler = GroupFencedTxnOffsetCommitHandler


def _keep_aborted_transactions_abortable() -> None:
    """Make aiokafka's abort after an abortable error reach the broker.

    Upstream: aiokafka 0.14.0, ``aiokafka.producer.transaction_manager.
    TransactionManager.error_transaction`` (its ``_txn_partitions``,
    ``_txn_consumer_group`` and ``_transaction_waiter``), and
    ``Sender._do_txn_commit``, which sends no EndTxn for a transaction
    ``is_empty_transaction()`` says touched nothing.

    NOTE: ``error_transaction`` forgets the partitions and the group the
    transaction already added. The abort that must follow then ends the
    transaction on the client only: on the broker it stays open, and the
    producer's next transaction continues it, so its commit also commits the
    records of the batch that was meant to be aborted (seen on Kafka 3.9 with a
    refused generation: the old generation's decision became visible). Keeping
    them makes the abort send EndTxn(ABORT). The failed waiter's exception is
    marked retrieved: the caller already got it from the call that failed.
    """
    from aiokafka.producer.transaction_manager import TransactionManager

    original = TransactionManager.error_transaction
    if getattr(original, "_fraud_patched", False):
        return

    def error_transaction(self: Any, exc: BaseException) -> None:
        partitions, group = set(self._txn_partitions), self._txn_consumer_group
        original(self, exc)
        self._txn_partitions.update(partitions)
        self._txn_consumer_group = group
        if self._transaction_waiter.done():
            self._transaction_waiter.exception()

    error_transaction._fraud_patched = True  # type: ignore[attr-defined]
    TransactionManager.error_transaction = error_transaction


class _Errors:
    """The shape of aiokafka's v0 TxnOffsetCommit response its handler reads."""

    def __init__(self, errors: list[tuple[str, list[tuple[int, int]]]]) -> None:
        self.errors = errors


def group_membership(app: Any) -> tuple[int, str]:
    """(generation id, member id) of faust's consumer in its group, as of now.

    Upstream: aiokafka 0.14.0, ``AIOKafkaConsumer._coordinator``
    (``GroupCoordinator.generation`` and ``.member_id``, set when a join
    completes), through :func:`worker_consumer`.

    NOTE: read inside faust's ``on_partitions_assigned`` signal, which the
    consumer thread awaits before it does anything else with the group
    (faust's ``threadsafe_partitions_assigned``), so the values are the ones
    the assignment was made in. faust keeps the generation
    (``App.consumer_generation_id``) but not the member id.
    """
    coordinator = worker_consumer(app)._coordinator
    return int(coordinator.generation), str(coordinator.member_id)


async def fetch_stable_offsets(
    consumer: Any, group_id: str, partitions: list[TopicPartition], *, give_up_s: float
) -> dict[TopicPartition, int | None]:
    """The group's committed offsets of ``partitions`` (None: none committed),
    waiting while a transaction that holds offsets for one of them is open.
    Run on the consumer's thread (:func:`on_consumer_thread`).

    Upstream: aiokafka 0.14.0, ``AIOKafkaConsumer._coordinator`` and its
    ``ensure_coordinator_known()``, ``coordinator_dead()`` and ``_send_req``
    (sends a request to the group coordinator).

    NOTE: aiokafka's ``committed()`` sends OffsetFetch without
    ``require_stable`` and answers the offset before an open transaction's.
    A new owner that started there would decide again what the previous
    owner's transaction is about to commit.
    """
    from aiokafka import errors as kafka_errors

    coordinator = consumer._coordinator
    deadline = time.monotonic() + give_up_s
    while True:
        await coordinator.ensure_coordinator_known()
        request = group_fencing.StableOffsetFetchRequest(group_id, [(tp.topic, tp.partition) for tp in partitions])
        try:
            response = await coordinator._send_req(request)
        except kafka_errors.KafkaError as exc:
            if not exc.retriable or time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.05)
            continue
        offsets, errors = group_fencing.stable_offsets(response)
        if not errors:
            return {TopicPartition(t, p): o for (t, p), o in offsets.items()}
        codes = set(errors.values())
        error_type = kafka_errors.for_code(next(iter(codes - {group_fencing.UNSTABLE_OFFSET_COMMIT}), 0))
        if error_type is kafka_errors.NotCoordinatorForGroupError:
            coordinator.coordinator_dead()
        retriable = codes <= {group_fencing.UNSTABLE_OFFSET_COMMIT} or getattr(error_type, "retriable", False)
        if not retriable or time.monotonic() > deadline:
            raise kafka_errors.KafkaError(f"offsets of group {group_id!r} not readable: error codes {sorted(codes)}")
        await asyncio.sleep(0.05)
