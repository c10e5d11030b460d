"""Settings: one frozen object, read from ``FRAUD_*`` environment variables.

``KAFKA_BOOTSTRAP`` and ``REDIS_URL`` (unprefixed) are honoured too, so the
whole project, tests included, points at existing servers when they are set.
"""

from __future__ import annotations

import difflib
import logging
import os
from collections.abc import Mapping
from functools import lru_cache
from pathlib import Path
from typing import Literal

from pydantic import AliasChoices, Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict

from app.errors import ConfigError

__all__ = ["OTHER_VARIABLES", "Settings", "check_environment", "get_settings", "unknown_variables"]

log = logging.getLogger(__name__)

PREFIX = "FRAUD_"

#: ``FRAUD_*`` variables that are read outside :class:`Settings` (by the tests and
#: the tooling, docs/configuration.md), so the check below accepts them.
OTHER_VARIABLES = frozenset({
    "FRAUD_FAULT_REPORT", "FRAUD_REVIEW_SCREENSHOT", "FRAUD_KAFKA_LIB", "FRAUD_UNKNOWN_ENV",
})  # fmt: skip


class Settings(BaseSettings):
    # env_ignore_empty: an empty variable is an unset one, so docker-compose.yml's
    # optional `${NAME:-}` pass-throughs leave a setting at its default (an empty
    # password file path would otherwise name the current directory).
    model_config = SettingsConfigDict(
        env_prefix="FRAUD_", frozen=True, extra="ignore", populate_by_name=True, env_ignore_empty=True
    )

    # --- connections -------------------------------------------------------
    kafka_bootstrap: str = Field(
        "127.0.0.1:19092",
        validation_alias=AliasChoices("FRAUD_KAFKA_BOOTSTRAP", "KAFKA_BOOTSTRAP", "kafka_bootstrap"),
    )
    """Kafka bootstrap servers, ``host:port[,host:port]``. The default is the local stack."""

    redis_url: str = Field(
        "redis://127.0.0.1:16379/0",
        validation_alias=AliasChoices("FRAUD_REDIS_URL", "REDIS_URL", "redis_url"),
    )
    """Online feature store. The default is the local stack's redis-server.
    ``redis+cluster://host:port`` (or ``FRAUD_REDIS_CLUSTER``) for a Redis Cluster."""

    redis_cluster: bool = False
    """Treat ``redis_url`` as one node of a Redis Cluster (app/redis_client.py)."""

    redis_username: str | None = None
    """The Redis ACL user this process connects as (SECURITY.md, *Redis users*); unset: ``default``."""

    redis_password: SecretStr | None = None
    redis_password_file: Path | None = None
    """The ACL user's password, from the environment or a file (one line); set one of the two."""

    redis_ssl_cafile: Path | None = None
    """PEM file of the CA(s) that signed Redis's certificate, for a ``rediss://`` URL
    (TLS) under a private CA; unset: the system bundle. Ignored for ``redis://``."""

    redis_pool_size: int = 8
    """Connections in the worker's Redis pool (one pipeline per batch needs few)."""

    redis_timeout_s: float = 0.05
    """Socket timeout for Redis calls on the hot path: past it the batch degrades."""

    kafka_sasl_mechanism: str | None = None
    """``PLAIN``, ``SCRAM-SHA-256`` or ``SCRAM-SHA-512`` to authenticate to Kafka."""

    kafka_sasl_username: str | None = None
    kafka_sasl_password: SecretStr | None = None
    kafka_sasl_password_file: Path | None = None
    """A file holding the SASL password (used when ``kafka_sasl_password`` is unset):
    the secure local stack writes one per role (``tools/stack/``)."""

    kafka_ssl: bool = False
    """Use TLS for the broker connection (CA: ``kafka_ssl_cafile``, else the system bundle)."""

    kafka_ssl_cafile: Path | None = None
    """PEM file of the CA(s) that signed the broker's certificate (a private CA)."""

    # --- producers: authentication and rate limits ------------------------
    client_keys_file: Path | None = None
    """JSON ``{"clients": {"<client-id>": "<hex or base64 key>"}}``: who may produce."""

    client_keys: SecretStr | None = None
    """``id:key,id:key`` — the same, from the environment (``FRAUD_CLIENT_KEYS``)."""

    allow_unsigned: bool = False
    """Accept messages without signature headers. For development only; a
    message that carries any signature header is still verified."""

    # --- decision signatures (pipeline/decision_signing.py, SECURITY.md) -----
    decision_signing_key_file: Path | None = None
    """The worker's Ed25519 private key (PEM PKCS#8, or a raw 32-byte seed in hex or
    base64): every decision it produces is signed with it. Without one (nor
    ``decision_signing_key``) a worker refuses to start, unless ``allow_unsigned``
    (development), when it signs with a throwaway key nobody can verify."""

    decision_signing_key: SecretStr | None = None
    """The same key, from the environment (``FRAUD_DECISION_SIGNING_KEY``)."""

    decision_public_keys_file: Path | None = None
    """JSON ``{"keys": [{"key_id": "...", "public_key": "<base64>"}]}``: the public keys
    whose decisions the gateway and the load generator accept (two during a rotation).
    The gateway refuses to start without it unless ``allow_unsigned``."""

    decision_public_keys: str | None = None
    """``<base64 public key>,<base64 public key>``: more accepted keys, from the environment
    (``FRAUD_DECISION_PUBLIC_KEYS``; a container without the file)."""

    auth_window_s: float = 300.0
    """A signature older or newer than this is refused as stale (clock skew + retries)."""

    rate_client_per_s: float = 10_000.0
    rate_client_burst: float = 20_000.0
    """Token bucket per producing client, shared by all workers (Redis)."""

    rate_user_per_s: float = 2.0
    rate_user_burst: float = 30.0
    """Token bucket per user: bursts like card testing hit it; shoppers never do."""

    # --- REST gateway (gateway/rest.py) -----------------------------------------
    gateway_host: str = "127.0.0.1"
    """Where ``fraud-pipeline gateway`` listens (``--host``); ``0.0.0.0`` in a container."""

    gateway_port: int = 8080
    gateway_grpc_port: int = 0
    """Also serve gRPC (``fraud.v1.FraudScoring``, docs/grpc.md) on this port, in the same
    process as REST (``--grpc-port``). 0: off, so no listener opens unless asked for."""

    gateway_keys_file: Path | None = None
    """API clients of ``POST /v1/transactions``: ``{"clients": {"<id>": "<hex or base64 key>"}}``
    (the producer keys' format; ``fraud-pipeline keys <id> --file ...`` writes one). A
    caller presents its key as ``Authorization: Bearer <key>`` or ``X-API-Key``."""

    gateway_keys: SecretStr | None = None
    """``id:key,id:key`` — the same, from the environment (``FRAUD_GATEWAY_KEYS``)."""

    gateway_analyst_keys_file: Path | None = None
    """Analysts of the review page and its endpoints: separate keys, so a payment
    client's key cannot label transactions."""

    gateway_analyst_keys: SecretStr | None = None
    gateway_client_id: str = "gateway"
    """The producer id the gateway signs transactions as; its key must be among the
    producer keys (``FRAUD_CLIENT_KEYS_FILE`` / ``FRAUD_CLIENT_KEYS``) the workers load."""

    gateway_timeout_s: float = 5.0
    """How long a REST call waits for its decision before answering 504."""

    gateway_rate_per_s: float = 200.0
    gateway_burst: float = 400.0
    """Token bucket per API client (Redis, shared by every gateway). Per user the
    gateway also applies ``rate_user_per_s`` / ``rate_user_burst``."""

    gateway_review_limit: int = 500
    """Newest ``review`` decisions the review page keeps in memory."""

    # --- faust app ---------------------------------------------------------
    app_id: str = "fraud-pipeline"
    """Faust app id, and the group of the faust app hosting a scoring worker.
    The scoring workers consume ``transactions`` in group ``<app_id>-score``
    and count ``labels`` into the merchant tally (``<app_id>-merchant-tally``)
    in ``<app_id>-tally``; the feedback loop reads ``feedback`` and ``labels``
    in ``<app_id>-feedback`` (a ``feedback`` worker's faust app is
    ``<app_id>-feedback-host``); the transactional ids start with
    ``<app_id>-score-``."""

    worker_role: Literal["all", "score", "feedback"] = "all"
    """What ``fraud-pipeline worker`` runs. ``all``: scoring and the feedback
    loop in one process (the demo). In production run ``score``
    workers (the decision path only) and one or more ``feedback`` workers (the
    quality join; consumer group ``<app_id>-feedback``): consuming ``feedback``
    in a scoring worker doubles the messages it reads (docs/performance.md)."""

    faust_sensors: bool = False
    """Also serve faust's own Prometheus sensor at ``/metrics``. Off by default:
    it runs per message on the event loop (~3 % of a saturated worker's main
    thread) and its counters read 0 for ``transactions``, which faust does not
    commit (``fraud_*`` metrics cover the decision path)."""

    topic_transactions: str = "transactions"
    topic_decisions: str = "decisions"
    topic_dlq: str = "transactions.dlq"
    topic_monitoring: str = "monitoring"
    topic_feedback: str = "feedback"
    topic_labels: str = "labels"
    partitions: int = 8
    """Partitions of ``transactions`` (and of ``decisions``, where each
    partition's decisions go: its resend index's changelog): the unit of scaling."""

    replication_factor: int = Field(0, ge=0)
    """Replicas of each project topic when ``fraud-pipeline topics`` (or a worker)
    creates it. 0: 3 on a cluster of 3 or more brokers (then also
    ``min.insync.replicas=2``: a write is acknowledged by two brokers, and one
    broker may be lost without stopping writes), 1 on a single broker."""

    consumer_fetch_max_wait_ms: int = 20
    """How long a fetch of the scoring consumer and of the gateway's reply
    reader waits when there is less than ``fetch_min_bytes`` (Kafka answers
    as soon as there is; this bounds how long a new partition assignment or a
    stop waits)."""

    producer_linger_s: float = 0.002
    """Producer linger: a few ms lets one batch's decisions go in one request."""

    producer_compression: Literal["none", "lz4", "zstd", "gzip"] = "none"
    """Compression of the scoring path's produce requests (decisions, feedback,
    monitoring). docs/performance.md has what each costs the worker and the
    broker on this pipeline's records."""

    worker_id: str | None = None
    """This worker's name in its transactional id
    (``<app_id>-score-<topic>-<worker_id>``). Default: host name and
    web port, which stay the same when the worker restarts on the same slot:
    its new producer then aborts the transaction a killed predecessor left
    open at once, instead of the broker after the transaction timeout (an open
    transaction holds back every ``read_committed`` reader of what it wrote).
    Two live workers must never share one (each would fence the other): use a
    pod name or ordinal in orchestrated deployments."""

    session_timeout_s: float = 6.0
    """Consumer group session timeout: how long a worker that died (kill -9)
    holds its partitions before the group moves them."""

    heartbeat_interval_s: float = 1.5
    web_host: str = "127.0.0.1"
    web_port: int = 6066
    """Each worker on one machine needs its own port."""

    gil_switch_interval_s: float = 0.001
    """``sys.setswitchinterval`` for the worker. NOTE: the event loop, the
    thread that makes every blocking librdkafka call (app/eos.py) and the
    model's thread hand the GIL back and forth; with Python's default 5 ms
    interval each hand-off can cost up to 5 ms of a batch's latency."""

    data_dir: Path = Path(".stack/faust")
    """Faust's local table state."""

    # --- scoring -----------------------------------------------------------
    batch_size: int = 128
    """At most this many records per micro-batch: one Redis script, one model
    call. Only reached once a queue has formed (a take returns what is queued):
    then a bigger batch is more work per commit cycle, and the loop waits less
    on the commit (at 3,500 TPS on 2 cores 64 fell behind where 128 and 256
    held: docs/performance.md). Bounded so that a batch of users whose profiles
    are not in the local cache (a cold start, a rebalance) stays well inside
    ``redis_timeout_s``: the batch's Redis call took 10 ms at 128 records, 17
    at 256, against its 50 ms."""

    batch_window_s: float = 0.0
    """The longest a take waits for a micro-batch to fill, counted from the
    last take. 0: a batch is what is queued when the loop comes for it; under
    load that is what arrived while the last batch was scored and committed,
    so batches grow with the rate by themselves (agents/pace.py). Above 0,
    every record at a low rate waits up to this long for others."""

    fetch_min_bytes: int = 1
    """The scoring consumer's ``fetch.min.bytes``: the broker answers a fetch once
    this much is there, or after ``consumer_fetch_max_wait_ms``. Above 1, fewer fetch
    requests for the broker to serve, each decision waiting up to the max wait."""

    commit_interval_s: float = 0.025
    """The longest one Kafka transaction stays open over consecutive batches
    (Kafka Streams' ``commit.interval.ms`` under exactly-once). With
    ``commit_caught_up`` (the default) a transaction spans batches only while
    a queue has formed (takes come back full): the broker's cost per
    transaction (requests, a marker in every partition written) is then paid
    once per interval, however deep the backlog. 0: every batch commits on its
    own."""

    commit_caught_up: bool = True
    """Commit the open transaction as soon as a take comes back with less than
    a full batch (the worker has caught up with its partitions), while the
    next batch is scored: below saturation a decision waits for its own
    batch's commit only, not for a commit interval. false: every transaction
    stays open ``commit_interval_s`` (fewer transactions at low rates, each
    decision waiting up to the interval longer)."""

    commit_settle_s: float = 0.0
    """How long after a commit the next transaction begins, at the soonest
    (only what is left of it once the next batch is scored). The coordinator
    is still writing the last transaction's markers for a few ms after its
    commit is answered, and refuses the next one's requests meanwhile. A
    transaction begins with an offset of the gate group (app/eos.py), whose
    refusal is asked again within a few ms, so no pause is needed: with the
    records first and 3 ms, the p99 was 45-49 ms against 33-40 at 1,000 TPS
    and 56-62 against 50-52 at 2,000, alternated (docs/performance.md). Above 0: fewer transactions at middle rates, each
    decision waiting up to this long more."""

    loop_stall_exit_s: float = 120.0
    """A scoring loop that has not finished a step in this long is stuck where
    no timeout reaches (every step's waits are bounded far below it): the
    worker logs every thread's stack at a third of it and exits (status 70) at
    it, so it is restarted and the group moves its partitions; its open
    transaction is aborted, as after a crash. 0: never."""

    model_budget_ms: float = 50.0
    """Ensemble latency budget per batch; past it decisions fall back to rules."""

    registry_dir: Path = Path("models/registry")
    model_version: str | None = None
    """Model version to serve; unset = the registry's current version."""

    compiled_trees: bool = True
    """Score with the served model's trees compiled to C (built in the
    background on first load, XGBoost serving meanwhile; models/compiled.py).
    False: XGBoost only. Without tl2cgen or a C compiler XGBoost serves anyway."""

    compiled_trees_dir: Path = Path.home() / ".cache" / "fraud-pipeline" / "compiled-trees"
    """Where a worker keeps the compiled libraries, one per model version and
    machine. Loading a library runs its code: the directory must be the
    worker's own (created 0700; one writable by others is refused)."""

    rules_path: Path = Path("config/rules.json")

    decision_cache_ttl_s: int = 3600
    """A resend (same transaction id or same content) within this gets the same decision."""

    decision_cache_redis: bool = False
    """Also keep decisions in Redis and ask it about what the resend index
    has not seen (pipeline/cache.py). Off: the index alone answers (every
    transaction a worker decides is at its home partition, whose index holds
    every decision that partition committed). On for one TTL after upgrading
    from a version that kept decisions only in Redis; Redis failing then
    counts as a miss, never as *provisional*."""

    cache_wait_s: float = 0.15
    """How long a batch retries Redis's decision cache (with
    ``decision_cache_redis``) before it takes the resend index's answer."""

    profile_cache_ttl_s: float = 30.0
    """Local cache of profiles and merchant risk: they change once a day."""

    profile_ttl_s: int = 8 * 86400
    """TTL of materialized profile hashes in Redis."""

    max_message_bytes: int = 64 * 1024
    max_future_skew_s: float = 300.0
    """Transactions stamped further in the future than this are rejected."""

    max_age_s: float = 86400.0
    """Transactions older than this are rejected (the velocity window)."""

    # --- feedback loop and model lifecycle (docs/feedback-loop.md) --------
    reload_check_s: float = 1.0
    """How often a worker reads the registry pointers (CURRENT, SHADOW) and the
    rules file's mtime; a change is loaded in the background and swapped in
    between batches."""

    quality_enabled: bool = True
    """Join labels with feedback in Redis and publish quality to ``monitoring``."""

    quality_every_s: float = 60.0
    """Seconds between ``quality`` records on ``monitoring`` (the group leader sends them)."""

    quality_join_window_s: int = 120 * 86400
    """How long a decision waits in Redis for its label (chargebacks take months)."""

    quality_max_joined: int = 200_000
    """Joined (decision, label) rows kept for the live figures; the oldest go first."""

    drift_window_rows: int = 2000
    """Scored rows per drift window (one ``drift`` record on ``monitoring`` each)."""

    drift_warn_psi: float = 0.25
    """PSI above which a drift record is flagged and a warning logged."""


def _known_variables() -> set[str]:
    names = {PREFIX + name.upper() for name in Settings.model_fields}
    for info in Settings.model_fields.values():
        alias = info.validation_alias
        if isinstance(alias, AliasChoices):
            names |= {c.upper() for c in alias.choices if isinstance(c, str) and c.upper().startswith(PREFIX)}
    return names | OTHER_VARIABLES


def unknown_variables(environ: Mapping[str, str]) -> dict[str, list[str]]:
    """Each ``FRAUD_*`` name in ``environ`` that no setting reads, with the
    closest valid names (possibly none)."""
    known = _known_variables()
    stems = {name[len(PREFIX):]: name for name in known}
    out: dict[str, list[str]] = {}
    for name in sorted(environ):
        upper = name.upper()  # pydantic-settings matches names case-insensitively
        if upper.startswith(PREFIX) and upper not in known:
            # Compared without the prefix, which every name shares.
            close = difflib.get_close_matches(upper[len(PREFIX):], list(stems), n=2, cutoff=0.6)
            out[name] = [stems[c] for c in close]
    return out


def check_environment(environ: Mapping[str, str] | None = None) -> None:
    """Refuse unknown ``FRAUD_*`` variables, naming the closest valid ones.

    NOTE: pydantic ignores an unknown variable, so a typo such as
    ``FRAUD_GATEWAY_RATE_BURST`` (for ``FRAUD_GATEWAY_BURST``) would silently
    leave a limit at its default; the worker, the gateway and the CLI refuse to
    start instead. ``FRAUD_UNKNOWN_ENV=warn`` only logs them (e.g. one env file
    shared with a newer release that has more settings).
    """
    environ = os.environ if environ is None else environ
    unknown = unknown_variables(environ)
    if not unknown:
        return
    parts = [
        f"{name} (did you mean {' or '.join(close)}?)" if close else name for name, close in unknown.items()
    ]
    message = (
        f"unknown setting{'s' if len(parts) > 1 else ''} in the environment: {'; '.join(parts)} "
        "(every setting: docs/configuration.md; FRAUD_UNKNOWN_ENV=warn starts anyway)"
    )
    if environ.get("FRAUD_UNKNOWN_ENV", "").strip().lower() == "warn":
        log.warning("%s", message)
        return
    raise ConfigError(message)


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    check_environment()
    return Settings()
