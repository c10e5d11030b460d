"""The REST gateway: ``POST /v1/transactions`` answers with the pipeline's decision.

    request ─ API key ─ validate ─ rate limit ─ sign + produce to transactions ─┐
    response ◄─ decision (200) │ dead letter (502) │ timeout (504) ◄─ Replies ◄─┘ (decisions, DLQ)

A separate process (``fraud-pipeline gateway --port 8080``) in front of the
workers, for payment systems without a Kafka client. It checks what it can
before the message costs a produce (key, contract, rate), then produces the
body exactly as received, keyed by ``user_id`` and *signed* with the gateway's
own producer key (:mod:`pipeline.auth`), so workers that accept only signed
traffic accept it. The reply is correlated by id (:mod:`gateway.replies`), not with
faust's ``agent.ask()`` (misrouted inside ``take()``). Those steps are
:mod:`gateway.core`, shared with the gRPC service (:mod:`gateway.grpc_server`,
served by the same process: :mod:`gateway.serve`).

The analyst review page (``GET /review``) and its two JSON endpoints live here
too (:mod:`gateway.review`); they take *analyst* keys, a separate set, so a payment
client's key cannot label transactions.

Status codes: 200 decision · 400 invalid (validation code) · 401 no/unknown key
· 429 over a rate limit (``Retry-After``) · 502 dead-lettered · 503 broker
unavailable · 504 no decision in ``gateway_timeout_s``.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import logging
import math
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
from aiohttp import web
from aiokafka import AIOKafkaProducer
from pydantic import SecretStr

from app import redis_client
from app.errors import ConfigError
from app.redis_keys import gateway_bucket_ids
from app.settings import Settings
from app.topics import ensure_topics, kafka_auth
from gateway.core import Refusal, admit, coalesced, decide
from gateway.openapi import openapi_document
from gateway.replies import Replies
from gateway.review import ReviewQueue, ReviewReader, analyst_label
from pipeline.auth import ClientKeys, sign
from pipeline.decision_signing import DecisionVerifier, verifier_from_settings
from pipeline.labels import LABELS
from pipeline.ratelimit import RateDecision, RedisRateLimiter
from pipeline.validate import Limits

__all__ = ["ApiKeys", "Gateway", "build_app"]

log = logging.getLogger(__name__)

STATIC = Path(__file__).parent / "static"
_HEX_RE = re.compile(r"(?:[0-9a-fA-F]{2})+")
#: A Redis hiccup must not hold a payment: past this the request is admitted (fail open).
RATE_LIMIT_TIMEOUT_S = 0.25
#: Redis connections per gateway process (per node on a cluster): one per
#: request in flight at once.
GATEWAY_REDIS_CONNECTIONS = 100


# --- API keys ------------------------------------------------------------------------------


class ApiKeys:
    """Who an API key belongs to. Keys are the producer keys' format (:class:`ClientKeys`):
    a caller presents the key text, hex or base64, as written in the keys file.

    Lookup is by SHA-256 of the key bytes, so no key is compared byte by byte
    (no timing leak) and none is kept in a form a repr could show.
    """

    def __init__(self, keys: Mapping[str, bytes]) -> None:
        self._by_digest = {hashlib.sha256(key).digest(): client for client, key in keys.items()}

    @classmethod
    def load(cls, path: Path | None, spec: str | None, what: str) -> ApiKeys:
        from_file = ClientKeys.from_file(path) if path is not None else ClientKeys()
        from_env = ClientKeys.parse(spec, what) if spec else ClientKeys()
        return cls({**from_file, **from_env})

    def client_of(self, presented: str | None) -> str | None:
        key = _key_bytes(presented) if presented else None
        return self._by_digest.get(hashlib.sha256(key).digest()) if key else None

    def __len__(self) -> int:
        return len(self._by_digest)


def _key_bytes(text: str) -> bytes | None:
    """Decode a presented key as the keys file is read: hex digit pairs as hex, else base64."""
    text = text.strip()
    try:
        if _HEX_RE.fullmatch(text):
            return bytes.fromhex(text)
        return base64.b64decode(text.replace("-", "+").replace("_", "/") + "=" * (-len(text) % 4), validate=True)
    except (ValueError, binascii.Error):
        return None


def presented_key(request: web.Request) -> str | None:
    """``Authorization: Bearer <key>`` or ``X-API-Key: <key>``."""
    auth = request.headers.get("Authorization", "")
    scheme, _, token = auth.partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        return token.strip()
    return request.headers.get("X-API-Key") or None


# --- responses -----------------------------------------------------------------------------


def error_response(
    status: int, code: str, reason: str, *, field: str | None = None, headers: Mapping[str, str] | None = None,
    **extra: Any,
) -> web.Response:  # fmt: skip
    body = {"error": {"code": code, "field": field, "reason": reason}, **extra}
    return web.Response(status=status, body=orjson.dumps(body), content_type="application/json", headers=headers)


def json_response(doc: Any, status: int = 200, headers: Mapping[str, str] | None = None) -> web.Response:
    return web.Response(status=status, body=orjson.dumps(doc), content_type="application/json", headers=headers)


def unauthorized(what: str) -> web.Response:
    return error_response(
        401, "unauthenticated",
        f"missing or unknown {what}: send 'Authorization: Bearer <key>' or 'X-API-Key: <key>'",
        headers={"WWW-Authenticate": 'Bearer realm="fraud-pipeline"'},
    )  # fmt: skip


def retry_after_header(seconds: float) -> str:
    """Retry-After is whole seconds; rounding down would invite a retry that fails again."""
    return str(max(1, math.ceil(seconds)))


# --- the gateway -----------------------------------------------------------------------


class Signer:
    """Signs produced messages as the gateway's producer client.

    ``signed-at`` is strictly increasing per process: two identical bodies sent
    in the same millisecond would otherwise carry the same signature, and the
    worker's replay guard would dead-letter the second as a replay.
    """

    def __init__(self, client_id: str, key: bytes | None) -> None:
        self.client_id = client_id
        self.key = key
        self._last_ms = 0

    def headers(self, value: bytes) -> list[tuple[str, bytes]]:
        if self.key is None:
            return []
        now_ms = max(int(time.time() * 1000), self._last_ms + 1)
        self._last_ms = now_ms
        return list(sign(value, self.client_id, self.key, now_ms).items())


@dataclass
class Gateway:
    """What the handlers share: settings, keys, the producer, the reply reader, the review queue."""

    settings: Settings
    api_keys: ApiKeys
    analyst_keys: ApiKeys
    signer: Signer
    limiter: Any = None  # a RateLimiter; None = no limits
    producer: AIOKafkaProducer | None = None
    replies: Replies | None = None
    review: ReviewQueue | None = None
    review_reader: ReviewReader | None = None
    redis: Any = None
    decision_keys: DecisionVerifier | None = None
    """The public keys whose decisions are answers; None accepts any decision (development)."""

    @classmethod
    def from_settings(cls, settings: Settings) -> Gateway:
        api = ApiKeys.load(settings.gateway_keys_file, _secret(settings.gateway_keys), "FRAUD_GATEWAY_KEYS")
        analysts = ApiKeys.load(
            settings.gateway_analyst_keys_file, _secret(settings.gateway_analyst_keys), "FRAUD_GATEWAY_ANALYST_KEYS"
        )
        producers = ClientKeys.load(settings.client_keys_file, _secret(settings.client_keys))
        key = producers.get(settings.gateway_client_id)
        if key is None and not settings.allow_unsigned:
            raise ConfigError(
                f"the gateway signs as producer {settings.gateway_client_id!r}, which has no key in "
                "FRAUD_CLIENT_KEYS_FILE / FRAUD_CLIENT_KEYS (create one with `fraud-pipeline keys "
                f"{settings.gateway_client_id}` and give the same file to the workers)"
            )
        if key is None:
            log.warning("producing UNSIGNED transactions: workers must run with FRAUD_ALLOW_UNSIGNED=true")
        if not len(api):
            log.warning("no API keys (FRAUD_GATEWAY_KEYS_FILE / FRAUD_GATEWAY_KEYS): every transaction gets 401")
        if not len(analysts):
            log.warning("no analyst keys (FRAUD_GATEWAY_ANALYST_KEYS[_FILE]): the review page cannot load data")
        signer = Signer(settings.gateway_client_id, key)
        decision_keys: DecisionVerifier | None = verifier_from_settings(settings)
        if not decision_keys and not settings.allow_unsigned:
            raise ConfigError(
                "no decision public keys: set FRAUD_DECISION_PUBLIC_KEYS_FILE (`fraud-pipeline decision-key` "
                "writes it) or, for development only, FRAUD_ALLOW_UNSIGNED=true"
            )
        if not decision_keys:
            log.warning("!!! no decision public keys: answering with UNVERIFIED decisions (development only) !!!")
            decision_keys = None
        else:
            log.info("accepting decisions signed by keys %s", sorted(decision_keys))
        return cls(
            settings, api, analysts, signer, review=ReviewQueue(settings.gateway_review_limit),
            decision_keys=decision_keys,
        )  # fmt: skip

    @property
    def limits(self) -> Limits:
        s = self.settings
        return Limits(s.max_message_bytes, s.max_future_skew_s, s.max_age_s)

    async def start(self) -> None:
        s = self.settings
        await ensure_topics(s)
        self.producer = AIOKafkaProducer(
            bootstrap_servers=s.kafka_bootstrap, linger_ms=0, acks=1, **kafka_auth(s),
        )  # fmt: skip
        await self.producer.start()
        self.replies = Replies(s, self.decision_keys)
        await self.replies.start()
        if self.review is not None:
            self.review_reader = ReviewReader(s, self.review)
            await self.review_reader.start()
        self.start_redis()

    def start_redis(self) -> None:
        """The rate limiter over the gateway's Redis client (inside the running loop)."""
        s = self.settings
        # One server or a Redis Cluster, as the workers'. Each request in flight
        # holds a connection for one script call; past the pool a request fails
        # open, so the bound is generous (GATEWAY_REDIS_CONNECTIONS).
        self.redis = redis_client.async_client(
            s, timeout_s=RATE_LIMIT_TIMEOUT_S, connect_timeout_s=RATE_LIMIT_TIMEOUT_S,
            max_connections=GATEWAY_REDIS_CONNECTIONS,
        )  # fmt: skip
        self.limiter = RedisRateLimiter(
            self.redis, s.gateway_rate_per_s, s.gateway_burst, s.rate_user_per_s, s.rate_user_burst,
            cluster=redis_client.is_cluster(s),
        )

    async def stop(self) -> None:
        for part in (self.review_reader, self.replies):
            if part is not None:
                await part.stop()
        if self.producer is not None:
            await self.producer.stop()
        if self.redis is not None:
            await self.redis.aclose()

    async def rate(self, api_client: str, user_id: str) -> RateDecision | None:
        """The token buckets' verdict, or None when Redis cannot say (admitted: fail open).

        NOTE: the buckets are namespaced ``gw:`` (app/redis_keys.py): a worker keeps its own per-client
        bucket for the gateway's producer id, and its own per-user bucket; these are
        the gateway's per-API-client and per-user ones, so a refusal here is a 429
        instead of a ``reject`` decision."""
        if self.limiter is None:
            return None
        try:
            decisions = await asyncio.wait_for(
                coalesced(self.limiter).allow([gateway_bucket_ids(api_client, user_id)]), RATE_LIMIT_TIMEOUT_S * 2
            )
            return decisions[0]
        except Exception as exc:
            log.warning("rate limiter unavailable (%r): admitting the request", exc)
            return None


def _secret(value: SecretStr | None) -> str | None:
    return value.get_secret_value() if value else None


def _gateway(request: web.Request) -> Gateway:
    return request.app[GATEWAY]


GATEWAY = web.AppKey("gateway", Gateway)


async def post_transaction(request: web.Request) -> web.Response:
    gw = _gateway(request)
    api_client = gw.api_keys.client_of(presented_key(request))
    if api_client is None:
        return unauthorized("API key")
    raw = await request.read()
    admitted = await admit(gw, api_client, raw, time.time())
    if isinstance(admitted, Refusal):
        return refusal_response(admitted)
    # The body is produced exactly as received (validate() only read it).
    outcome = await decide(gw, raw, admitted, gw.settings.gateway_timeout_s)
    if isinstance(outcome, Refusal):
        return refusal_response(outcome)
    return json_response(outcome.record, headers={"X-Correlation-Id": outcome.correlation_id})


#: HTTP status of each kind of refusal (gRPC's codes: gateway/grpc_server.py).
REFUSAL_STATUS = {"invalid": 400, "rate_limited": 429, "dead_lettered": 502, "unavailable": 503, "timeout": 504}


def refusal_response(refusal: Refusal) -> web.Response:
    """The error body: ``transaction_id`` always, ``correlation_id`` once the transaction was produced."""
    headers: dict[str, str] = {}
    ids: dict[str, str | None] = {"transaction_id": refusal.transaction_id}
    if refusal.kind == "rate_limited":
        headers["Retry-After"] = retry_after_header(refusal.retry_after_s)
    if refusal.correlation_id is not None:
        ids["correlation_id"] = refusal.correlation_id
        if refusal.kind == "dead_lettered":
            headers["X-Correlation-Id"] = refusal.correlation_id
    return error_response(
        REFUSAL_STATUS[refusal.kind], refusal.code, refusal.reason, field=refusal.field, headers=headers or None, **ids
    )


async def get_openapi(request: web.Request) -> web.Response:
    return json_response(openapi_document())


async def get_health(request: web.Request) -> web.Response:
    gw = _gateway(request)
    replies = gw.replies
    ok = replies is not None and replies.running and gw.producer is not None
    doc = {
        "status": "ok" if ok else "unavailable",
        "pending": replies.pending if replies else 0,
        "review_queue": len(gw.review) if gw.review is not None else 0,
        "unverified_decisions": replies.unverified if replies else 0,
    }
    return json_response(doc, status=200 if ok else 503)


async def get_keys(request: web.Request) -> web.Response:
    """The public keys decisions are signed with (SECURITY.md, *Decision signatures*)."""
    gw = _gateway(request)
    return json_response({"keys": gw.decision_keys.published() if gw.decision_keys else []})


async def get_review_page(request: web.Request) -> web.FileResponse:
    return web.FileResponse(STATIC / "review.html", headers={"Cache-Control": "no-store"})


async def get_review_items(request: web.Request) -> web.Response:
    gw = _gateway(request)
    if gw.analyst_keys.client_of(presented_key(request)) is None:
        return unauthorized("analyst key")
    query = request.query
    try:
        limit = max(1, int(query.get("limit", "100")))
        offset = max(0, int(query.get("offset", "0")))
        min_score = float(query["min_score"]) if query.get("min_score") else None
        max_age_s = float(query["max_age_s"]) if query.get("max_age_s") else None
    except ValueError:
        return error_response(
            400, "out_of_range", "limit and offset must be integers, min_score and max_age_s numbers"
        )
    assert gw.review is not None
    page = gw.review.page(limit, offset, min_score=min_score, max_age_s=max_age_s, now=time.time())
    return json_response({**page, "limit": limit})


async def post_label(request: web.Request) -> web.Response:
    gw = _gateway(request)
    analyst = gw.analyst_keys.client_of(presented_key(request))
    if analyst is None:
        return unauthorized("analyst key")
    txid = request.match_info["transaction_id"]
    try:
        body = orjson.loads(await request.read())
    except orjson.JSONDecodeError:
        body = None
    label = body.get("label") if isinstance(body, dict) else None
    if label not in LABELS:
        return error_response(400, "bad_label", 'send {"label": "fraud"} or {"label": "legit"}', field="label")
    assert gw.producer is not None and gw.review is not None
    value = analyst_label(txid, label, gw.review.merchant_of(txid), time.time())
    try:
        await gw.producer.send_and_wait(gw.settings.topic_labels, value, key=txid.encode())
    except Exception as exc:
        return error_response(503, "broker_unavailable", f"the broker did not accept the label: {exc!r}")
    log.info("analyst %s labelled %s %s", analyst, txid, label)
    return json_response(orjson.loads(value))


def build_app(gateway: Gateway) -> web.Application:
    """The aiohttp app; starting it starts the gateway's Kafka and Redis clients."""
    # Room for validate() to see an oversized body and answer too_large itself.
    app = web.Application(client_max_size=max(2 * gateway.settings.max_message_bytes, 1024 * 1024))
    app[GATEWAY] = gateway

    async def lifecycle(_: web.Application) -> Any:
        await gateway.start()
        yield
        await gateway.stop()

    app.cleanup_ctx.append(lifecycle)
    app.router.add_post("/v1/transactions", post_transaction)
    app.router.add_get("/v1/review/decisions", get_review_items)
    app.router.add_post("/v1/review/{transaction_id}/label", post_label)
    app.router.add_get("/v1/keys", get_keys)
    app.router.add_get("/openapi.json", get_openapi)
    app.router.add_get("/healthz", get_health)
    app.router.add_get("/review", get_review_page)
    return app
