"""librdkafka (confluent-kafka) client settings, from this project's settings.

The scoring path consumes and produces through librdkafka: its consumer hands
over a batch of records from C, its producer batches and compresses in C, and
its transactions carry the consumer group's generation (KIP-447). The same
broker address and credentials as the aiokafka clients (:func:`app.topics.kafka_auth`),
spelled the way librdkafka names them.
"""

from __future__ import annotations

from app.settings import Settings
from app.topics import sasl_password

__all__ = ["client_config"]


def client_config(settings: Settings, client_id: str) -> dict[str, object]:
    """Connection options shared by every librdkafka client of a worker."""
    config: dict[str, object] = {
        "bootstrap.servers": settings.kafka_bootstrap,
        "client.id": client_id,
        # NOTE: librdkafka logs through its own thread to stderr; the worker's
        # logging carries what matters (errors surface as exceptions).
        "log_level": 3,
        # NOTE: librdkafka leaves Nagle's algorithm on by default; with the
        # peer's delayed ACKs a small request waited up to ~40 ms on loopback
        # (the bare pass-through's p50 was 45 ms at 100 TPS with it on).
        "socket.nagle.disable": True,
        # NOTE: when a partition's leader is lost, librdkafka asks for metadata
        # again, backing off exponentially up to this cap (default 1 s; it caps
        # every retry's backoff) until a new leader shows: up to a second more
        # of an open transaction waiting after the cluster has already moved
        # the leadership. With it and the brokers' 2 s session (tools/stack),
        # losing a broker of the 3-node stack stopped decisions for 2.1-2.5 s,
        # not 5.6 s (RELIABILITY.md).
        "retry.backoff.max.ms": 250,
        # NOTE: librdkafka looks for a new transaction coordinator only after a
        # failed reconnect to the old one, and spaces reconnects to a dead broker
        # doubling up to reconnect.backoff.max.ms (default 10 s): on the 3-node
        # stack a worker whose coordinator was lost asked again only every
        # 1.0-1.3 s, and each answer named the dead node until it was fenced.
        # Capped at 250 ms, it asks every 0.6-0.75 s (the 500 ms query timer is
        # librdkafka's own), so it finds the new coordinator within ~0.75 s of
        # the move. A failed connect every 250 ms to a dead broker costs nothing
        # worth saving.
        "reconnect.backoff.ms": 50,
        "reconnect.backoff.max.ms": 250,
    }
    if settings.kafka_ssl and settings.kafka_ssl_cafile:
        config["ssl.ca.location"] = str(settings.kafka_ssl_cafile)
    if settings.kafka_sasl_mechanism:
        config["security.protocol"] = "SASL_SSL" if settings.kafka_ssl else "SASL_PLAINTEXT"
        config["sasl.mechanism"] = settings.kafka_sasl_mechanism
        config["sasl.username"] = settings.kafka_sasl_username or ""
        config["sasl.password"] = sasl_password(settings) or ""
    elif settings.kafka_ssl:
        config["security.protocol"] = "SSL"
    return config
