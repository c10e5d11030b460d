"""The scoring agent: transactions in, decisions out, exactly once per payment.

Reads top to bottom as a batch flows: take a micro-batch from the scoring
group's consumer (what is queued, up to ``FRAUD_BATCH_SIZE`` records), score it
(:class:`pipeline.scorer.Scorer`: admission, cache, enrichment, ensemble,
rules) while the previous batch's transaction commits, let the shadow model
see it, send its outcomes and offsets in the next Kafka transaction
(:mod:`app.eos`), then add the committed decisions to the partitions' resend
index (their changelog records committed with them: pipeline/resend_index.py).
When a transaction commits is :mod:`agents.pace`'s rule: as soon as the
worker has caught up, at every rate below saturation. Feedback and monitoring
records ride in the same transaction and are never awaited separately, so
they never hold up a decision.

The records move through librdkafka (:mod:`app.eos`), not faust's stream: faust's
per-event path cost more CPU than everything a decision does
(docs/performance.md). faust still hosts the worker: its web server and
metrics, the registry watch, the merchant tally and the feedback loop (each
of which reads through librdkafka too).

What the loop works with is built and connected once, at start, by
:mod:`agents.wiring` (``fraud-pipeline worker``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from agents.metrics import WorkerMetrics
from agents.pace import Pace
from agents.reload import Reloader
from app.contract import Transaction
from app.eos import ExactlyOnce, TakenBatch
from app.settings import Settings
from pipeline.cache import HoldingCache
from pipeline.scorer import BatchOutput, Inbound, Scorer, Signs
from pipeline.timing import timed

__all__ = ["ScoringLoop"]

log = logging.getLogger(__name__)

CACHE_WRITE_TIMEOUT_S = 0.1


class ScoringLoop:
    """Take a batch, score it while the last transaction commits, send its
    outcomes in the next; commit when the pace says (agents/pace.py); then
    cache what committed."""

    def __init__(
        self,
        stream: ExactlyOnce,
        scorer: Scorer,
        reloader: Reloader,
        metrics: WorkerMetrics,
        topics: dict[str, str],
        sign: Signs | None,
        settings: Settings,
        *,
        cache: HoldingCache,
        shared_cache: bool = True,
    ) -> None:
        """``cache`` is the scorer's own decision cache (``scorer.cache``, before
        any wrapping): the loop holds each sent batch's decisions in it until
        its transaction settles, then adds them to its resend index (and, with
        ``shared_cache``, stores them in the shared cache too)."""
        self.stream, self.scorer, self.reloader, self.metrics = stream, scorer, reloader, metrics
        self.cache = cache
        #: Whether decisions also go to a shared cache (Redis as a second level).
        self.shared_cache = shared_cache
        self.topics, self.sign = topics, sign
        self.batch_size = settings.batch_size
        self.pace = Pace(settings.batch_window_s, settings.commit_interval_s, settings.commit_caught_up)
        #: Per open (or just settled) transaction, the batches sent in it.
        self.pending: dict[int, list[tuple[list[Inbound], BatchOutput, float]]] = {}
        self._last_take = time.monotonic()
        #: The commit running while a batch is scored, if any.
        self._committing: asyncio.Future[list[tuple[int, str]]] | None = None
        self._phase = {phase: metrics.loop_seconds.labels(phase) for phase in ("take", "score", "send", "commit")}
        #: Called after every step (agents/watchdog.py: a loop that stops stepping exits).
        self.on_step: Callable[[], None] = lambda: None

    async def run(self, first: TakenBatch | None = None) -> None:
        """Step forever; ``first``: a batch already taken (while joining the group)."""
        while True:
            await self.step(first)
            first = None
            self.on_step()
            # NOTE: Python 3.11's asyncio.wait_for returns its awaitable's result
            # instead of raising when the task is cancelled as that awaitable
            # completes (CPython gh-86296, fixed in 3.12). The model's bounded call
            # (pipeline/scorer.py) could so swallow the worker's shutdown, and the loop
            # went on deciding after faust had stopped (a SIGTERM'd worker that
            # did not exit). The request is still counted on the task.
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise asyncio.CancelledError

    async def step(self, batch: TakenBatch | None = None) -> None:
        """Take what is queued (or wait for a record), commit the open
        transaction if it is due while this batch is scored, then send the
        batch in the next transaction. ``batch``: one taken already."""
        now = time.monotonic()
        if batch is None:
            waits = self.pace.waits(now, self._last_take, self.stream.open_since)
            batch = await self.stream.take(self.batch_size, *waits)
        self._last_take = taken = time.monotonic()
        self._phase["take"].observe(taken - now)
        full = len(batch.messages) >= self.batch_size
        # Due, or a rebalance settled one inside take(): its outcome is reported here.
        if self.pace.commit_due(self.stream.open_since, taken, full=full) or self.stream.has_settled():
            # NOTE: on the client thread while this batch is scored on the
            # event loop: the commit's round trips cost the loop only what
            # they take beyond scoring. The batch is sent after it, in the
            # next transaction; if it aborts, the batch is void (send says so).
            self._committing = asyncio.ensure_future(self.stream.commit())
        try:
            scored = await self.score(batch) if batch.messages else None
        finally:
            if self._committing is not None:
                waited = time.monotonic()
                # Shielded: a cancelled loop (shutdown) leaves the commit to drain().
                self.settle(await asyncio.shield(self._committing))
                self._committing = None
                self._phase["commit"].observe(time.monotonic() - waited)
        if scored is not None:
            await self.send(batch, *scored)

    async def score(self, batch: TakenBatch) -> tuple[list[Inbound], BatchOutput, float]:
        """One micro-batch's outcomes, top to bottom."""
        started = time.perf_counter()
        inbound = [_inbound(msg) for msg in batch.messages]
        await self.reloader.apply(self.scorer)  # a promoted model or rules, between batches
        output = await self.scorer.score_batch(inbound)
        await self.scorer.finish(output)  # the shadow model: adds to the feedback records
        self._phase["score"].observe(time.perf_counter() - started)
        return inbound, output, started

    async def send(self, batch: TakenBatch, inbound: list[Inbound], output: BatchOutput, started: float) -> None:
        """The batch's outcomes and offsets in the open transaction (one is begun if none is)."""
        records = output.records(self.topics, self.sign)
        sending = time.perf_counter()
        seq = await self.stream.send(batch, records, output.placed(self.topics, self.sign))
        self._phase["send"].observe(time.perf_counter() - sending)
        if seq is None:
            return  # taken before a rebalance or an abort: it comes again
        # A resend in a later batch of this transaction finds its first decision here.
        self.cache.hold(output.to_cache)
        self.pending.setdefault(seq, []).append((inbound, output, started))

    def settle(self, outcomes: list[tuple[int, str]]) -> None:
        for seq, outcome in outcomes:
            batches = self.pending.pop(seq, [])
            if outcome == "committed":
                self.cache.committed([item for _, output, _ in batches for item in output.indexed])
                # One write to the shared cache (if any) per transaction, not per
                # batch: a round trip is worth more than the bytes it carries.
                if self.shared_cache:
                    self._cache_later([item for _, output, _ in batches for item in output.to_cache])
                for inbound, output, started in batches:
                    self.metrics.observe_batch(inbound, output, started)
            else:
                log.warning("%d batch(es) not committed (%s): their records are decided again", len(batches), outcome)
                for _, output, _ in batches:
                    self.cache.release(output.to_cache)

    def _cache_later(self, decisions: list[tuple[Transaction, bytes]]) -> None:
        if decisions:
            task = asyncio.ensure_future(_write_cache(self.scorer, decisions))
            task.add_done_callback(lambda t: t.cancelled() or t.exception())

    async def drain(self) -> None:
        """Commit what is open (on shutdown)."""
        if self._committing is not None:
            self.settle(await self._committing)
            self._committing = None
        if self.pending:
            self.settle(await self.stream.commit())


async def _write_cache(scorer: Scorer, decisions: list[tuple[Transaction, bytes]]) -> None:
    if decisions:
        # NOTE: not awaited by the loop: the decisions are held in this
        # worker's local cache from the moment they were sent (a resend in a
        # later batch finds them there); Redis is for other workers, after a
        # rebalance. Bounded, and never fails a batch.
        try:
            await asyncio.wait_for(timed(scorer.round_trips, "cache_put", scorer.cache.put_many(decisions)),
                                   CACHE_WRITE_TIMEOUT_S)  # fmt: skip
        except Exception as exc:
            log.warning("storing %d decisions in the cache failed: %r", len(decisions), exc)


def _inbound(msg: Any) -> Inbound:
    headers = msg.headers()
    kind, ts_ms = msg.timestamp()
    return Inbound(
        value=msg.value() or b"",
        headers=dict(headers) if headers else {},
        timestamp=ts_ms / 1000.0 if kind else None,
        partition=msg.partition(),
        offset=msg.offset(),
        key=msg.key(),
    )
