"""The gateway's gRPC service, beside REST in the same process (``fraud-pipeline gateway --grpc-port``).

    Score(Transaction) → Decision                      one call, one decision
    ScoreStream(stream Transaction) → stream ScoreReply  many in flight, answered as decided

Both go through :mod:`gateway.core`, as ``POST /v1/transactions`` does: the
same API keys, validation, rate limits, signing, produce and reply wait, on the
same producer and reply reader (:class:`gateway.rest.Gateway`). A transaction
message becomes the JSON body a REST client would send (:mod:`gateway.grpc_codec`).

Errors (docs/grpc.md has the table): the call's status code, with a
``google.rpc.Status`` in the ``grpc-status-details-bin`` trailer holding a
``google.rpc.ErrorInfo`` whose ``reason`` is the contract's error code (the
code of REST's error body) and, for rate limits, a ``google.rpc.RetryInfo``.
On a stream, a transaction without a decision is answered with that same
status in its :class:`ScoreReply`; the stream goes on.

The caller's deadline bounds the wait (capped by ``gateway_timeout_s``, REST's
timeout, which is also the wait when the caller sets none). The gateway answers
``DEADLINE_EXCEEDED`` itself a little before the deadline, so the caller gets
the reason and the correlation id rather than a bare local timeout.

Also served: the standard health service (``grpc.health.v1.Health``; SERVING
while the broker producer and the reply reader run, as ``/healthz``) and server
reflection (``grpcurl`` lists and describes the services without the .proto).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any

import grpc
from google.protobuf import any_pb2, duration_pb2
from google.rpc import error_details_pb2, status_pb2
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from grpc_status import rpc_status

from gateway.core import Decided, Refusal, RefusalKind, admit, decide
from gateway.grpc_codec import decision_message, transaction_json
from gateway.grpc_gen.fraud.v1 import fraud_pb2, fraud_pb2_grpc
from gateway.rest import Gateway
from pipeline.validate import MAX_ID_LEN

__all__ = [
    "DOMAIN",
    "GRPC_CODE",
    "SERVICE_NAME",
    "FraudScoring",
    "GrpcServer",
    "grpc_lifecycle",
    "refusal_status",
    "start_server",
]

log = logging.getLogger(__name__)

SERVICE_NAME = fraud_pb2.DESCRIPTOR.services_by_name["FraudScoring"].full_name
#: ``google.rpc.ErrorInfo.domain`` of every error this service sends.
DOMAIN = "fraud-pipeline"
#: gRPC code of each kind of refusal (REST's statuses: gateway/rest.py REFUSAL_STATUS).
#: A dead letter is INTERNAL: the gateway's own message was refused by the workers
#: (a signing key they do not know, say), nothing the caller did or can retry past.
GRPC_CODE: dict[RefusalKind, grpc.StatusCode] = {
    "invalid": grpc.StatusCode.INVALID_ARGUMENT,
    "rate_limited": grpc.StatusCode.RESOURCE_EXHAUSTED,
    "timeout": grpc.StatusCode.DEADLINE_EXCEEDED,
    "unavailable": grpc.StatusCode.UNAVAILABLE,
    "dead_lettered": grpc.StatusCode.INTERNAL,
}
#: Transactions one stream may have in flight; past it the gateway stops reading
#: the stream until one is answered, and HTTP/2 flow control holds the sender.
STREAM_WINDOW = 1024
#: How much sooner than the caller's deadline the gateway gives up and answers
#: DEADLINE_EXCEEDED itself (at most this, at most a tenth of the time left):
#: room for that answer to arrive before the caller's own timer fires.
DEADLINE_MARGIN_S = 0.2
#: How often the health status follows the producer and the reply reader.
HEALTH_POLL_S = 1.0
#: Seconds a stopping server lets calls in flight finish.
STOP_GRACE_S = 5.0


def _pack(message: Any) -> any_pb2.Any:
    packed = any_pb2.Any()
    packed.Pack(message)
    return packed


def _status(code: grpc.StatusCode, reason: str, message: str, metadata: dict[str, str | None],
            retry_after_s: float | None = None) -> status_pb2.Status:  # fmt: skip
    info = error_details_pb2.ErrorInfo(
        reason=reason, domain=DOMAIN, metadata={k: v for k, v in metadata.items() if v is not None}
    )
    details = [_pack(info)]
    if retry_after_s is not None:
        delay = duration_pb2.Duration()
        delay.FromNanoseconds(max(0, round(retry_after_s * 1e9)))
        details.append(_pack(error_details_pb2.RetryInfo(retry_delay=delay)))
    return status_pb2.Status(code=code.value[0], message=message, details=details)


def refusal_status(refusal: Refusal) -> status_pb2.Status:
    """The ``google.rpc.Status`` of a refusal: its code, reason and ids, and the retry delay of a rate limit."""
    metadata = {"field": refusal.field, "transaction_id": refusal.transaction_id,
                "correlation_id": refusal.correlation_id}  # fmt: skip
    retry = refusal.retry_after_s if refusal.kind == "rate_limited" else None
    return _status(GRPC_CODE[refusal.kind], refusal.code, refusal.reason, metadata, retry)


UNAUTHENTICATED = _status(
    grpc.StatusCode.UNAUTHENTICATED, "unauthenticated",
    "missing or unknown API key: send the metadata 'x-api-key: <key>' (or 'authorization: Bearer <key>')", {},
)  # fmt: skip


def presented_key(metadata: Iterable[tuple[str, Any]] | None) -> str | None:
    """``x-api-key: <key>`` or ``authorization: Bearer <key>`` (REST's headers; gRPC keys are lower case)."""
    found: dict[str, str] = {}
    for key, value in metadata or ():
        if isinstance(value, str):
            found.setdefault(key, value)
    scheme, _, token = found.get("authorization", "").partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        return token.strip()
    return found.get("x-api-key") or None


class FraudScoring(fraud_pb2_grpc.FraudScoringServicer):
    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway

    async def _authenticate(self, context: grpc.aio.ServicerContext) -> str:
        client = self.gateway.api_keys.client_of(presented_key(context.invocation_metadata()))
        if client is None:
            await context.abort_with_status(rpc_status.to_status(UNAUTHENTICATED))
        assert client is not None
        return client

    def _budget(self, time_remaining: float | None) -> float:
        """How long one transaction may take: the caller's deadline, less the margin, capped by REST's timeout."""
        cap = self.gateway.settings.gateway_timeout_s
        if time_remaining is None:
            return cap
        return max(0.0, min(cap, time_remaining - min(DEADLINE_MARGIN_S, time_remaining / 10)))

    async def _score(self, api_client: str, message: fraud_pb2.Transaction,
                     time_remaining: Callable[[], float | None]) -> Decided | Refusal:  # fmt: skip
        # Unlike a REST body that did not parse, a message always has its id readable.
        txid = message.transaction_id if message.HasField("transaction_id") else None
        txid = txid if txid and len(txid) <= MAX_ID_LEN else None
        body = transaction_json(message)
        if isinstance(body, tuple):
            field, reason = body
            return Refusal("invalid", "out_of_range", reason, field, txid)
        admitted = await admit(self.gateway, api_client, body, time.time())
        if isinstance(admitted, Refusal):
            return admitted if admitted.transaction_id else dataclasses.replace(admitted, transaction_id=txid)
        # The budget is read after admission: the rate limiter's round trip is spent too.
        return await decide(self.gateway, body, admitted, self._budget(time_remaining()))

    async def Score(self, request: fraud_pb2.Transaction, context: grpc.aio.ServicerContext) -> fraud_pb2.Decision:
        api_client = await self._authenticate(context)
        result = await self._score(api_client, request, context.time_remaining)
        if isinstance(result, Refusal):
            await context.abort_with_status(rpc_status.to_status(refusal_status(result)))
        assert isinstance(result, Decided)
        return decision_message(result.record)

    async def ScoreStream(
        self, request_iterator: AsyncIterator[fraud_pb2.Transaction], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[fraud_pb2.ScoreReply]:
        """Reads transactions while earlier ones wait for their decisions; yields each answer as it comes."""
        api_client = await self._authenticate(context)
        answers: asyncio.Queue[fraud_pb2.ScoreReply | None] = asyncio.Queue()
        window = asyncio.Semaphore(STREAM_WINDOW)
        in_flight: set[asyncio.Task[None]] = set()

        async def answer(sequence: int, message: fraud_pb2.Transaction) -> None:
            try:
                result = await self._score(api_client, message, context.time_remaining)
                reply = fraud_pb2.ScoreReply(transaction_id=message.transaction_id, sequence=sequence)
                if isinstance(result, Refusal):
                    reply.error.CopyFrom(refusal_status(result))
                else:
                    reply.decision.CopyFrom(decision_message(result.record))
                answers.put_nowait(reply)
            finally:
                window.release()

        async def read() -> None:
            sequence = 0
            async for message in request_iterator:
                await window.acquire()
                task = asyncio.create_task(answer(sequence, message))
                in_flight.add(task)
                task.add_done_callback(in_flight.discard)
                sequence += 1
            while in_flight:  # the caller is done sending: answer what is in flight, then end
                await asyncio.gather(*list(in_flight))
            answers.put_nowait(None)

        def end_if_failed(task: asyncio.Task[None]) -> None:
            # A read that failed ends the answers: the await below then re-raises its error.
            if not task.cancelled() and task.exception() is not None:
                answers.put_nowait(None)

        reader = asyncio.create_task(read())
        reader.add_done_callback(end_if_failed)
        try:
            while (reply := await answers.get()) is not None:
                yield reply
            await reader  # re-raises what ended the reading early (the stream then fails)
        finally:
            reader.cancel()
            for task in list(in_flight):
                task.cancel()


async def _follow_health(gateway: Gateway, servicer: health.aio.HealthServicer) -> None:
    """SERVING while the producer and the reply reader run (what ``/healthz`` reports)."""
    last = None
    while True:
        ok = gateway.producer is not None and gateway.replies is not None and gateway.replies.running
        status = health_pb2.HealthCheckResponse.SERVING if ok else health_pb2.HealthCheckResponse.NOT_SERVING
        if status != last:
            for service in ("", SERVICE_NAME):  # "": the server as a whole
                await servicer.set(service, status)
            last = status
        await asyncio.sleep(HEALTH_POLL_S)


@dataclasses.dataclass
class GrpcServer:
    server: grpc.aio.Server
    port: int
    """The port it listens on (the one asked for, or the free one taken for 0)."""
    health: health.aio.HealthServicer
    follower: asyncio.Task[None]

    async def stop(self, grace: float = STOP_GRACE_S) -> None:
        self.follower.cancel()
        await asyncio.gather(self.follower, return_exceptions=True)
        await self.health.enter_graceful_shutdown()  # NOT_SERVING: balancers drain it first
        await self.server.stop(grace)


async def start_server(gateway: Gateway, host: str, port: int) -> GrpcServer:
    """Serve gRPC on ``host:port`` (0: any free port) for a started gateway."""
    # SO_REUSEPORT is grpc's default on Linux: a second gateway on a taken port
    # would then share it silently instead of failing to start.
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    fraud_pb2_grpc.add_FraudScoringServicer_to_server(FraudScoring(gateway), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME)
    reflection.enable_server_reflection(names, server)
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise OSError(f"gRPC: cannot listen on {host}:{port}")
    await server.start()
    follower = asyncio.create_task(_follow_health(gateway, health_servicer), name="grpc-health")
    log.info("gateway gRPC listening on %s:%d (%s, health, reflection)", host, bound, SERVICE_NAME)
    return GrpcServer(server, bound, health_servicer, follower)


def grpc_lifecycle(gateway: Gateway, host: str, port: int) -> Callable[[Any], Any]:
    """An aiohttp ``cleanup_ctx`` entry: serve gRPC while the REST app runs (after the gateway started)."""

    async def serve(_: Any) -> AsyncIterator[None]:
        grpc_server = await start_server(gateway, host, port)
        yield
        await grpc_server.stop()

    return serve
