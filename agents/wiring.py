"""How a scoring worker is put together at start: what it loads once, how its parts connect.

:func:`create_app` builds the worker's faust app: metrics, the merchant tally,
the registry watch, the scoring group's exactly-once stream, and the task that
builds the scorer inside the running loop and hands it to the scoring loop
(:mod:`agents.score`, which owns what happens to a batch). Every decision taken
from settings is taken here, once: whether Redis is a cluster, which key signs
decisions, where compiled trees live, the group and transactional ids. The
parts built here are told, not left to find out for themselves.

    fraud-pipeline worker            # create_app, plus the feedback loop's (--role all)
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import faust
import mode

from agents.feedback import install_feedback_loop
from agents.metrics import WorkerMetrics
from agents.reload import Reloader
from agents.score import ScoringLoop
from agents.tally import LiveTally
from agents.watchdog import LoopWatchdog, exit_on_failure
from app import redis_client
from app.changelog import ChangelogRestore
from app.eos import ExactlyOnce
from app.errors import ConfigError
from app.faust_app import base_app
from app.librdkafka import client_config
from app.placement import Placement
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
from pipeline.resend_index import ResendIndex, RocksStore
from pipeline.rules import RuleSet, load_rules
from pipeline.scorer import Scorer
from pipeline.timing import RoundTrips
from pipeline.validate import Limits

__all__ = [
    "Runtime", "compiled_dir", "create_app", "exactly_once", "freeze_startup_heap", "load_decision_signer",
    "resend_index", "restore_group", "scoring_group", "worker_name",
]  # fmt: skip

log = logging.getLogger(__name__)

#: How long the loop and the stream get to finish on shutdown: the open
#: transaction's commit, then leaving the group (its partitions move at once).
SHUTDOWN_STEP_S = 10.0
#: How long a starting worker waits for its first assignment before it says
#: Ready anyway (and goes on waiting in its loop): a group mid-rebalance, or a
#: broker whose first rebalance is delayed (``group.initial.rebalance.delay.ms``,
#: 3 s by default) answers within it.
JOIN_TIMEOUT_S = 15.0
#: The longest the warm-up before joining takes (the model's first calls).
WARM_UP_S = 30.0


def _no_tally(_merchant_id: str) -> MerchantTally | None:
    return None


@dataclass
class Runtime:
    """What a worker loads once at start: settings, rules and the model; and
    what it decides once from settings (``cluster``)."""

    settings: Settings
    rules: RuleSet
    model: ScoringModel | None
    client_keys: ClientKeys
    decision_signer: DecisionSigner
    cluster: bool = field(init=False)
    """Redis is a Redis Cluster: the parts built over its client keep each
    script to one slot. Decided here, from settings, for every part."""

    def __post_init__(self) -> None:
        self.cluster = redis_client.is_cluster(self.settings)

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

    def redis(self) -> Any:
        """The scoring path's pooled client (one server, Sentinel or a cluster).
        Redis clients need the running loop: call this inside the agent."""
        return redis_client.async_client(self.settings)

    def decision_cache(self, client: Any, index: ResendIndex) -> LocalFirstCache:
        """This worker's held decisions, then its partitions' resend ``index``
        (and Redis on ``client`` with ``decision_cache_redis``): the scorer
        reads it, the scoring loop holds sent decisions in it and adds the
        committed ones to the index."""
        s = self.settings
        shared = RedisDecisionCache(client, s.decision_cache_ttl_s, cluster=self.cluster) if s.decision_cache_redis else None
        return LocalFirstCache(shared, index=index, ttl_s=s.decision_cache_ttl_s, wait_s=s.cache_wait_s)

    def build_scorer(
        self,
        client: Any,
        cache: LocalFirstCache,
        merchant_tally: Callable[[str], MerchantTally | None] = _no_tally,
        round_trips: RoundTrips | None = None,
        placement: Placement | None = None,
    ) -> Scorer:
        """The scorer over ``client`` (:meth:`redis`) and ``cache`` (:meth:`decision_cache`);
        ``round_trips`` is told each Redis round trip's time (the worker's metrics);
        ``placement``: the home partitions of ``transactions`` (app/placement.py)."""
        s = self.settings
        admission = self.admission(client)
        store = RedisFeatureStore(client, local_cache_ttl_s=s.profile_cache_ttl_s, cluster=self.cluster)
        # One server: cache, admission and enrichment in one call per batch; a
        # cluster refuses a script over several slots, so the separate calls.
        lookup = None if self.cluster else RedisBatchLookup.build(client, cache, store, admission)
        return Scorer(
            admission=admission,
            model=self.model,
            rules=self.rules,
            store=store,
            cache=cache,
            lookup=lookup,
            limits=Limits(s.max_message_bytes, s.max_future_skew_s, s.max_age_s),
            model_budget_s=s.model_budget_ms / 1000.0,
            merchant_tally=merchant_tally,
            round_trips=round_trips,
            placement=placement,
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
            replay=RedisReplayGuard(client, cluster=self.cluster),
            limiter=RedisRateLimiter(
                client, s.rate_client_per_s, s.rate_client_burst, s.rate_user_per_s, s.rate_user_burst,
                cluster=self.cluster,
            ),  # fmt: skip
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
    tally = LiveTally(settings)  # live confirmed fraud per merchant, for the rules
    reloader = runtime.reloader()
    stream = exactly_once(settings, metrics)
    topics = {
        "decisions": settings.topic_decisions,
        "dead_letters": settings.topic_dlq,
        "feedback": settings.topic_feedback,
        "monitoring": settings.topic_monitoring,
        "transactions": settings.topic_transactions,
    }
    outputs = [topic for name, topic in topics.items() if name != "transactions"]

    async def score() -> None:
        index = resend_index(settings)  # opened here, not at import: the store takes a lock on its folder
        # ``decisions`` is the index's changelog (pipeline/resend_index.py): what
        # it held for longer than the TTL has expired, so a restore starts there.
        restore = ChangelogRestore(
            settings.topic_decisions, index, client_config(settings, f"{settings.app_id}-score"),
            group_id=restore_group(settings), history_s=settings.decision_cache_ttl_s,
        )  # fmt: skip
        restore.on_restored = lambda partitions, entries, took: metrics.index_restore_seconds.observe(took)
        stream.restore = restore
        client = runtime.redis()
        cache = runtime.decision_cache(client, index)
        scorer = runtime.build_scorer(client, cache, tally.lookup, metrics)
        loop = ScoringLoop(
            stream, scorer, reloader, metrics, topics, runtime.decision_signer, settings,
            cache=cache, shared_cache=settings.decision_cache_redis,
        )  # fmt: skip
        watchdog = LoopWatchdog(settings.loop_stall_exit_s)
        loop.on_step = restore.on_progress = watchdog.beat
        try:
            # Nothing of an uncommitted batch is visible: a worker restarted after
            # a failure takes it again from the committed offsets.
            with exit_on_failure("the scoring loop"):
                # Everything warm before the group hands this worker partitions:
                # the model's thread, a Redis connection, the producer (its
                # transactional id and the outputs' metadata), the heap frozen.
                await scorer.warm_up((1, 8, 32, settings.batch_size))
                await reloader.apply(scorer)  # the shadow and drift reference, if any
                with contextlib.suppress(Exception):  # a Redis down now degrades decisions; it stops nothing
                    await asyncio.wait_for(client.ping(), settings.redis_timeout_s)
                # NOTE: inside exit_on_failure: a worker whose producer cannot start
                # (the coordinator unreachable past init_transactions' timeout) exits
                # to be restarted, instead of serving /metrics while deciding nothing.
                await stream.start()
                scorer.placement = await placement(stream, settings)
                # Whatever this worker's producer wrote to decisions in an earlier
                # life (a kill -9 just after a broker restart) ends before it
                # decides anything (ExactlyOnce._hand_over).
                await stream.hand_over(range(scorer.placement.partitions))
                # The rules read the tally from the first batch on: restored whole first.
                await tally.restore()
                freeze_startup_heap()
                watchdog.start(asyncio.get_running_loop())  # joining restores the partitions' resend index
                first = await stream.join(settings.batch_size, JOIN_TIMEOUT_S, outputs)
                log.info(
                    "scoring %s as group %s (transactional id %s), partitions %s",
                    stream.topic, stream.group_id, stream.transactional_id, sorted(stream.assigned),
                )  # fmt: skip
                joined.set()
                await loop.run(first)  # the watchdog: a step that never ends gives stacks, then an exit
        finally:
            watchdog.stop()
            with contextlib.suppress(BaseException):
                await asyncio.wait_for(loop.drain(), SHUTDOWN_STEP_S)
            with contextlib.suppress(BaseException):
                await asyncio.wait_for(stream.close(), SHUTDOWN_STEP_S)  # leaves the group: its partitions move
            with contextlib.suppress(BaseException):
                await asyncio.wait_for(tally.close(), SHUTDOWN_STEP_S)
            index.close()

    async def watch_registry() -> None:  # loads in the background; swaps happen in the loop
        await reloader.poll()

    joined = asyncio.Event()

    class ScoringJoined(mode.Service):
        """Holds the worker's "Ready" until the scoring loop has joined its
        group warm (or ``JOIN_TIMEOUT_S`` passed): faust starts an app's
        services after its tasks and says Ready once they have started, so
        Ready means deciding, not starting to."""

        async def on_start(self) -> None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(joined.wait(), JOIN_TIMEOUT_S + WARM_UP_S)

    # NOTE: registered by calls, not as decorators: faust annotates its
    # decorators as returning a bare Callable, which would leave these
    # functions untyped.
    app.task(score)
    app.task(tally.count)  # from the tally's restore on
    app.timer(settings.reload_check_s)(watch_registry)
    app.service(ScoringJoined)

    if settings.worker_role == "all":  # "score": the feedback loop runs in its own workers
        install_feedback_loop(app, settings)
    return app


async def placement(stream: ExactlyOnce, settings: Settings) -> Placement:
    """The home partitions of ``transactions``; refuses ``decisions`` with fewer
    partitions (each partition's decisions go to the partition of ``decisions``
    numbered as it, the changelog of its resend index)."""
    transactions = await stream.partition_count(settings.topic_transactions)
    decisions = await stream.partition_count(settings.topic_decisions)
    if decisions < transactions:
        raise ConfigError(
            f"{settings.topic_decisions} has {decisions} partitions, {settings.topic_transactions} {transactions}: "
            f"add partitions to {settings.topic_decisions} to match (kafka-topics --alter --partitions)"
        )
    return Placement(transactions)


def worker_name(settings: Settings) -> str:
    """``FRAUD_WORKER_ID``, else host name and web port: the same when the worker restarts on its slot."""
    return settings.worker_id or f"{socket.gethostname()}-{settings.web_port}"


def resend_index(settings: Settings) -> ResendIndex:
    """This worker's resend index, on disk under ``data_dir``, one per worker
    slot: a restarted worker finds what it restored before and reads only the
    decisions written since (app/changelog.py)."""
    path = settings.data_dir / "decision-index" / worker_name(settings)
    return ResendIndex(RocksStore(path, settings.decision_cache_ttl_s), settings.decision_cache_ttl_s)


def restore_group(settings: Settings) -> str:
    """The group id the resend index's reader names (it joins no group; the client requires one)."""
    return f"{scoring_group(settings)}-index-restore"


def exactly_once(settings: Settings, metrics: WorkerMetrics) -> ExactlyOnce:
    """The scoring group's consumer and this worker's transactional producer (app/eos.py)."""
    stream = ExactlyOnce(
        topic=settings.topic_transactions,
        group_id=scoring_group(settings),
        transactional_id=f"{settings.app_id}-score-{settings.topic_transactions}-{worker_name(settings)}",
        client_config=client_config(settings, f"{settings.app_id}-score"),
        session_timeout_ms=int(settings.session_timeout_s * 1000),
        heartbeat_interval_ms=int(settings.heartbeat_interval_s * 1000),
        linger_ms=settings.producer_linger_s * 1000,
        compression=settings.producer_compression,
        fetch_min_bytes=settings.fetch_min_bytes,
        fetch_max_wait_ms=settings.consumer_fetch_max_wait_ms,
        settle_s=settings.commit_settle_s,
        # Decisions go to the partition numbered as their transaction's: a
        # partition given up gets a handover record (ExactlyOnce._hand_over).
        handover_topic=settings.topic_decisions,
    )
    stream.on_result = lambda result: metrics.transactions.labels(result).inc()
    stream.on_commit_seconds = metrics.commit_seconds.observe
    metrics.offsets = stream.offsets
    return stream


def scoring_group(settings: Settings) -> str:
    """The consumer group of the scoring workers (``transactions``; the merchant
    tally reads ``labels`` in a group of its own, agents/tally.py)."""
    return f"{settings.app_id}-score"


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
