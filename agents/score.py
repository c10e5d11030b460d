"""The scoring agent: transactions in, decisions out, exactly once per payment.

Reads top to bottom as a batch flows: take a micro-batch from the scoring
group's consumer (up to ``FRAUD_BATCH_SIZE`` records or ``FRAUD_BATCH_WINDOW_S``),
score it (:class:`pipeline.scorer.Scorer`: admission, cache, enrichment,
ensemble, rules), let the shadow model see it, commit outcomes and offsets in
one Kafka transaction (:mod:`app.eos`), then store the decisions in the resend
cache. Feedback and monitoring records ride in the same transaction and are
never awaited separately, so they never hold up a decision.

The records move through librdkafka (:mod:`app.eos`), not faust's stream: faust's
per-event path cost more CPU than everything a decision does
(docs/performance.md). faust still hosts the worker: its web server and
metrics, the registry watch, the merchant tally and the feedback loop.

    fraud-pipeline worker            # this agent, plus the feedback loop's (--role all)
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import faust

from agents.feedback import install_feedback_loop
from agents.metrics import WorkerMetrics
from agents.pace import Pace
from agents.reload import Reloader
from agents.tally import install_merchant_tally
from agents.watchdog import LoopWatchdog
from app import redis_client
from app.contract import Transaction
from app.eos import ExactlyOnce, TakenBatch
from app.errors import ConfigError
from app.faust_app import base_app
from app.librdkafka import client_config
from app.settings import Settings
from models.registry import load_ensemble
from pipeline.admission import Admission
from pipeline.auth import ClientKeys, RedisReplayGuard
from pipeline.cache import LocalFirstCache, RedisDecisionCache
from pipeline.decision_signing import DecisionSigner, signer_from_settings
from pipeline.feature_store import RedisFeatureStore
from pipeline.labels import MerchantTally
from pipeline.model import ScoringModel
from pipeline.ratelimit import RedisRateLimiter
from pipeline.redis_batch import RedisBatchLookup
from pipeline.rules import RuleSet, load_rules
from pipeline.scorer import BatchOutput, Inbound, Scorer, Signs
from pipeline.timing import RoundTrips, timed
from pipeline.validate import Limits

__all__ = ["Runtime", "ScoringLoop", "create_app", "exactly_once", "freeze_startup_heap", "scoring_group"]

log = logging.getLogger(__name__)

CACHE_WRITE_TIMEOUT_S = 0.1
#: How long an idle worker waits for a record before looking around (a
#: promoted model, shutdown): a record ends the wait as soon as it arrives.
IDLE_WAIT_S = 0.25


@dataclass
class Runtime:
    """What a worker loads once at start: settings, rules and the model."""

    settings: Settings
    rules: RuleSet
    model: ScoringModel | None
    client_keys: ClientKeys
    decision_signer: DecisionSigner

    @classmethod
    def load(cls, settings: Settings) -> Runtime:
        rules = load_rules(settings.rules_path)
        model = load_ensemble(settings.registry_dir, settings.model_version, compiled_dir=compiled_dir(settings))
        keys = ClientKeys.load(
            settings.client_keys_file,
            settings.client_keys.get_secret_value() if settings.client_keys else None,
        )
        if not keys and not settings.allow_unsigned:
            log.warning(
                "no producer keys (FRAUD_CLIENT_KEYS_FILE / FRAUD_CLIENT_KEYS) and unsigned traffic is "
                "not allowed: every transaction will be dead-lettered as unauthenticated"
            )
        log.info("serving model %s with rules %s; producers: %r", model.version, rules.version, keys)
        return cls(settings, rules, model, keys, load_decision_signer(settings))

    def build_scorer(
        self,
        merchant_tally: Callable[[str], MerchantTally | None] = lambda _: None,
        round_trips: RoundTrips | None = None,
    ) -> Scorer:
        """Redis clients need the running loop: call this inside the agent.
        ``round_trips`` is told each Redis round trip's time (the worker's metrics)."""
        s = self.settings
        client = redis_client.async_client(s)  # one server or a Redis Cluster
        admission = self.admission(client)
        store = RedisFeatureStore(client, local_cache_ttl_s=s.profile_cache_ttl_s)
        cache = LocalFirstCache(
            RedisDecisionCache(client, s.decision_cache_ttl_s),
            ttl_s=s.decision_cache_ttl_s,
            wait_s=s.cache_wait_s,
        )
        return Scorer(
            admission=admission,
            model=self.model,
            rules=self.rules,
            store=store,
            cache=cache,
            # One server: cache, admission and enrichment in one call per batch (None on a cluster).
            lookup=RedisBatchLookup.build(client, cache, store, admission),
            limits=Limits(s.max_message_bytes, s.max_future_skew_s, s.max_age_s),
            model_budget_s=s.model_budget_ms / 1000.0,
            merchant_tally=merchant_tally,
            round_trips=round_trips,
        )

    def reloader(self) -> Reloader:
        s = self.settings
        return Reloader(
            registry=s.registry_dir,
            rules_path=s.rules_path,
            pinned_version=s.model_version,
            model=self.model,
            rules=self.rules,
            check_every_s=s.reload_check_s,
            drift_window_rows=s.drift_window_rows,
            drift_warn_psi=s.drift_warn_psi,
            load=lambda registry, version: load_ensemble(registry, version, compiled_dir=compiled_dir(s)),
        )

    def admission(self, client: Any) -> Admission:
        s = self.settings
        return Admission(
            keys=self.client_keys,
            window_s=s.auth_window_s,
            allow_unsigned=s.allow_unsigned,
            replay=RedisReplayGuard(client),
            limiter=RedisRateLimiter(
                client, s.rate_client_per_s, s.rate_client_burst, s.rate_user_per_s, s.rate_user_burst
            ),
        )


def compiled_dir(settings: Settings) -> Path | None:
    """Where the served model's compiled trees live, or None: XGBoost only."""
    return settings.compiled_trees_dir if settings.compiled_trees else None


def load_decision_signer(settings: Settings) -> DecisionSigner:
    """The key every decision is signed with. None configured: refuse to start,
    unless ``allow_unsigned`` (development), when a throwaway key signs them:
    no consumer that checks signatures will accept those decisions."""
    signer = signer_from_settings(settings)
    if signer is not None:
        log.info("signing decisions with key %s", signer.key_id)
        return signer
    if not settings.allow_unsigned:
        raise ConfigError(
            "no decision signing key: set FRAUD_DECISION_SIGNING_KEY_FILE (`fraud-pipeline decision-key` "
            "writes one) or, for development only, FRAUD_ALLOW_UNSIGNED=true"
        )
    signer = DecisionSigner.generate()
    log.warning(
        "!!! NO DECISION SIGNING KEY: signing decisions with a throwaway key (%s) because FRAUD_ALLOW_UNSIGNED "
        "is on. Consumers that verify decisions (gateway, loadgen) refuse them. Development only. !!!",
        signer.key_id,
    )
    return signer


def create_app(settings: Settings, runtime: Runtime | None = None) -> faust.App:
    """The scoring worker's app. ``runtime`` defaults to loading rules and model from settings."""
    runtime = runtime or Runtime.load(settings)
    app = base_app(settings)
    metrics = WorkerMetrics.install(app, settings, faust_sensors=settings.faust_sensors)  # /metrics
    metrics.set_versions(runtime.model.version if runtime.model else None, runtime.rules.version)
    metrics.watch_gc()
    merchant_tally = install_merchant_tally(app, settings)  # live confirmed fraud per merchant, for the rules
    reloader = runtime.reloader()
    stream = exactly_once(settings, metrics)
    topics = {
        "decisions": settings.topic_decisions,
        "dead_letters": settings.topic_dlq,
        "feedback": settings.topic_feedback,
        "monitoring": settings.topic_monitoring,
    }

    @app.task
    async def score() -> None:
        scorer = runtime.build_scorer(merchant_tally, metrics)
        loop = ScoringLoop(stream, scorer, reloader, metrics, topics, runtime.decision_signer, settings)
        watchdog = LoopWatchdog(settings.loop_stall_exit_s)
        loop.on_step = watchdog.beat
        try:
            await scorer.warm_up()
            await reloader.apply(scorer)  # the shadow and drift reference, if any
            # NOTE: inside the try: a worker whose producer cannot start (the
            # coordinator unreachable past init_transactions' timeout) exits to
            # be restarted, instead of serving /metrics while deciding nothing.
            await stream.start()
            log.info(
                "scoring %s as group %s (transactional id %s)", stream.topic, stream.group_id, stream.transactional_id
            )
            freeze_startup_heap()
            watchdog.start(asyncio.get_running_loop())  # a step that never ends: stacks, then exit
            await loop.run()
        except asyncio.CancelledError:
            raise
        except BaseException:
            # Nothing of an uncommitted batch is visible: a restarted worker
            # takes it again from the committed offsets.
            log.critical("the scoring loop failed; exiting so the worker is restarted", exc_info=True)
            os._exit(70)
        finally:
            watchdog.stop()
            with contextlib.suppress(BaseException):
                await asyncio.wait_for(loop.drain(), 10.0)
            with contextlib.suppress(BaseException):
                await asyncio.wait_for(stream.close(), 10.0)  # leaves the group: its partitions move at once

    @app.timer(settings.reload_check_s)
    async def watch_registry() -> None:  # loads in the background; swaps happen in the agent
        await reloader.poll()

    if settings.worker_role == "all":  # "score": the feedback loop runs in its own workers
        install_feedback_loop(app, settings)

    app.runtime = runtime
    app.metrics = metrics
    app.scoring_stream = stream
    return app


def exactly_once(settings: Settings, metrics: WorkerMetrics) -> ExactlyOnce:
    """The scoring group's consumer and this worker's transactional producer (app/eos.py)."""
    worker_id = settings.worker_id or f"{socket.gethostname()}-{settings.web_port}"
    stream = ExactlyOnce(
        topic=settings.topic_transactions,
        group_id=scoring_group(settings),
        transactional_id=f"{settings.app_id}-score-{settings.topic_transactions}-{worker_id}",
        client_config=client_config(settings, f"{settings.app_id}-score"),
        session_timeout_ms=int(settings.session_timeout_s * 1000),
        heartbeat_interval_ms=int(settings.heartbeat_interval_s * 1000),
        linger_ms=settings.producer_linger_s * 1000,
        compression=settings.producer_compression,
        fetch_min_bytes=settings.fetch_min_bytes,
        fetch_max_wait_ms=settings.consumer_fetch_max_wait_ms,
    )
    stream.on_result = lambda result: metrics.transactions.labels(result).inc()
    stream.on_commit_seconds = metrics.commit_seconds.observe
    metrics.offsets = stream.offsets
    return stream


class ScoringLoop:
    """Take a batch, score it, send its outcomes in the open transaction;
    commit when the pace says (agents/pace.py); then cache what committed."""

    def __init__(
        self,
        stream: ExactlyOnce,
        scorer: Scorer,
        reloader: Reloader,
        metrics: WorkerMetrics,
        topics: dict[str, str],
        sign: Signs | None,
        settings: Settings,
    ) -> None:
        self.stream, self.scorer, self.reloader, self.metrics = stream, scorer, reloader, metrics
        self.topics, self.sign = topics, sign
        self.batch_size = settings.batch_size
        #: The batch window and commit interval: the busy regime's, or the quiet one's at low rates.
        self.pace = Pace(
            settings.batch_window_s, settings.commit_interval_s, settings.quiet_window_s, settings.quiet_below_tps
        )
        #: Per open (or just settled) transaction, the batches sent in it.
        self.pending: dict[int, list[tuple[list[Inbound], BatchOutput, float]]] = {}
        self._last_take = time.monotonic()
        self._phase = {phase: metrics.loop_seconds.labels(phase) for phase in ("take", "score", "send", "commit")}
        #: Called after every step (agents/watchdog.py: a loop that stops stepping exits).
        self.on_step: Callable[[], None] = lambda: None

    async def run(self) -> None:
        while True:
            await self.step()
            self.on_step()

    async def step(self) -> None:
        """One batch (or none, after the pace's window), then a commit when one is due."""
        now = time.monotonic()
        window_s, interval_s = self.pace.window, self.pace.interval
        # The window counts from the last take: what arrived while the last
        # batch was scored and committed has waited already, and is taken at
        # once; right after a take, the next waits out the rest of the window
        # for a batch to fill. NOTE: a full window from each take added its
        # 10 ms to every decision at every rate (docs/performance.md).
        wait = max(0.0, window_s - (now - self._last_take))
        # Nothing came in the window: wait for the first record (not for a
        # batch), as long as no commit is due: an idle worker sleeps instead
        # of waking every window, and takes a record the moment it arrives.
        idle = IDLE_WAIT_S
        opened = self.stream.open_since
        if opened is not None:
            due = max(0.0, opened + interval_s - now)
            wait = min(wait, due)
            idle = due - wait
        batch = await self.stream.take(self.batch_size, wait, idle)
        self._last_take = taken = time.monotonic()
        self.pace.taken(len(batch.messages), taken, full=len(batch.messages) >= self.batch_size)
        self.metrics.quiet.set(self.pace.quiet)
        self._phase["take"].observe(taken - now)
        if batch.messages:
            await self.handle(batch)
        opened = self.stream.open_since
        now = time.monotonic()
        # Due, or a rebalance settled one inside take(): its outcome is reported here.
        if (opened is not None and now - opened >= self.pace.interval) or self.stream.has_settled():
            self.settle(await self.stream.commit())
            self._phase["commit"].observe(time.monotonic() - now)

    async def handle(self, batch: TakenBatch) -> BatchOutput | None:
        """One micro-batch, top to bottom."""
        started = time.perf_counter()
        inbound = [_inbound(msg) for msg in batch.messages]
        await self.reloader.apply(self.scorer)  # a promoted model or rules, between batches
        output = await self.scorer.score_batch(inbound)
        await self.scorer.finish(output)  # the shadow model: adds to the feedback records
        records = output.records(self.topics, self.sign)
        sending = time.perf_counter()
        self._phase["score"].observe(sending - started)
        seq = await self.stream.send(batch, records)
        self._phase["send"].observe(time.perf_counter() - sending)
        if seq is None:
            return None  # taken before a rebalance: it comes again
        # A resend in a later batch of this transaction finds its first decision here.
        self.scorer.cache.hold(output.to_cache)  # LocalFirstCache: what a worker builds
        self.pending.setdefault(seq, []).append((inbound, output, started))
        return output

    def settle(self, outcomes: list[tuple[int, str]]) -> None:
        for seq, outcome in outcomes:
            batches = self.pending.pop(seq, [])
            if outcome == "committed":
                # One write to the shared cache per transaction, not per batch:
                # a round trip is worth more than the bytes it carries.
                self._cache_later([item for _, output, _ in batches for item in output.to_cache])
                for inbound, output, started in batches:
                    self.metrics.observe_batch(inbound, output, started)
            else:
                log.warning("%d batch(es) not committed (%s): their records are decided again", len(batches), outcome)
                for _, output, _ in batches:
                    self.scorer.cache.release(output.to_cache)

    def _cache_later(self, decisions: list[tuple[Transaction, bytes]]) -> None:
        if decisions:
            task = asyncio.ensure_future(_write_cache(self.scorer, decisions))
            task.add_done_callback(lambda t: t.cancelled() or t.exception())

    async def drain(self) -> None:
        """Commit what is open (on shutdown)."""
        if self.pending:
            self.settle(await self.stream.commit())


def freeze_startup_heap() -> None:
    """Leave what start-up built (modules, the model, faust, the clients) out
    of every later garbage collection.

    NOTE: a full collection walks every tracked object; the ~200,000 that
    start-up leaves behind made each one a pause of 60-180 ms on the scoring
    loop under load (docs/performance.md), all of it for objects that live
    as long as the process. ``gc.freeze`` moves them to a generation the
    collector never visits; what the worker allocates later is collected as
    before.
    """
    gc.collect()
    gc.freeze()
    log.debug("%d start-up objects left out of garbage collection", gc.get_freeze_count())


def scoring_group(settings: Settings) -> str:
    """The consumer group of the scoring workers (faust's own group, ``app_id``,
    reads the labels for the merchant tally)."""
    return f"{settings.app_id}-score"


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
    )
