"""What the gateway does with one transaction, whatever carried it (REST or gRPC).

    admit: validate ─ rate limit          → Admitted │ Refusal (invalid, rate_limited)
    decide: sign + produce ─ wait reply   → Decided  │ Refusal (timeout, unavailable, dead_lettered)

The transports (:mod:`gateway.rest`, :mod:`gateway.grpc_server`) find the API
client, call these two, and turn a :class:`Refusal` into their own status:
a ``kind`` maps to one HTTP status and one gRPC code, and ``code`` is the
contract's error code in both (gateway/openapi.py lists them). Nothing here
knows HTTP or gRPC, so the two answer the same transaction the same way.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from app.settings import Settings
from gateway.replies import Outcome, Replies
from pipeline.ratelimit import RateDecision
from pipeline.validate import Limits, Rejection, validate

__all__ = [
    "Admitted",
    "CoalescingLimiter",
    "Decided",
    "GatewayParts",
    "Refusal",
    "RefusalKind",
    "admit",
    "coalesced",
    "decide",
]

log = logging.getLogger(__name__)

RefusalKind = Literal["invalid", "rate_limited", "timeout", "unavailable", "dead_lettered"]


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why the gateway answers without a decision.

    ``kind`` picks the transport's status; ``code`` is the contract's error code
    (a validation code, or ``rate_limited``, ``decision_timeout``,
    ``broker_unavailable``, ``dead_lettered``)."""

    kind: RefusalKind
    code: str
    reason: str
    field: str | None = None
    transaction_id: str | None = None
    correlation_id: str | None = None
    """Set once the transaction was produced (REST's error body carries it then)."""
    retry_after_s: float = 0.0
    """``rate_limited``: the wait until a retry would pass."""


@dataclass(frozen=True, slots=True)
class Admitted:
    transaction_id: str
    user_id: str


@dataclass(frozen=True, slots=True)
class Decided:
    record: dict[str, Any]
    """The decision as the worker wrote it (the JSON contract's Decision)."""
    correlation_id: str


class Signs(Protocol):
    def headers(self, value: bytes) -> list[tuple[str, bytes]]: ...


class GatewayParts(Protocol):
    """What the core needs of :class:`gateway.rest.Gateway` (typed here: the core cannot import it back)."""

    settings: Settings
    producer: Any
    replies: Replies | None

    # NOTE: read-only, so the gateway's own Signer satisfies it (a settable
    # protocol attribute would have to be declared as exactly ``Signs``).
    @property
    def signer(self) -> Signs: ...

    @property
    def limits(self) -> Limits: ...

    async def rate(self, api_client: str, user_id: str) -> RateDecision | None: ...


class CoalescingLimiter:
    """One rate-limiter call for every request that arrives while the previous call is out.

    The limiter decides a batch in order, as it would the same requests one by
    one, in one Redis round trip. With requests in flight together (concurrent
    REST clients, a gRPC stream) that round trip was the gateway's largest cost
    per request (a fifth of its CPU at 300 TPS on one stream); a lone request
    goes out at once, so an idle gateway adds no wait."""

    def __init__(self, limiter: Any) -> None:
        self.limiter = limiter
        self._queue: list[tuple[tuple[str, str], asyncio.Future[RateDecision]]] = []
        self._draining = False
        self._task: asyncio.Task[None] | None = None

    async def allow(self, requests: Sequence[tuple[str, str]]) -> list[RateDecision]:
        loop = asyncio.get_running_loop()
        futures = []
        for request in requests:
            future: asyncio.Future[RateDecision] = loop.create_future()
            self._queue.append((request, future))
            futures.append(future)
        if not self._draining:
            self._draining = True
            self._task = loop.create_task(self._drain())  # referenced: a bare task may be collected
        return list(await asyncio.gather(*futures))

    async def _drain(self) -> None:
        try:
            while self._queue:
                batch, self._queue = self._queue, []
                try:
                    decisions = await self.limiter.allow([request for request, _ in batch])
                    answers = list(zip(batch, decisions, strict=True))
                except Exception as exc:  # each waiter sees it (the gateway then admits: fail open)
                    for _, future in batch:
                        if not future.done():
                            future.set_exception(exc)
                    continue
                for (_, future), decision in answers:
                    if not future.done():  # a waiter that gave up is not answered
                        future.set_result(decision)
        finally:
            self._draining = False


_coalescing: weakref.WeakKeyDictionary[Any, CoalescingLimiter] = weakref.WeakKeyDictionary()


def coalesced(limiter: Any) -> CoalescingLimiter:
    """The one :class:`CoalescingLimiter` in front of ``limiter``."""
    found = _coalescing.get(limiter)
    if found is None:
        found = _coalescing[limiter] = CoalescingLimiter(limiter)
    return found


async def admit(gw: GatewayParts, api_client: str, raw: bytes, now: float) -> Admitted | Refusal:
    """Check what can be checked before the transaction costs a produce: the contract, then the rate."""
    checked = validate(raw, now, gw.limits)
    if isinstance(checked, Rejection):
        return Refusal("invalid", checked.code, checked.reason, checked.field, checked.transaction_id)
    verdict = await gw.rate(api_client, checked.user_id)
    if verdict is not None and not verdict.allowed:
        who = "API client" if verdict.bucket == "client" else "user"
        return Refusal(
            "rate_limited", "rate_limited", f"the {who} is over its rate limit; retry after {verdict.retry_after_s:.3f} s",
            field="user_id" if verdict.bucket == "user" else None, transaction_id=checked.transaction_id,
            retry_after_s=verdict.retry_after_s,
        )  # fmt: skip
    return Admitted(checked.transaction_id, checked.user_id)


async def decide(gw: GatewayParts, raw: bytes, admitted: Admitted, timeout: float) -> Decided | Refusal:
    """Produce one admitted transaction (``raw``, as validated) and wait for what became of it.

    One deadline, ``timeout``, covers the produce and the wait: a broker that
    hangs must not hold the caller for the producer's own 40 s. REST passes
    ``gateway_timeout_s``; gRPC the caller's own deadline (capped by it)."""
    assert gw.producer is not None and gw.replies is not None
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    transaction_id = admitted.transaction_id
    correlation = uuid.uuid4().hex
    reply = gw.replies.expect(correlation)
    try:
        headers = [("correlation-id", correlation.encode()), *gw.signer.headers(raw)]
        send = gw.producer.send_and_wait(
            gw.settings.topic_transactions, raw, key=admitted.user_id.encode(), headers=headers
        )
        await asyncio.wait_for(send, timeout)
        outcome: Outcome = await asyncio.wait_for(asyncio.shield(reply), max(0.0, deadline - loop.time()))
    except TimeoutError:
        return Refusal(
            "timeout", "decision_timeout",
            f"no decision for {transaction_id} within {timeout:g} s; it may still be decided: resend the "
            "same transaction (same transaction_id) to get its decision",
            transaction_id=transaction_id, correlation_id=correlation,
        )  # fmt: skip
    except Exception as exc:  # the producer gave up: the transaction did not enter
        log.warning("producing %s failed: %r", transaction_id, exc)
        return Refusal(
            "unavailable", "broker_unavailable", f"the broker did not accept the transaction: {exc!r}",
            transaction_id=transaction_id, correlation_id=correlation,
        )  # fmt: skip
    finally:
        gw.replies.forget(correlation)
    if outcome.kind == "dead_letter":
        error = outcome.record.get("error") or {}
        return Refusal(
            "dead_lettered", "dead_lettered",
            f"the pipeline dead-lettered the transaction: {error.get('code')}: {error.get('reason')}",
            field=error.get("field"), transaction_id=transaction_id, correlation_id=correlation,
        )  # fmt: skip
    return Decided(outcome.record, correlation)
