"""The live confirmed-fraud tally per merchant, read by the rules of every batch.

Every scoring worker holds all of it, since any worker may score any merchant,
and keeps it current from a compacted topic of its own, ``<app_id>-merchant-tally``
(:class:`TallyReader`). The rules read it on the event loop, from memory.

Who writes what: labels are keyed by transaction id, so one merchant's labels
arrive on several partitions of ``labels``. The scoring workers share those
partitions in the group ``<app_id>-tally`` (:class:`TallyCounter`), and the
owner of a partition writes only that partition's share of each merchant
(key ``[merchant_id, partition]``, :class:`pipeline.labels.TallyView`): no
two workers ever write the same key, and a merchant's tally is the sum of its
shares. Before it counts a batch, the owner waits until its copy has read the
tally topic to its end, so it counts on top of its own last writes and those
of the partition's owner before it.

At least once, never skipped: a batch's offsets are stored only once the
broker has its shares (:mod:`app.at_least_once`). A batch read again (a
restart, a partition moved) counts once: each share remembers its last
labels' transaction ids (:class:`pipeline.labels.MerchantTally`).

NOTE: faust's stream and GlobalTable did this before, and faust's commit
bookkeeping stepped over labels it never handed to the agent and once held a
partition's commit back for good (RELIABILITY.md, known gap 6).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import orjson

from agents.watchdog import exit_on_failure
from app.at_least_once import AtLeastOnce
from app.errors import TallyError
from app.librdkafka import client_config
from app.retry import retry
from app.settings import Settings
from app.topics import ensure_topics
from pipeline.labels import Label, MerchantTally, TallyView, parse_label, parse_tally_key, tally_key, tally_writes

__all__ = [
    "LiveTally", "TallyCounter", "TallyProducer", "TallyReader", "tally_group", "tally_reader_group",
    "tally_topic", "tally_topic_spec",
]  # fmt: skip

log = logging.getLogger(__name__)

T = TypeVar("T")

#: Labels counted per batch, and how long a take waits for them.
BATCH = 500
WITHIN_S = 1.0
#: How long the reader's copy may go without reading a record while short of
#: an end it is asked for before the worker gives up on it (a reader that
#: cannot read: exits, restarted). NOTE: without progress, not in all: a
#: restore of a large tally takes as long as it takes, and a bound on the
#: whole of it would turn a big topic into a worker that never starts.
STALLED_AFTER_S = 120.0
#: How long a metadata or offsets request that fails is asked again: a topic
#: just created, not yet known to the broker asked, or a partition whose
#: leader was just lost ("Not leader for partition" until librdkafka's
#: metadata catches up, seen on the 3-broker stack). Past it the worker exits
#: to be restarted.
RETRY_FOR_S = 60.0


def tally_topic(settings: Settings) -> str:
    """The tally's compacted topic: one record per merchant and partition of ``labels``."""
    return f"{settings.app_id}-merchant-tally"


def tally_topic_spec(settings: Settings) -> tuple[dict[str, int], dict[str, dict[str, str]]]:
    """Its partitions and configuration, as :func:`app.topics.ensure_topics` takes them."""
    topic = tally_topic(settings)
    return {topic: settings.partitions}, {topic: {"cleanup.policy": "compact"}}


def tally_group(settings: Settings) -> str:
    """The consumer group in which the scoring workers share the partitions of ``labels``."""
    return f"{settings.app_id}-tally"


def tally_reader_group(settings: Settings) -> str:
    """The group id the tally's reader names (it joins no group; the client requires one)."""
    return f"{tally_group(settings)}-reader"


def _kafka() -> Any:
    import confluent_kafka

    return confluent_kafka


class TallyReader:
    """This worker's copy of the whole tally: the topic read from its first
    record, then followed, on a thread of its own."""

    def __init__(
        self, topic: str, config: dict[str, object], view: TallyView,
        consumer_factory: Callable[[dict[str, object]], Any] | None = None,
    ) -> None:  # fmt: skip
        self.topic, self.view = topic, view
        self._config: dict[str, object] = {
            **config, "enable.auto.commit": False, "auto.offset.reset": "earliest", "isolation.level": "read_committed",
        }  # fmt: skip
        self._factory = consumer_factory or (lambda c: _kafka().Consumer(c))
        self._consumer: Any = None
        self._partitions: list[int] = []
        self._positions: dict[int, int] = {}
        self._failed: BaseException | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.start_ends: dict[int, int] = {}

    async def start(self) -> None:
        """Assign every partition from its start and follow them; :attr:`start_ends`
        is where each partition ended when this began."""
        kafka = _kafka()
        self._consumer = await asyncio.to_thread(self._factory, self._config)
        self._partitions = await asked_again(lambda: asyncio.to_thread(self._partitions_now), self.topic)
        self.start_ends = await asked_again(lambda: asyncio.to_thread(self._ends), self.topic)
        tps = [kafka.TopicPartition(self.topic, p, kafka.OFFSET_BEGINNING) for p in self._partitions]
        await asyncio.to_thread(self._consumer.assign, tps)
        self._thread = threading.Thread(target=self._follow, name=f"tally-reader-{self.topic}", daemon=True)
        self._thread.start()

    def _partitions_now(self) -> list[int]:
        meta = self._consumer.list_topics(self.topic, 10.0).topics.get(self.topic)
        if meta is None or meta.error is not None or not meta.partitions:
            raise TallyError(f"{self.topic}: no partitions known yet")  # a topic just created
        return sorted(meta.partitions)

    def _ends(self) -> dict[int, int]:
        kafka = _kafka()
        tp = kafka.TopicPartition
        return {p: self._consumer.get_watermark_offsets(tp(self.topic, p), 10.0)[1] for p in self._partitions}

    def _follow(self) -> None:
        kafka = _kafka()
        tps = [kafka.TopicPartition(self.topic, p) for p in self._partitions]
        try:
            while not self._stop.is_set():
                for record in self._consumer.consume(1000, 0.1):
                    if record.error() is not None:
                        log.warning("tally reader: %s", record.error())
                        continue
                    self._apply(record.key(), record.value())
                for tp in self._consumer.position(tps):
                    if tp.offset >= 0:
                        self._positions[tp.partition] = tp.offset
        except BaseException as exc:  # handed to whoever waits on the copy (reached)
            self._failed = exc
            log.error("tally reader stopped: %r", exc)

    def _apply(self, key: bytes | None, value: bytes | None) -> None:
        share = parse_tally_key(key or b"")
        if share is None:
            log.warning("tally reader: a record with key %r is not a share; skipped", key)
            return
        try:
            tally = MerchantTally.from_json(orjson.loads(value)) if value is not None else None
        except (orjson.JSONDecodeError, TypeError, ValueError):
            log.warning("tally reader: the share %r is not a tally; skipped", key)
            return
        self.view.put(share[0], share[1], tally)

    async def reached(self, ends: dict[int, int]) -> None:
        """Return once this copy has read every partition up to ``ends``."""
        seen, moved = dict(self._positions), time.monotonic()
        while any(self._positions.get(p, 0) < end for p, end in ends.items()):
            if self._failed is not None:
                raise TallyError(f"{self.topic}: the reader stopped") from self._failed
            if self._positions != seen:
                seen, moved = dict(self._positions), time.monotonic()
            elif time.monotonic() - moved > STALLED_AFTER_S:
                raise TallyError(f"{self.topic}: no record read for {STALLED_AFTER_S:.0f} s short of {ends}: {seen}")
            await asyncio.sleep(0.01)

    async def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, 5.0)
        if self._consumer is not None:
            with contextlib.suppress(Exception):
                await asyncio.to_thread(self._consumer.close)
            self._consumer = None


class TallyProducer:
    """Writes shares to the tally topic; :meth:`write` returns once the broker has every one."""

    def __init__(
        self, topic: str, config: dict[str, object], producer_factory: Callable[[dict[str, object]], Any] | None = None
    ) -> None:
        self.topic = topic
        self._config: dict[str, object] = {**config, "enable.idempotence": True, "acks": "all", "linger.ms": 5}
        self._factory = producer_factory or (lambda c: _kafka().Producer(c))
        self._producer: Any = None
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"tally-producer-{topic}")

    async def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._thread, lambda: fn(*args))

    async def write(self, shares: dict[tuple[str, int], MerchantTally]) -> None:
        await self._call(self._write, shares)

    def _write(self, shares: dict[tuple[str, int], MerchantTally]) -> None:
        if self._producer is None:
            self._producer = self._factory(self._config)
        failed: list[Any] = []

        def delivered(error: Any, _message: Any) -> None:
            if error is not None:
                failed.append(error)

        for (merchant, part), tally in shares.items():
            self._producer.produce(self.topic, orjson.dumps(tally.to_json()), tally_key(merchant, part),
                                   on_delivery=delivered)  # fmt: skip
        # The idempotent producer retries until delivery.timeout.ms: a broker
        # lost meanwhile holds the batch here, its labels not marked counted.
        while self._producer.flush(1.0):
            pass
        if failed:
            raise TallyError(f"{self.topic}: {len(failed)} of {len(shares)} shares not written: {failed[0]}")

    async def close(self) -> None:
        if self._producer is not None:
            with contextlib.suppress(Exception):
                await self._call(self._producer.flush, 5.0)
        self._thread.shutdown(wait=False)


class TallyCounter:
    """Count a batch of labels of the partitions this worker owns in the tally
    group, write the shares it moved, then commit the batch's offsets."""

    def __init__(self, labels: AtLeastOnce, reader: TallyReader, producer: TallyProducer) -> None:
        self.labels, self.reader, self.producer = labels, reader, producer

    async def run(self) -> None:
        while True:
            await self.step()

    async def step(self) -> None:
        records = await self.labels.take(BATCH, WITHIN_S)
        if not records:
            return
        batch = _merchant_labels([(r.partition(), r.value()) for r in records])
        if batch:
            # On top of this worker's last writes, and of the partitions' owners' before it.
            ends = await asked_again(lambda: self.labels.ends(self.producer.topic), self.producer.topic)
            await self.reader.reached(ends)
            changed = tally_writes(self.reader.view, batch)
            if changed:
                await self.producer.write(changed)
        await self.labels.done(records)


async def asked_again(call: Callable[[], Awaitable[T]], topic: str) -> T:
    """``call()``, asked again while the broker answers with an error, for up to :data:`RETRY_FOR_S`."""

    def waiting(exc: Exception, sleep_s: float) -> None:
        log.warning("merchant tally: %s: %s; asked again in %.1f s", topic, exc, sleep_s)

    return await retry(call, first_s=0.2, cap_s=2.0, deadline=time.monotonic() + RETRY_FOR_S,
                       retry_on=(_kafka().KafkaException, TallyError), on_retry=waiting)  # fmt: skip


def _merchant_labels(records: Sequence[tuple[int, bytes | None]]) -> list[tuple[int, Label]]:
    """The labels with a merchant, by partition. The rest (malformed, no
    merchant) feed no tally; the feedback loop logs the malformed ones."""
    batch = []
    for part, raw in records:
        label = parse_label(raw) if raw is not None else None
        if isinstance(label, Label) and label.merchant_id is not None:
            batch.append((part, label))
    return batch


class LiveTally:
    """The tally of a scoring worker: its copy (:meth:`lookup`, for the rules),
    restored before the worker decides anything, and its share of the counting."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.view = TallyView()
        self.topic = tally_topic(settings)
        self.reader = TallyReader(self.topic, client_config(settings, tally_reader_group(settings)) | {
            "group.id": tally_reader_group(settings)}, self.view)  # fmt: skip
        self._restored: asyncio.Event | None = None

    def lookup(self, merchant_id: str) -> MerchantTally | None:
        return self.view.get(merchant_id)

    async def restore(self) -> None:
        """Create the topic if it is missing, then read it to where it ended."""
        began = time.monotonic()
        partitions, configs = tally_topic_spec(self.settings)
        await ensure_topics(self.settings, wanted=partitions, configs=configs)
        await self.reader.start()
        await self.reader.reached(self.reader.start_ends)
        log.info("merchant tally restored: %d merchants in %.1f s", len(self.view), time.monotonic() - began)
        self._ready().set()

    def _ready(self) -> asyncio.Event:
        if self._restored is None:  # made inside the running loop
            self._restored = asyncio.Event()
        return self._restored

    async def count(self) -> None:
        """This worker's share of the counting, from the restore on (a task of its own)."""
        await self._ready().wait()
        s = self.settings
        labels = AtLeastOnce(
            topics=[s.topic_labels], group_id=tally_group(s), client_config=client_config(s, tally_group(s)),
            session_timeout_ms=int(s.session_timeout_s * 1000), heartbeat_interval_ms=int(s.heartbeat_interval_s * 1000),
        )  # fmt: skip
        producer = TallyProducer(self.topic, client_config(s, tally_group(s)))
        try:
            # What it had not committed is counted again, by this worker restarted or another.
            with exit_on_failure("the merchant tally"):
                await labels.start()
                await TallyCounter(labels, self.reader, producer).run()
        finally:
            with contextlib.suppress(BaseException):
                await labels.close()  # commits what was counted, leaves the group
            with contextlib.suppress(BaseException):
                await producer.close()

    async def close(self) -> None:
        await self.reader.close()
