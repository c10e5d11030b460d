"""The faust app every worker of this project runs on: broker, credentials, web.

Shared by the scoring worker (:mod:`agents.wiring`), the feedback loop
(:mod:`agents.feedback`) and the benchmark's pass-through, so all of them reach
the broker in exactly the same way. Agents are added by those modules.
"""

from __future__ import annotations

import sys
from typing import Any

import faust

from app.seams import install_commit_past_gaps, install_read_committed, install_wait_topic_visible
from app.settings import Settings
from app.topics import kafka_auth

__all__ = ["RAW", "base_app"]

#: Topic options for raw bytes in and out: every record this project reads or
#: writes is decoded and encoded by its own code (orjson, the contract).
RAW: dict[str, Any] = {"key_type": bytes, "value_type": bytes, "key_serializer": "raw", "value_serializer": "raw"}


def _credentials(settings: Settings) -> Any:
    auth: dict[str, Any] = dict(kafka_auth(settings))
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
    install_read_committed()
    install_wait_topic_visible()
    install_commit_past_gaps()  # feedback is transactional: its markers must not hold the commits back
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
