"""Create every topic explicitly, with its partition count, before workers start.

Nothing is left to a broker's auto-creation: its default partition count
would give faust a source/changelog partition mismatch (the local broker has
auto-creation off).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import KafkaConnectionError, KafkaError, TopicAlreadyExistsError

from app.retry import retry
from app.seams import cluster_metadata
from app.settings import Settings

__all__ = [
    "cluster_replicas", "ensure_topics", "kafka_auth", "replicas_for", "sasl_password", "topic_configs",
    "topic_partitions",
]  # fmt: skip

log = logging.getLogger(__name__)


#: How long ``decisions`` keeps a decision at least: Kafka's default retention.
DECISIONS_RETENTION_MS = 7 * 24 * 3600 * 1000


def topic_partitions(settings: Settings) -> dict[str, int]:
    return {
        settings.topic_transactions: settings.partitions,
        settings.topic_decisions: settings.partitions,
        settings.topic_dlq: max(1, settings.partitions // 2),
        settings.topic_monitoring: 1,
        settings.topic_feedback: max(1, settings.partitions // 2),
        settings.topic_labels: max(1, settings.partitions // 2),
    }


def topic_configs(settings: Settings) -> dict[str, dict[str, str]]:
    """Per topic, what it is created with beyond partitions and replicas."""
    ttl_ms = settings.decision_cache_ttl_s * 1000
    return {
        # ``decisions`` is the resend index's changelog (pipeline/resend_index.py):
        # a partition's new owner reads its last TTL of decisions. Kept a week
        # (Kafka's default) for the readers of decisions, the TTL if longer.
        # NOTE: no size limit, whatever the broker's default (the local stack's
        # is 128 MiB a partition): a decision dropped before its TTL is a resend
        # decided again.
        settings.topic_decisions: {
            "retention.ms": str(max(ttl_ms, DECISIONS_RETENTION_MS)),
            "retention.bytes": "-1",
        },
    }


def replicas_for(settings: Settings, brokers: int) -> int:
    """Replicas of every topic created for this project, its own (the merchant
    tally's too) and faust's (the leader topic): ``replication_factor``, else 3
    on a cluster of 3 or more brokers and 1 on fewer."""
    return settings.replication_factor or (3 if brokers >= 3 else 1)


async def cluster_replicas(settings: Settings) -> int:
    """:func:`replicas_for` the cluster at ``kafka_bootstrap`` (asked only when
    ``replication_factor`` is 0)."""
    if settings.replication_factor:
        return settings.replication_factor
    admin = AIOKafkaAdminClient(bootstrap_servers=settings.kafka_bootstrap, **kafka_auth(settings))
    try:
        await admin.start()
        return replicas_for(settings, len((await admin.describe_cluster())["brokers"]))
    finally:
        await admin.close()


async def ensure_topics(
    settings: Settings,
    *,
    wait_s: float = 60.0,
    wanted: dict[str, int] | None = None,
    configs: dict[str, dict[str, str]] | None = None,
) -> dict[str, int]:
    """Create missing topics (the project's, else ``wanted`` with ``configs``);
    wait for the broker with backoff up to ``wait_s``."""
    wanted = topic_partitions(settings) if wanted is None else wanted
    extra = configs or {}

    async def create_missing() -> dict[str, int]:
        admin = AIOKafkaAdminClient(bootstrap_servers=settings.kafka_bootstrap, **kafka_auth(settings))
        try:
            await admin.start()
            existing = set(await admin.list_topics())
            replicas = replicas_for(settings, len((await admin.describe_cluster())["brokers"]))
            # Two acknowledgements of three: a write survives the loss of its
            # leader, and one broker down still leaves writes possible.
            configs = {"min.insync.replicas": "2"} if replicas >= 3 else {}
            own = {**topic_configs(settings), **extra}
            missing = [
                NewTopic(name, n, replicas, topic_configs={**configs, **own.get(name, {})})
                for name, n in wanted.items() if name not in existing
            ]  # fmt: skip
            if missing:
                try:
                    await admin.create_topics(missing)
                except TopicAlreadyExistsError:
                    pass  # another worker won the race
            return wanted
        finally:
            await admin.close()

    def unreachable(exc: Exception, delay: float) -> None:
        log.warning("broker %s not reachable (%s); retrying in %.1f s", settings.kafka_bootstrap, exc, delay)

    return await retry(
        create_missing, first_s=0.25, cap_s=5.0, deadline=time.monotonic() + wait_s,
        retry_on=(KafkaConnectionError, KafkaError, OSError), on_retry=unreachable,
    )  # fmt: skip


def kafka_auth(settings: Settings) -> dict[str, object]:
    """aiokafka connection options for SASL/TLS, from settings."""
    opts: dict[str, object] = {}
    if settings.kafka_ssl:
        import ssl

        cafile = str(settings.kafka_ssl_cafile) if settings.kafka_ssl_cafile else None
        opts["ssl_context"] = ssl.create_default_context(cafile=cafile)
    if settings.kafka_sasl_mechanism:
        opts["security_protocol"] = "SASL_SSL" if settings.kafka_ssl else "SASL_PLAINTEXT"
        opts["sasl_mechanism"] = settings.kafka_sasl_mechanism
        opts["sasl_plain_username"] = settings.kafka_sasl_username
        opts["sasl_plain_password"] = sasl_password(settings)
    elif settings.kafka_ssl:
        opts["security_protocol"] = "SSL"
    return opts


def sasl_password(settings: Settings) -> str | None:
    """``kafka_sasl_password``, else the first line of ``kafka_sasl_password_file``."""
    if settings.kafka_sasl_password is not None:
        return settings.kafka_sasl_password.get_secret_value()
    if settings.kafka_sasl_password_file is not None:
        return settings.kafka_sasl_password_file.read_text().strip()
    return None


async def partitions_of(consumer: object, topics: Sequence[str]) -> dict[str, set[int] | None]:
    """The partitions of each of ``topics`` (None for a topic that does not exist),
    from a metadata request for all topics.

    NOTE: aiokafka's public ``partitions_for_topic`` stays None for a topic the
    consumer is not assigned; the seam :func:`app.seams.cluster_metadata` says why.
    """
    cluster = await cluster_metadata(consumer)
    return {topic: cluster.partitions_for_topic(topic) for topic in topics}
