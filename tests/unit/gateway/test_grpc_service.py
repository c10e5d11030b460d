"""The gRPC service in process, over a real grpc.aio channel, with the broker faked.

A :class:`gateway.rest.Gateway` with an in-memory rate limiter and a fake
producer that either "decides" (hands the worker's JSON decision to the real
:class:`gateway.replies.Replies`, as its consumer would), drops the
transaction (no decision comes), or fails (the broker is down). What each
outcome becomes over gRPC: status code, ``google.rpc.ErrorInfo`` reason (the
contract's code), ``RetryInfo``; and a stream answered out of order.
(tests/integration/test_grpc.py runs the same against the real broker and worker.)
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import UTC, datetime
from typing import Any

import grpc
import orjson
import pytest
from google.rpc import error_details_pb2, status_pb2
from grpc_status import rpc_status

from app.contract import Decision
from app.settings import Settings
from gateway.grpc_codec import decision_dict, transaction_message
from gateway.grpc_gen.fraud.v1 import fraud_pb2, fraud_pb2_grpc
from gateway.grpc_server import start_server
from gateway.replies import Replies
from gateway.rest import REFUSAL_STATUS, ApiKeys, Gateway, Signer, refusal_response
from pipeline.auth import verify
from pipeline.ratelimit import InMemoryRateLimiter

KEY = bytes(range(32))
USER_BURST = 3


class FakeProducer:
    """``send_and_wait`` as aiokafka's; ``mode`` says what the "pipeline" does with it."""

    def __init__(self, replies: Replies, settings: Settings) -> None:
        self.replies, self.settings = replies, settings
        self.mode = "decide"
        self.sent: list[tuple[bytes, dict[str, bytes]]] = []
        self.delay_s = 0.0

    async def send_and_wait(self, topic: str, value: bytes, key: bytes, headers: list[tuple[str, bytes]]) -> None:
        if self.mode == "fail":
            raise ConnectionError("broker down")
        self.sent.append((value, dict(headers)))
        if self.mode == "decide":
            asyncio.get_running_loop().call_later(self.delay_s, self._decide, value, dict(headers))

    def _decide(self, value: bytes, headers: dict[str, bytes]) -> None:
        tx = orjson.loads(value)
        decision = Decision(
            transaction_id=tx["transaction_id"], user_id=tx["user_id"], fraud_score=0.25, action="approve",
            explanation=["fine"], model_version="m-1", rules_version="r-1", feature_age_s=1.5,
            latency_ms={"total": 2.0}, correlation_id=headers["correlation-id"].decode(), decided_at=time.time(),
        )  # fmt: skip
        self.replies.deliver(self.settings.topic_decisions, orjson.dumps(decision.to_dict()))


def tx(n: int, **over: Any) -> dict[str, Any]:
    now = datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")
    doc = {"transaction_id": f"t-{n}", "user_id": f"u-{n}", "amount": 10.0 + n, "merchant_id": "m-1",
           "timestamp": now, "currency": "EUR"}  # fmt: skip
    doc.update(over)
    return {k: v for k, v in doc.items() if v is not None}


def serve(test: Callable[[fraud_pb2_grpc.FraudScoringStub, FakeProducer], Awaitable[None]]) -> None:
    async def main() -> None:
        settings = Settings(gateway_timeout_s=5.0)
        replies = Replies(settings)  # not started: the fake producer delivers to it directly
        gateway = Gateway(settings, ApiKeys({"acme": KEY}), ApiKeys({}), Signer("gateway", KEY))
        gateway.limiter = InMemoryRateLimiter(1000.0, 1000.0, 0.01, USER_BURST)
        gateway.replies = replies
        producer = gateway.producer = FakeProducer(replies, settings)
        server = await start_server(gateway, "127.0.0.1", 0)
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
                await test(fraud_pb2_grpc.FraudScoringStub(channel), producer)
        finally:
            await server.stop(0)

    asyncio.run(main())


AUTH = (("x-api-key", KEY.hex()),)


def details(err: grpc.aio.AioRpcError) -> tuple[status_pb2.Status, error_details_pb2.ErrorInfo]:
    status = rpc_status.from_call(err)
    assert status is not None, err
    info = error_details_pb2.ErrorInfo()
    assert status.details[0].Unpack(info)
    return status, info


async def refused(call: Awaitable[Any]) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call
    return caught.value


def test_score_returns_the_decision_and_signs_the_json_body() -> None:
    async def check(stub: fraud_pb2_grpc.FraudScoringStub, producer: FakeProducer) -> None:
        doc = tx(1)
        decision = await stub.Score(transaction_message(doc), metadata=(("authorization", f"Bearer {KEY.hex()}"),))
        got = decision_dict(decision)
        assert (got["transaction_id"], got["action"], got["feature_age_s"]) == ("t-1", "approve", 1.5)
        value, headers = producer.sent[0]
        assert orjson.loads(value) == doc  # the body a REST client would have sent
        assert got["correlation_id"] == headers["correlation-id"].decode()
        # Signed as the gateway, as REST's messages are: the worker verifies it like any producer's.
        assert verify(value, headers, {"gateway": KEY}, time.time(), 60.0).client_id == "gateway"

    serve(check)


@pytest.mark.parametrize("metadata", [(), (("x-api-key", bytes(32).hex()),), (("authorization", "Basic x"),)])
def test_a_missing_or_unknown_key_is_unauthenticated(metadata: tuple[tuple[str, str], ...]) -> None:
    async def check(stub: fraud_pb2_grpc.FraudScoringStub, producer: FakeProducer) -> None:
        err = await refused(stub.Score(transaction_message(tx(1)), metadata=metadata))
        assert err.code() == grpc.StatusCode.UNAUTHENTICATED
        assert details(err)[1].reason == "unauthenticated"
        assert not producer.sent

    serve(check)


@pytest.mark.parametrize(
    ("over", "code", "field"),
    [
        ({"user_id": None}, "missing_field", "user_id"),
        ({"amount": -1.0}, "out_of_range", "amount"),
        ({"amount": float("inf")}, "out_of_range", "amount"),
        ({"currency": "XXX"}, "unknown_currency", "currency"),
        ({"timestamp": "yesterday"}, "bad_timestamp", "timestamp"),
        ({"timestamp": "2020-01-01T00:00:00Z"}, "timestamp_out_of_window", "timestamp"),
        ({"lat": 1.0}, "inconsistent", "lon"),
        ({"device_id": "d" * 70_000}, "too_large", None),
    ],
)
def test_an_invalid_transaction_is_invalid_argument_with_its_code(over: dict[str, Any], code: str,
                                                                  field: str | None) -> None:  # fmt: skip
    async def check(stub: fraud_pb2_grpc.FraudScoringStub, producer: FakeProducer) -> None:
        err = await refused(stub.Score(transaction_message(tx(1, **over)), metadata=AUTH))
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
        status, info = details(err)
        assert (info.reason, info.domain, info.metadata.get("field")) == (code, "fraud-pipeline", field)
        assert info.metadata["transaction_id"] == "t-1" and status.message == err.details()
        assert not producer.sent

    serve(check)


def test_a_user_over_the_limit_is_resource_exhausted_with_retry_info() -> None:
    async def check(stub: fraud_pb2_grpc.FraudScoringStub, producer: FakeProducer) -> None:
        for n in range(USER_BURST):
            await stub.Score(transaction_message(tx(n, user_id="u-burst")), metadata=AUTH)
        err = await refused(stub.Score(transaction_message(tx(9, user_id="u-burst")), metadata=AUTH))
        assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        status, info = details(err)
        assert (info.reason, info.metadata["field"]) == ("rate_limited", "user_id")
        retry = error_details_pb2.RetryInfo()
        assert status.details[1].Unpack(retry)
        assert 50 < retry.retry_delay.ToTimedelta().total_seconds() <= 100  # one token at 0.01/s

    serve(check)


def test_no_decision_before_the_callers_deadline_is_deadline_exceeded_from_the_gateway() -> None:
    async def check(stub: fraud_pb2_grpc.FraudScoringStub, producer: FakeProducer) -> None:
        producer.mode = "drop"
        started = time.monotonic()
        err = await refused(stub.Score(transaction_message(tx(1)), metadata=AUTH, timeout=1.0))
        waited = time.monotonic() - started
        assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert 0.7 < waited < 1.2, waited  # the caller's deadline, not gateway_timeout_s (5 s)
        _, info = details(err)  # the gateway's own answer, ahead of the caller's timer
        assert info.reason == "decision_timeout" and info.metadata["correlation_id"]

    serve(check)


def test_a_broker_that_refuses_is_unavailable() -> None:
    async def check(stub: fraud_pb2_grpc.FraudScoringStub, producer: FakeProducer) -> None:
        producer.mode = "fail"
        err = await refused(stub.Score(transaction_message(tx(1)), metadata=AUTH))
        assert err.code() == grpc.StatusCode.UNAVAILABLE
        assert details(err)[1].reason == "broker_unavailable"

    serve(check)


def test_a_stream_answers_each_transaction_as_decided_matched_by_id() -> None:
    async def check(stub: fraud_pb2_grpc.FraudScoringStub, producer: FakeProducer) -> None:
        n = 200
        docs = [tx(i) for i in range(n)]
        docs[7] = tx(7, merchant_id=None)  # one invalid: answered with its error, the stream goes on

        async def requests() -> AsyncIterator[fraud_pb2.Transaction]:
            for i, doc in enumerate(docs):
                producer.delay_s = 0.3 * (n - i) / n  # later ones are decided sooner: out of order
                yield transaction_message(doc)

        replies = [r async for r in stub.ScoreStream(requests(), metadata=AUTH)]
        assert len(replies) == n
        by_id = {r.transaction_id: r for r in replies}
        assert set(by_id) == {d["transaction_id"] for d in docs}
        assert [r.sequence for r in replies] != sorted(r.sequence for r in replies)  # not in request order
        for r in replies:
            assert r.sequence == int(r.transaction_id[2:])
            if r.transaction_id == "t-7":
                assert r.WhichOneof("result") == "error"
                assert r.error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
                info = error_details_pb2.ErrorInfo()
                assert r.error.details[0].Unpack(info) and info.reason == "missing_field"
            else:
                assert r.decision.transaction_id == r.transaction_id

    serve(check)


def test_rest_answers_each_refusal_with_its_status_and_body() -> None:
    from gateway.core import Refusal

    limited = refusal_response(Refusal("rate_limited", "rate_limited", "slow down", "user_id", "t-1", retry_after_s=0.2))
    assert (limited.status, limited.headers["Retry-After"]) == (429, "1")
    assert orjson.loads(limited.body) == {
        "error": {"code": "rate_limited", "field": "user_id", "reason": "slow down"}, "transaction_id": "t-1"
    }
    dead = refusal_response(Refusal("dead_lettered", "dead_lettered", "bad_signature", None, "t-1", "c-1"))
    assert dead.status == 502 and dead.headers["X-Correlation-Id"] == "c-1"
    assert orjson.loads(dead.body)["correlation_id"] == "c-1"
    assert set(REFUSAL_STATUS) == {"invalid", "rate_limited", "timeout", "unavailable", "dead_lettered"}


def test_concurrent_rate_checks_share_one_limiter_call_and_get_the_same_answers() -> None:
    from gateway.core import CoalescingLimiter

    class Counting(InMemoryRateLimiter):
        calls: list[int] = []

        async def allow(self, requests: Any) -> Any:
            self.calls.append(len(requests))
            await asyncio.sleep(0.01)  # a round trip: requests arriving meanwhile wait for the next one
            return await super().allow(requests)

    async def main() -> None:
        clock = lambda: 1000.0  # noqa: E731
        inner = Counting(100.0, 100.0, 0.01, 2.0, clock=clock)
        limiter = CoalescingLimiter(inner)
        keys = [("gw:acme", f"gw:u-{i % 3}") for i in range(12)]
        first = asyncio.ensure_future(limiter.allow([keys[0]]))
        await asyncio.sleep(0.001)  # its call is out
        rest = await asyncio.gather(*(limiter.allow([k]) for k in keys[1:]))
        got = [await first, *rest]
        assert inner.calls == [1, 11]  # the first at once, the ones arriving meanwhile together
        alone = InMemoryRateLimiter(100.0, 100.0, 0.01, 2.0, clock=clock)
        expected = [await alone.allow([k]) for k in keys]  # one by one, in the same order
        assert [g[0] for g in got] == [e[0] for e in expected]

        class Broken:
            async def allow(self, requests: Any) -> Any:
                raise ConnectionError("redis down")

        with pytest.raises(ConnectionError):
            await CoalescingLimiter(Broken()).allow([("gw:a", "gw:b")])

    asyncio.run(main())


def test_a_stream_without_a_key_fails_unauthenticated_before_reading() -> None:
    async def check(stub: fraud_pb2_grpc.FraudScoringStub, producer: FakeProducer) -> None:
        async def requests() -> AsyncIterator[fraud_pb2.Transaction]:
            yield transaction_message(tx(1))

        with pytest.raises(grpc.aio.AioRpcError) as caught:
            async for _ in stub.ScoreStream(requests()):
                pass
        assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert details(caught.value)[1].reason == "unauthenticated"
        assert not producer.sent

    serve(check)
