"""The Faust app: topics, the scoring agent, and the wiring that feeds it.

The agent is deliberately thin: it takes a micro-batch of events, hands the
raw messages to :class:`agents.score.Scorer`, produces what comes back, and
awaits the decisions' deliveries together. Feedback and monitoring records are
enqueued and not awaited, so they never hold up a decision.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import faust
from faust.transport.drivers import aiokafka as faust_aiokafka

from agents.admission import Admission
from agents.auth import ClientKeys, RedisReplayGuard
from agents.cache import LocalFirstCache, RedisDecisionCache
from agents.feature_store import RedisFeatureStore
from agents.ratelimit import RedisRateLimiter
from agents.reload import Reloader
from agents.labels import MerchantTally, parse_label
from agents.rules import RuleSet, load_rules
from agents.score import BatchOutput, Inbound, Scorer
from agents.validate import Limits
from app import redis_client
from app.commits import TransactionCommits, untrack_read_offsets
from app.feedback_loop import install_feedback_loop
from app.metrics import WorkerMetrics
from app.settings import Settings
from app.topics import kafka_auth, producer_options
from app.transactional import TransactionalEmitter
from models.ensemble import ScoringModel
from models.registry import load_ensemble

__all__ = ["Runtime", "base_app", "create_app"]

log = logging.getLogger(__name__)

CACHE_WRITE_TIMEOUT_S = 0.1


def _install_read_committed() -> None:
    """Make faust's worker consumer read with ``isolation_level=read_committed``.

    NOTE: faust-streaming 0.15.3 reads committed data only in its own
    exactly-once mode (``processing_guarantee="exactly_once"``, which this
    project does not use: app/transactional.py says why). Everything the
    scoring agent writes is transactional, and the feedback loop's agents read
    ``feedback`` from the same consumer: an aborted batch's records must stay
    invisible to them. The consumer is built before it starts, and aiokafka
    hands ``_isolation_level`` to its fetcher at start, so setting it on the
    new consumer is enough. tests/integration/test_exactly_once.py checks it.
    """
    thread_cls = faust_aiokafka.AIOKafkaConsumerThread
    original = thread_cls._create_worker_consumer
    if getattr(original, "_fraud_patched", False):
        return

    def _create_worker_consumer(self: Any, transport: Any) -> Any:
        consumer = original(self, transport)
        consumer._isolation_level = "read_committed"
        return consumer

    _create_worker_consumer._fraud_patched = True  # type: ignore[attr-defined]
    thread_cls._create_worker_consumer = _create_worker_consumer


@dataclass
class Runtime:
    """What a worker loads once at start: settings, rules and the model."""

    settings: Settings
    rules: RuleSet
    model: ScoringModel | None
    client_keys: ClientKeys

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
        return cls(settings, rules, model, keys)

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


def _credentials(settings: Settings) -> Any:
    auth = kafka_auth(settings)
    if "sasl_mechanism" in auth:
        return faust.SASLCredentials(
            username=auth["sasl_plain_username"],
            password=auth["sasl_plain_password"],
            mechanism=auth["sasl_mechanism"],
            ssl_context=auth.get("ssl_context"),
        )
    if "ssl_context" in auth:
        return faust.SSLCredentials(auth["ssl_context"])
    return None


def base_app(settings: Settings) -> faust.App:
    """A faust app configured for this project's broker settings, without agents.

    Shared by the scoring app and the benchmark's pass-through, so the two
    reach the broker in exactly the same way.
    """
    _install_read_committed()
    sys.setswitchinterval(settings.gil_switch_interval_s)
    app = faust.App(
        settings.app_id,
        broker=f"kafka://{settings.kafka_bootstrap}",
        broker_credentials=_credentials(settings),
        store="memory://",
        datadir=str(settings.data_dir),
        broker_session_timeout=settings.session_timeout_s,
        broker_heartbeat_interval=settings.heartbeat_interval_s,
        producer_linger=settings.producer_linger_s,
        consumer_auto_offset_reset="earliest",
        web_host=settings.web_host,
        web_port=settings.web_port,
        web_bind=settings.web_host,
        topic_partitions=settings.partitions,
        # Our topics already exist (ensure_topics); faust declares only its own
        # changelog and repartition topics, with the source's partition count.
        topic_allow_declare=True,
    )
    return app


def create_app(settings: Settings, runtime: Runtime | None = None) -> faust.App:
    """Build the app. ``runtime`` defaults to loading rules and model from settings."""
    runtime = runtime or Runtime.load(settings)
    app = base_app(settings)
    metrics = WorkerMetrics.install(app, settings, faust_sensors=settings.faust_sensors)  # /metrics
    metrics.set_versions(runtime.model.version if runtime.model else None, runtime.rules.version)
    raw = {"key_type": bytes, "value_type": bytes, "key_serializer": "raw", "value_serializer": "raw"}
    # acks=False: faust never commits `transactions`; each batch's transaction
    # does (app/transactional.py, app/offsets.py).
    transactions = app.topic(settings.topic_transactions, partitions=settings.partitions, acks=False, **raw)
    emitter = TransactionalEmitter(
        app_id=settings.app_id,
        group_id=settings.app_id,  # faust's consumer group
        topic=settings.topic_transactions,
        producer_options=producer_options(settings),
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

    feedback = app.topic(settings.topic_feedback, **raw)
    monitoring = app.topic(settings.topic_monitoring, **raw)
    labels = app.topic(settings.topic_labels, **raw)

    # Live confirmed-fraud tally per merchant, read by the rules of every batch.
    # A GlobalTable: every worker holds all of it, since any worker may score
    # any merchant. NOTE: reads are fine inside take(); writes need a current
    # event, so they happen in the plain labels agent below.
    # Partitions as the repartitioned labels stream faust declares (the app default).
    # NOTE: no value_type: with value_type=dict faust's changelog recovery calls
    # dict.from_data(), fails ("Error in recovery ...") and never finishes, so a
    # worker restarted after any tallied label never became ready. Without one,
    # values are JSON and come back as plain dicts.
    merchant_labels = app.GlobalTable("merchant-labels", key_type=str, partitions=settings.partitions)

    def merchant_tally(merchant_id: str) -> MerchantTally | None:
        doc = merchant_labels.get(merchant_id)
        return MerchantTally.from_json(doc) if doc else None

    @app.agent(labels)
    async def tally_labels(stream: faust.StreamT) -> None:
        # Re-key by merchant so one merchant's labels are counted by one
        # partition (a GlobalTable written from two partitions would race).
        async for raw in stream.group_by(_label_merchant, name="labels-by-merchant"):
            label = parse_label(raw)
            if isinstance(label, str) or label.merchant_id is None:
                continue  # malformed or merchant-less labels do not feed the tally
            tally = MerchantTally.from_json(merchant_labels.get(label.merchant_id))
            if tally.apply(label):
                merchant_labels[label.merchant_id] = tally.to_json()

    async def write_cache(scorer: Scorer, output: BatchOutput) -> None:
        if output.to_cache:
            # NOTE: awaited before the next batch is taken: a resend one batch
            # behind its original must find this decision (a fire-and-forget
            # write raced it). Bounded, and never fails the batch.
            try:
                await asyncio.wait_for(scorer.cache.put_many(output.to_cache), CACHE_WRITE_TIMEOUT_S)
            except Exception as exc:
                log.warning("storing %d decisions in the cache failed: %r", len(output.to_cache), exc)

    reloader = runtime.reloader()

    @app.timer(settings.reload_check_s)
    async def watch_registry() -> None:  # loads in the background; swaps happen in the agent
        await reloader.poll()

    if settings.worker_role == "all":  # "score": the feedback loop runs in its own workers
        install_feedback_loop(app, settings, feedback=feedback, labels=labels, monitoring=monitoring)

    @app.agent(transactions, concurrency=1)  # concurrency 1: faust-streaming #606
    async def score(stream: faust.StreamT) -> None:
        scorer = metrics.instrument(runtime.build_scorer(merchant_tally))
        await scorer.warm_up()
        await reloader.apply(scorer)  # the shadow and drift reference, if any
        size, within = settings.batch_size, settings.batch_window_s
        try:
            async for events in stream.take_events(size, within=within):
                started = time.perf_counter()
                admitted = await commits.admit(events)
                if admitted.events:
                    batch = [_inbound(event) for event in admitted.events]
                    await reloader.apply(scorer)  # a promoted model or rules, between batches
                    output = await scorer.score_batch(batch)
                    await scorer.finish(output)  # the shadow model: adds to the feedback records
                    await commits.commit(admitted, output)  # outcomes + offsets, one transaction per partition
                    await write_cache(scorer, output)
                    metrics.observe_batch(batch, output, started)
        finally:
            with contextlib.suppress(BaseException):
                await asyncio.wait_for(commits.close(), 5.0)

    app.runtime = runtime
    app.metrics = metrics

    @app.timer(settings.watchdog_interval_s)
    async def watch_partitions() -> None:
        await commits.tick()

    app.scoring_agent = score
    app.transaction_commits = commits
    return app


def _label_merchant(raw: bytes) -> bytes:
    label = parse_label(raw)
    merchant = None if isinstance(label, str) else label.merchant_id
    return (merchant or "").encode()


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
