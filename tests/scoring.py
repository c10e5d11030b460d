"""A Scorer on in-memory fakes over the session's simulation: the harness of the
scorer's tests, shared with the tests that build a Scorer for another subject
(model promotion and reload, the model's clock). (Imported as ``tests.scoring``.)"""

from __future__ import annotations

import math
from typing import Any

import orjson
import pandas as pd

from pipeline.cache import DecisionCache, InMemoryDecisionCache
from pipeline.feature_store import InMemoryFeatureStore
from pipeline.features import DAY_S, build_merchant_risk, build_user_profiles, prepare_history
from pipeline.scorer import BatchOutput, Inbound, Scorer
from tests.factories import iso, rules

__all__ = ["BLOCKED_DEVICE", "RULES", "World", "decisions", "inbound", "make_scorer"]

BLOCKED_DEVICE = "d-blocked-unit"
RULES = rules("rules-unit-1", blocked_device=BLOCKED_DEVICE)


class World:
    """Profiles, merchants and a population drawn from the simulation, plus a fixed clock."""

    def __init__(self, frame: pd.DataFrame) -> None:
        history = prepare_history(frame)
        self.as_of = math.ceil(history["ts"].max() / DAY_S) * DAY_S
        self.now = self.as_of + 2 * 3600.0  # 02:00 UTC on the day after the data
        self.profiles = build_user_profiles(history, self.as_of)
        self.merchants = build_merchant_risk(history, self.as_of)
        last = frame.sort_values("timestamp").drop_duplicates("user_id", keep="last")
        self.population = [
            {
                "user_id": r.user_id,
                "merchant_id": r.merchant_id,
                "merchant_category": r.merchant_category,
                "device_id": r.device_id,
                "lat": float(r.lat),
                "lon": float(r.lon),
                "country": r.country,
                "currency": r.currency,
            }
            for r in last.itertuples()
            if r.user_id in self.profiles
        ]
        self._seq = 0

    def tx(self, i: int = 0, **over: Any) -> dict[str, Any]:
        """A valid transaction document for population member ``i``."""
        self._seq += 1
        person = self.population[i % len(self.population)]
        doc: dict[str, Any] = {
            "transaction_id": f"t-unit-{self._seq:06d}",
            **person,
            "amount": 42.5,
            "timestamp": iso(self.now - 5.0 - self._seq * 0.001),
        }
        doc.update(over)
        return {k: v for k, v in doc.items() if v is not None}

    def store(self) -> InMemoryFeatureStore:
        return InMemoryFeatureStore(self.profiles, self.merchants)


def make_scorer(
    world: World, model: Any, store: InMemoryFeatureStore | None = None, cache: DecisionCache | None = None, **kw: Any
) -> Scorer:
    """A Scorer on the world's features and clock, ``RULES`` and ``cache`` (an empty one by default).

    The model's budget is 5 s unless a test sets it: a test of what the model
    answers must not turn on a 50 ms wall clock (a real ensemble's call missed
    it once on a CI machine busy with the integration tests beside it, and the
    batch was decided by rules); the budget's own tests set it."""
    kw.setdefault("model_budget_s", 5.0)
    return Scorer(
        model=model,
        rules=RULES,
        store=store if store is not None else world.store(),
        cache=cache if cache is not None else InMemoryDecisionCache(),
        wall_clock=lambda: world.now,
        **kw,
    )


def inbound(doc: dict[str, Any] | bytes, world: World, correlation: str | None = None, offset: int = 0) -> Inbound:
    """One record as the loop hands it over: ``doc`` as JSON, received 4 ms ago."""
    value = doc if isinstance(doc, bytes) else orjson.dumps(doc)
    headers = {"correlation-id": correlation.encode()} if correlation else {}
    return Inbound(value=value, headers=headers, timestamp=world.now - 0.004, partition=0, offset=offset)


def decisions(out: BatchOutput) -> list[dict[str, Any]]:
    """The batch's decisions, parsed; each must be keyed by its transaction id."""
    got = []
    for key, value, *_ in out.decisions:
        record = orjson.loads(value)
        assert key == record["transaction_id"].encode(), "decisions are keyed by transaction id"
        got.append(record)
    return got
