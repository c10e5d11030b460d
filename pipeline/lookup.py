"""The batch lookup: what a batch's valid transactions find before they are scored.

For each valid transaction of a batch, in one :class:`BatchAnswer`:

1. the decision cache: a decision given before (a resend) is answered with
   it; a second copy within the batch (same id or same content) follows its
   first copy;
2. admission of the first copies (:mod:`pipeline.admission`): the replay
   guard and the token buckets;
3. enrichment of the admitted (:mod:`pipeline.feature_store`): profile,
   merchant risk, velocity.

In that order: a resend is never charged a token or a velocity event, and a
refused transaction is never enriched. Two lookups give that answer, and the
scorer reads it the same way whichever did:

- :class:`~pipeline.redis_batch.RedisBatchLookup`: the three steps in one
  Redis script call (one Redis server);
- :class:`SeparateCalls`: the steps as calls in turn, one round trip each
  (a Redis Cluster, which refuses a script over several slots; the
  in-memory fakes).

:class:`OneCallFirst` is what the scorer asks on one server: the one call,
and the separate calls for a batch whose one call failed, so a Redis outage
decides as without the one call (provisional, fail open, degraded). Both
paths leave Redis and the batch in the same state
(tests/integration/test_redis_batch.py).

A lookup returns what it found and charges its own Redis work to the
scorer's stage clock (:class:`~pipeline.timing.Laps`); it writes nothing
into the batch's output: emitting, rejecting and building feature rows stay
with the scorer.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

from app.contract import Transaction
from app.errors import BatchLookupError
from app.redis_keys import content_hash
from pipeline.admission import Admission
from pipeline.auth import AuthResult
from pipeline.cache import UNCHECKED, DecisionCache
from pipeline.feature_store import Enrichment, FeatureStore
from pipeline.timing import Laps, RoundTrips, timed
from pipeline.validate import Rejection

__all__ = ["NOTHING_FOUND", "BatchAnswer", "BatchLookup", "OneCallFirst", "Request", "SeparateCalls", "in_batch_copies"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Request:
    """One valid transaction of the batch, as admission sees it."""

    tx: Transaction
    auth: AuthResult
    delivery: str
    """The record's ``"partition:offset"`` (the replay guard's redelivery test)."""


@dataclass(frozen=True, slots=True)
class BatchAnswer:
    """What the lookup found, index for index with the requests."""

    hits: Sequence[dict[str, Any] | None]
    """A decision given before (a resend): answered with it, nothing else done."""
    follows: Sequence[int | None]
    """For a second copy of a transaction in the batch: the index of its first copy."""
    verdicts: Sequence[Rejection | None]
    """For a first copy refused by admission (replayed, rate limited): why."""
    enrichments: Sequence[Enrichment] | None
    """The admitted first copies' features, in order; None when they could not
    be read (``enrich_error`` says why)."""
    enrich_error: Exception | None = None
    unchecked: frozenset[str] = frozenset()
    """Transaction ids the decision cache could not be asked about in time:
    their decisions are provisional (never approve)."""
    incidents: tuple[str, ...] = ()
    """What went wrong on the way and was worked around, each a count in the
    batch's monitoring record: ``one_call_failed``, ``replay_guard_unavailable``,
    ``rate_limiter_unavailable``."""


#: The answer for a batch with nothing valid in it: nothing is asked.
NOTHING_FOUND = BatchAnswer((), (), (), None)


class BatchLookup(Protocol):
    async def look_up(self, requests: Sequence[Request], laps: Laps) -> BatchAnswer:
        """Each request's cached decision, first copy, verdict and features,
        lapping ``laps`` for the stages its own calls serve. Raises
        BatchLookupError when the answer cannot be given (nothing of the
        attempt may then be assumed done or not done)."""
        ...


class SeparateCalls:
    """Decision cache, admission and enrichment as calls in turn.

    Never raises: a cache that cannot answer leaves its transactions
    unchecked, an admission check that cannot be made admits (fail open,
    counted), a feature store that fails leaves the batch without features
    (``enrich_error``: the scorer degrades it to rules).
    """

    def __init__(
        self,
        cache: DecisionCache,
        store: FeatureStore,
        admission: Admission | None = None,
        round_trips: RoundTrips | None = None,
    ) -> None:
        self.cache = cache
        self.store = store
        self.admission = admission
        #: Told each call's time (``cache_get``, ``replay_guard``, ``rate_limit``, ``enrich``).
        self.round_trips = round_trips

    async def look_up(self, requests: Sequence[Request], laps: Laps) -> BatchAnswer:
        txs = [r.tx for r in requests]
        hits, unchecked = await self._cached(txs)
        follows = in_batch_copies(txs, hits)
        firsts = [i for i, (hit, first) in enumerate(zip(hits, follows)) if hit is None and first is None]
        laps.lap("cache")
        verdicts, incidents = await self._admit(requests, firsts)
        laps.lap("validate")  # replay and rate checks count as admission, i.e. validation
        enrichments, error = await self._enrich([txs[i] for i in firsts if verdicts[i] is None])
        laps.lap("features")
        return BatchAnswer(hits, follows, verdicts, enrichments, error, unchecked, incidents)

    async def _cached(self, txs: list[Transaction]) -> tuple[list[dict[str, Any] | None], frozenset[str]]:
        """Each transaction's earlier decision (or None), and the ids that could not be checked."""
        try:
            found = await timed(self.round_trips, "cache_get", self.cache.get_many(txs))
        except Exception as exc:
            log.warning("decision cache unavailable (%r): decisions are provisional", exc)
            found = [UNCHECKED] * len(txs)
        unchecked = frozenset({tx.transaction_id for tx, hit in zip(txs, found) if hit is UNCHECKED})
        return [None if hit is UNCHECKED else hit for hit in found], unchecked

    async def _admit(
        self, requests: Sequence[Request], firsts: list[int]
    ) -> tuple[list[Rejection | None], tuple[str, ...]]:
        """Admission's verdict on each first copy (the others: None), and the checks it could not make."""
        verdicts: list[Rejection | None] = [None] * len(requests)
        if self.admission is None or not firsts:
            return verdicts, ()
        asked = [requests[i] for i in firsts]
        items = [(r.auth, r.delivery, r.tx.transaction_id, r.tx.user_id) for r in asked]
        admitted, unavailable = await self.admission.admit(items, self.round_trips)
        for i, verdict in zip(firsts, admitted):
            verdicts[i] = verdict
        return verdicts, tuple(f"{name}_unavailable" for name in unavailable)

    async def _enrich(self, txs: list[Transaction]) -> tuple[list[Enrichment] | None, Exception | None]:
        """The features of ``txs`` in one feature store call, or why there are none."""
        if not txs:
            return None, None
        try:
            return await timed(self.round_trips, "enrich", self.store.enrich(txs)), None
        except Exception as exc:
            return None, exc


class OneCallFirst:
    """The batch's one call; for a batch whose one call failed, the separate calls."""

    def __init__(self, one_call: BatchLookup, separate: BatchLookup, round_trips: RoundTrips | None = None) -> None:
        self.one_call = one_call
        self.separate = separate
        #: Told the one call's time (``batch_lookup``; the separate calls tell their own).
        self.round_trips = round_trips

    async def look_up(self, requests: Sequence[Request], laps: Laps) -> BatchAnswer:
        try:
            return await timed(self.round_trips, "batch_lookup", self.one_call.look_up(requests, laps))
        except BatchLookupError as exc:
            # NOTE: nothing of the call can be assumed undone: if it ran but its
            # reply was lost, the separate calls charge those tokens again.
            log.warning("the batch's one Redis call failed (%r): making the separate calls", exc)
        answer = await self.separate.look_up(requests, laps)
        return replace(answer, incidents=("one_call_failed", *answer.incidents))


def in_batch_copies(txs: Sequence[Transaction], hits: Sequence[dict[str, Any] | None]) -> list[int | None]:
    """For each transaction the cache did not answer that repeats an earlier
    one of the batch (its id or its content): that one's index; else None.

    A copy follows the first copy, never another copy: only first copies are
    remembered (as the one-call script does, pipeline/redis_batch.py)."""
    follows: list[int | None] = [None] * len(txs)
    first_in_batch: dict[str, int] = {}
    for i, (tx, hit) in enumerate(zip(txs, hits)):
        if hit is not None:
            continue
        keys = (tx.transaction_id, content_hash(tx))
        leader = next((first_in_batch[k] for k in keys if k in first_in_batch), None)
        if leader is not None:
            follows[i] = leader
            continue
        for k in keys:
            first_in_batch[k] = i
    return follows
