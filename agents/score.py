"""The scoring agent: transactions in, decisions out, exactly once per payment.

Reads top to bottom as a batch flows: take a micro-batch of events, admit what
the partition bookkeeping allows (:mod:`app.commits`), score it
(:class:`pipeline.scorer.Scorer`: admission, cache, enrichment, ensemble,
rules), let the shadow model see it, commit outcomes and offsets in one Kafka
transaction per input partition (:mod:`app.transactional`), then store the
decisions in the resend cache. Feedback and monitoring records ride in the same
transaction and are never awaited separately, so they never hold up a decision.

    fraud-pipeline worker            # this agent, plus the feedback loop's (--role all)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import faust

from agents.feedback import install_feedback_loop
from agents.metrics import WorkerMetrics
from agents.reload import Reloader
from agents.tally import install_merchant_tally
from app import redis_client
from app.commits import TransactionCommits
from app.contract import Transaction
from app.errors import ConfigError
from app.faust_app import RAW, base_app
from app.seams import untrack_read_offsets
from app.settings import Settings
from app.topics import kafka_auth, producer_options
from app.transactional import TransactionalEmitter
from models.registry import load_ensemble
from pipeline.admission import Admission
from pipeline.auth import ClientKeys, RedisReplayGuard
from pipeline.cache import LocalFirstCache, RedisDecisionCache
from pipeline.decision_signing import DecisionSigner, signer_from_settings
from pipeline.feature_store import RedisFeatureStore
from pipeline.labels import MerchantTally
from pipeline.model import ScoringModel
from pipeline.ratelimit import RedisRateLimiter
from pipeline.rules import RuleSet, load_rules
from pipeline.scorer import BatchOutput, Inbound, Scorer
from pipeline.validate import Limits

__all__ = ["Runtime", "create_app", "handle_batch"]

log = logging.getLogger(__name__)

CACHE_WRITE_TIMEOUT_S = 0.1


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
        model = load_ensemble(settings.registry_dir, settings.model_version)
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
        self, merchant_tally: Callable[[str], MerchantTally | None] = lambda _: None
    ) -> Scorer:
        """Redis clients need the running loop: call this inside the agent."""
        s = self.settings
        client = redis_client.async_client(s)  # one server or a Redis Cluster
        return Scorer(
            admission=self.admission(client),
            model=self.model,
            rules=self.rules,
            store=RedisFeatureStore(client, local_cache_ttl_s=s.profile_cache_ttl_s),
            cache=LocalFirstCache(
                RedisDecisionCache(client, s.decision_cache_ttl_s),
                ttl_s=s.decision_cache_ttl_s,
                wait_s=s.cache_wait_s,
            ),
            limits=Limits(s.max_message_bytes, s.max_future_skew_s, s.max_age_s),
            model_budget_s=s.model_budget_ms / 1000.0,
            merchant_tally=merchant_tally,
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
    # acks=False: faust never commits `transactions`; each batch's transaction does.
    transactions = app.topic(settings.topic_transactions, partitions=settings.partitions, acks=False, **RAW)
    commits = _transaction_commits(app, settings, metrics)
    commits.sign_decisions = runtime.decision_signer  # every decision carries its Ed25519 signature
    merchant_tally = install_merchant_tally(app, settings)  # live confirmed fraud per merchant, for the rules
    reloader = runtime.reloader()

    @app.agent(transactions, concurrency=1)  # concurrency 1: faust-streaming #606
    async def score(stream: faust.StreamT) -> None:
        scorer = metrics.instrument(runtime.build_scorer(merchant_tally))
        await scorer.warm_up()
        await reloader.apply(scorer)  # the shadow and drift reference, if any
        try:
            async for events in stream.take_events(settings.batch_size, within=settings.batch_window_s):
                await handle_batch(events, commits=commits, scorer=scorer, reloader=reloader, metrics=metrics)
        finally:
            with contextlib.suppress(BaseException):
                await asyncio.wait_for(commits.close(), 5.0)

    @app.timer(settings.reload_check_s)
    async def watch_registry() -> None:  # loads in the background; swaps happen in the agent
        await reloader.poll()

    @app.timer(settings.watchdog_interval_s)
    async def watch_partitions() -> None:  # a partition that stops moving is sought back
        await commits.tick()

    if settings.worker_role == "all":  # "score": the feedback loop runs in its own workers
        install_feedback_loop(app, settings)

    app.runtime = runtime
    app.metrics = metrics
    app.scoring_agent = score
    app.transaction_commits = commits
    return app


async def handle_batch(
    events: Sequence[Any],
    *,
    commits: TransactionCommits,
    scorer: Scorer,
    reloader: Reloader,
    metrics: WorkerMetrics,
) -> BatchOutput | None:
    """One micro-batch of faust events, top to bottom; returns what it
    committed, or None when nothing was admitted (nothing is done then)."""
    started = time.perf_counter()
    admitted = await commits.admit(events)  # holes and rewinds: see app/commits.py
    if not admitted.events:
        return None
    batch = [_inbound(event) for event in admitted.events]
    await reloader.apply(scorer)  # a promoted model or rules, between batches
    output = await scorer.score_batch(batch)
    await scorer.finish(output)  # the shadow model: adds to the feedback records
    committed = await commits.commit(admitted, output)  # outcomes + offsets, one transaction per partition
    await _write_cache(scorer, output.cacheable(committed))  # only what committed: never a fenced partition's
    metrics.observe_batch(batch, output, started)
    return output


def _transaction_commits(app: faust.App, settings: Settings, metrics: WorkerMetrics) -> TransactionCommits:
    """Offsets of ``transactions`` and every output of a batch, one transaction per input partition."""
    emitter = TransactionalEmitter(
        app_id=settings.app_id,
        group_id=settings.app_id,  # faust's consumer group
        topic=settings.topic_transactions,
        producer_options=producer_options(settings),
        scope=settings.transaction_scope,
        worker_id=settings.worker_id or f"{socket.gethostname()}-{settings.web_port}",
    )
    commits = TransactionCommits(
        app,
        settings.topic_transactions,
        emitter,
        topics={
            "decisions": settings.topic_decisions,
            "dead_letters": settings.topic_dlq,
            "feedback": settings.topic_feedback,
            "monitoring": settings.topic_monitoring,
        },
        stall_after_s=settings.stall_after_s,
        consumer_options={"bootstrap_servers": settings.kafka_bootstrap, **kafka_auth(settings)},
    )
    metrics.committed = commits.progress.committed_offsets  # lag = fetch highwater - this
    commits.on_reseek = lambda reason: metrics.partition_reseeks.labels(reason).inc()
    emitter.on_result = lambda result: metrics.transactions.labels(result).inc()
    untrack_read_offsets(app, settings.topic_transactions)

    @app.on_partitions_revoked.connect
    async def _revoked(sender: Any, revoked: set[Any], **_: Any) -> None:
        await commits.on_revoked(revoked)

    @app.on_partitions_assigned.connect
    async def _assigned(sender: Any, assigned: set[Any], **_: Any) -> None:
        await commits.on_assigned(assigned)

    return commits


async def _write_cache(scorer: Scorer, decisions: list[tuple[Transaction, dict[str, Any]]]) -> None:
    if decisions:
        # NOTE: awaited before the next batch is taken: a resend one batch
        # behind its original must find this decision (a fire-and-forget
        # write raced it). Bounded, and never fails the batch.
        try:
            await asyncio.wait_for(scorer.cache.put_many(decisions), CACHE_WRITE_TIMEOUT_S)
        except Exception as exc:
            log.warning("storing %d decisions in the cache failed: %r", len(decisions), exc)


def _inbound(event: Any) -> Inbound:
    message = event.message
    headers = message.headers or {}
    if not isinstance(headers, dict):
        headers = {k: v for k, v in headers}
    return Inbound(
        value=message.value if isinstance(message.value, bytes) else bytes(message.value or b""),
        headers={str(k): (v if isinstance(v, bytes) else str(v).encode()) for k, v in headers.items()},
        timestamp=message.timestamp,
        partition=message.partition,
        offset=message.offset,
    )
