"""The write-behind decision cache: answers at once, writes in the background."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import pytest

from agents.cache import InMemoryDecisionCache, WriteBehindCache
from app.contract import Transaction


def tx(i: int, transaction_id: str | None = None) -> Transaction:
    return Transaction(
        transaction_id=transaction_id or f"t-{i}", user_id="u-1", amount=10.0, currency="USD",
        merchant_id="m-1", timestamp=1_796_000_000.0 + i,
    )  # fmt: skip


class SlowCache(InMemoryDecisionCache):
    """The in-memory cache, whose writes wait until the test lets them through."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = asyncio.Event()
        self.fail: Exception | None = None
        self.gets: list[list[str]] = []

    async def get_many(self, txs: Sequence[Transaction]) -> list[dict[str, Any] | None]:
        self.gets.append([t.transaction_id for t in txs])
        return await super().get_many(txs)

    async def put_many(self, items: Sequence[tuple[Transaction, dict[str, Any]]]) -> None:
        await self.gate.wait()
        if self.fail is not None:
            raise self.fail
        await super().put_many(items)


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def test_a_decision_is_answered_before_its_write_lands_then_by_the_store() -> None:
    async def go() -> None:
        slow = SlowCache()
        cache = WriteBehindCache(slow, timeout_s=5.0)
        first = {"action": "approve", "fraud_score": 0.1}
        await cache.put_many([(tx(1), first)])  # returns although the write waits
        assert cache.pending == 2  # by id and by content
        # The same id, and the same payment under a new id, are answered from memory.
        hits = await cache.get_many([tx(1), tx(1, transaction_id="t-new"), tx(2)])
        assert hits == [first, first, None]
        assert slow.gets == [["t-2"]]  # only the miss went to the store
        assert await slow.get_many([tx(1)]) == [None]  # not written yet
        slow.gate.set()
        await cache.flush()
        assert cache.pending == 0
        assert await slow.get_many([tx(1)]) == [first]  # now the store answers
        assert await cache.get_many([tx(1)]) == [first]

    run(go())


def test_the_first_decision_for_a_key_stands() -> None:
    async def go() -> None:
        slow = SlowCache()
        cache = WriteBehindCache(slow, timeout_s=5.0)
        first, second = {"action": "approve"}, {"action": "decline"}
        await cache.put_many([(tx(1), first)])
        await cache.put_many([(tx(1), second)])
        assert await cache.get_many([tx(1)]) == [first]
        slow.gate.set()
        await cache.flush()
        assert await cache.get_many([tx(1)]) == [first]

    run(go())


def test_a_failed_write_is_logged_and_leaves_memory(caplog: pytest.LogCaptureFixture) -> None:
    async def go() -> None:
        slow = SlowCache()
        slow.fail = ConnectionError("redis down")
        cache = WriteBehindCache(slow, timeout_s=5.0)
        await cache.put_many([(tx(1), {"action": "approve"})])
        slow.gate.set()
        await cache.flush()
        assert cache.pending == 0
        assert await cache.get_many([tx(1)]) == [None]  # re-scored, as without a cache

    run(go())
    assert "storing 1 decisions in the cache failed" in caplog.text and "redis down" in caplog.text


def test_a_write_past_its_timeout_is_given_up() -> None:
    async def go() -> None:
        slow = SlowCache()  # the gate never opens
        cache = WriteBehindCache(slow, timeout_s=0.05)
        await cache.put_many([(tx(1), {"action": "approve"})])
        await asyncio.wait_for(cache.flush(), 2.0)
        assert cache.pending == 0

    run(go())
