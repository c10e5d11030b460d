"""The faust app every worker of this project runs on: broker, credentials, web.

Shared by the scoring worker (:mod:`agents.wiring`), the feedback loop
(:mod:`agents.feedback`) and the benchmark's pass-through, so all of them reach
the broker in exactly the same way. Agents are added by those modules.
"""

from __future__ import annotations

import sys
import warnings
from typing import Any

import faust
from faust.exceptions import AlreadyConfiguredWarning

from app.seams import install_wait_topic_visible
from app.settings import Settings
from app.topics import cluster_replicas, kafka_auth

__all__ = ["RAW", "ProjectApp", "base_app"]

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


class ProjectApp(faust.App):
    """A faust app whose own topics get the replicas of the project's.

    faust creates its own topics at start (the assignor's leader topic; a
    table's changelog or a ``group_by``'s repartition topic, which no worker
    declares now) with ``topic_replication_factor`` (faust's default 1): on the
    3-broker stack a lost broker would take them with it. The factor is the
    project topics' (``replication_factor``, else 3 on a cluster of 3 or more
    brokers), asked of the cluster when the app first starts, before any of
    those topics is declared (``on_first_start`` runs before faust starts its
    tables and assignor); building the app stays free of network calls.
    """

    def __init__(self, settings: Settings, **options: Any) -> None:
        super().__init__(settings.app_id, **options)
        self.project_settings = settings

    async def on_first_start(self) -> None:
        await super().on_first_start()
        replicas = await cluster_replicas(self.project_settings)
        with warnings.catch_warnings():
            # faust warns on any change after its first read of a key; nothing
            # has declared a topic yet, so every declaration sees this value.
            warnings.simplefilter("ignore", AlreadyConfiguredWarning)
            self.conf.topic_replication_factor = replicas


def base_app(settings: Settings) -> faust.App:
    """A faust app configured for this project's broker settings, without agents.

    Shared by the scoring app and the benchmark's pass-through, so the two
    reach the broker in exactly the same way.
    """
    install_wait_topic_visible()
    sys.setswitchinterval(settings.gil_switch_interval_s)
    app = ProjectApp(
        settings,
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
        # Our topics already exist (ensure_topics); faust declares only its
        # own (the assignor's leader topic).
        topic_allow_declare=True,
    )
    return app
