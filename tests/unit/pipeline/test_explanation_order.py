"""The explanation's last lines when a decision is degraded and provisional at once
(Redis paused: neither the features nor the decision cache answer), as
docs/contract.md, the OpenAPI document and the proto state the order."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import orjson

from gateway.openapi import openapi_document
from pipeline.cache import LocalFirstCache
from pipeline.feature_store import InMemoryFeatureStore
from pipeline.scorer import PROVISIONAL_REASON, Inbound, Scorer
from tests.factories import rules, tx_bytes

REPO = Path(__file__).resolve().parents[3]
NOW = 1_800_000_000.0


class PausedCache:
    """The shared decision cache of a paused Redis: every read times out."""

    async def get_many(self, txs: Sequence[Any]) -> list[dict[str, Any] | None]:
        raise TimeoutError("Timeout reading from socket")

    async def put_many(self, items: Sequence[Any]) -> None:
        raise TimeoutError("Timeout writing to socket")


def test_a_degraded_provisional_decision_ends_with_degraded_then_provisional() -> None:
    store = InMemoryFeatureStore({}, {})
    store.fail = ConnectionError("redis paused")
    scorer = Scorer(model=None, rules=rules("rules-order-1"), store=store,
                    cache=LocalFirstCache(PausedCache(), wait_s=0.02, retry_every_s=0.01), wall_clock=lambda: NOW)  # fmt: skip
    batch = [Inbound(tx_bytes(i, NOW), {}, NOW - 0.004, 0, i) for i in range(10)]
    got = [orjson.loads(value) for _, value, *_ in asyncio.run(scorer.score_batch(batch)).decisions]
    assert len(got) == 10
    for d in got:
        assert d["degraded"] is True and d["provisional"] is True
        assert d["explanation"][-2].startswith("degraded: ") and d["explanation"][-1] == PROVISIONAL_REASON


def test_the_contract_states_that_order_everywhere() -> None:
    contract = " ".join((REPO / "docs" / "contract.md").read_text().split())
    assert "ends with `degraded: <why>` (followed by the `provisional: …` line" in contract
    schema = openapi_document()["components"]["schemas"]["Decision"]["properties"]["explanation"]["description"]
    assert "adds `degraded: <why>`, and a provisional one then adds `provisional: ...` as the last line" in schema
    proto = " ".join((REPO / "proto" / "fraud" / "v1" / "fraud.proto").read_text().replace("//", " ").split())
    assert 'adds "degraded: <why>", and a provisional one then adds "provisional: ..." as the last line' in proto
