"""Create every topic explicitly, with its partition count, before workers start.

NOTE: the local broker auto-creates unknown topics with 4 partitions on the
first metadata request, which gives faust a source/changelog partition mismatch;
so nothing is left to auto-creation.
"""

from __future__ import annotations

import asyncio
import logging
import time

from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import KafkaConnectionError, KafkaError, TopicAlreadyExistsError

from app.settings import Settings

__all__ = ["ensure_topics", "topic_partitions"]

log = logging.getLogger(__name__)


def topic_partitions(settings: Settings) -> dict[str, int]:
    return {
        settings.topic_transactions: settings.partitions,
        settings.topic_decisions: settings.partitions,
        settings.topic_dlq: max(1, settings.partitions // 2),
        settings.topic_monitoring: 1,
        settings.topic_feedback: max(1, settings.partitions // 2),
        settings.topic_labels: max(1, settings.partitions // 2),
    }


async def ensure_topics(settings: Settings, *, wait_s: float = 60.0) -> dict[str, int]:
    """Create missing topics; wait for the broker with backoff up to ``wait_s``."""
    wanted = topic_partitions(settings)
    deadline = time.monotonic() + wait_s
    delay = 0.25
    while True:
        admin = AIOKafkaAdminClient(bootstrap_servers=settings.kafka_bootstrap, **kafka_auth(settings))
        try:
            await admin.start()
            existing = set(await admin.list_topics())
            missing = [NewTopic(name, n, 1) for name, n in wanted.items() if name not in existing]
            if missing:
                try:
                    await admin.create_topics(missing)
                except TopicAlreadyExistsError:
                    pass  # another worker won the race
            return wanted
        except (KafkaConnectionError, KafkaError, OSError) as exc:
            if time.monotonic() + delay > deadline:
                raise
            log.warning(
                "broker %s not reachable (%s); retrying in %.1f s", settings.kafka_bootstrap, exc, delay
            )
            await asyncio.sleep(delay)
            delay = min(delay * 2, 5.0)
        finally:
            await admin.close()


def kafka_auth(settings: Settings) -> dict[str, object]:
    """aiokafka connection options for SASL/TLS, from settings."""
    opts: dict[str, object] = {}
    if settings.kafka_ssl:
        import ssl

        opts["ssl_context"] = ssl.create_default_context()
    if settings.kafka_sasl_mechanism:
        opts["security_protocol"] = "SASL_SSL" if settings.kafka_ssl else "SASL_PLAINTEXT"
        opts["sasl_mechanism"] = settings.kafka_sasl_mechanism
        opts["sasl_plain_username"] = settings.kafka_sasl_username
        opts["sasl_plain_password"] = (
            settings.kafka_sasl_password.get_secret_value() if settings.kafka_sasl_password else None
        )
    elif settings.kafka_ssl:
        opts["security_protocol"] = "SSL"
    return opts
