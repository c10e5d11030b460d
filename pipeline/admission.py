"""Admission control: who may send, no replays, no floods.

The scorer asks twice per batch:

1. :meth:`Admission.authenticate` (pure, before validation): is the message
   signed by a known client, within the time window? A refusal is dead-lettered
   only — never answered with a ``reject`` decision keyed by the message's
   transaction id, which an unauthenticated sender could use to overwrite a
   real payment's decision (see :mod:`pipeline.auth`).
2. :meth:`Admission.admit` (after the decision cache missed, so a resend costs
   no tokens and is never "replayed"): the replay guard and the token buckets,
   asked at the same time. A replay is dead-lettered (a replay of a decided
   record never gets here: the cache answered it with that decision); a transaction
   over its client's or user's rate gets a ``reject`` decision with code
   ``rate_limited`` and the wait in its reason (it is authenticated, so
   answering it is safe, and the shopper is not left waiting), plus a dead
   letter like every refusal.

If Redis cannot answer either question the batch is admitted (fail open) and
the failure is counted: the signature window still bounds replays, and
refusing all payments because a limiter is down would be the bigger outage.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from pipeline.auth import AuthResult, ReplayGuard, replay_ttl_s, verify
from pipeline.ratelimit import RateDecision, RateLimiter
from pipeline.timing import RoundTrips, timed
from pipeline.validate import Rejection

__all__ = ["Admission", "verdicts_of"]

log = logging.getLogger(__name__)


@dataclass
class Admission:
    keys: Mapping[str, bytes]
    window_s: float = 300.0
    allow_unsigned: bool = False
    replay: ReplayGuard | None = None
    limiter: RateLimiter | None = None

    def authenticate(self, value: bytes, headers: Mapping[str, bytes], now: float) -> AuthResult | Rejection:
        return verify(value, headers, self.keys, now, self.window_s, allow_unsigned=self.allow_unsigned)

    async def admit(
        self, items: Sequence[tuple[AuthResult, str, str, str]], round_trips: RoundTrips | None = None
    ) -> tuple[list[Rejection | None], list[str]]:
        """``items``: (auth, delivery "partition:offset", transaction_id, user_id).

        Returns, per item, None (admitted) or why not; and the names of the
        checks that could not be made (for monitoring). ``round_trips`` is
        told each check's time (``replay_guard``, ``rate_limit``).
        """
        unavailable: list[str] = []
        signed = [i for i, (auth, *_rest) in enumerate(items) if auth.signature]
        # NOTE: both checks go out at once (two pooled connections, one round
        # trip of latency). A replay therefore also spends a token: replays are
        # rare and refused anyway, and a second sequential round trip per batch
        # would cost every transaction.
        replay_check = self._replays(items, signed, round_trips)
        rate_check = self._rates(items, round_trips)
        firsts, rates = await asyncio.gather(replay_check, rate_check)
        if firsts is None:
            unavailable.append("replay_guard")
        if rates is None:
            unavailable.append("rate_limiter")
        return verdicts_of(items, signed, firsts or [], rates or []), unavailable

    async def _replays(
        self, items: Sequence[tuple[AuthResult, str, str, str]], signed: list[int], round_trips: RoundTrips | None
    ) -> list[bool] | None:
        if self.replay is None or not signed:
            return []
        try:
            check = self.replay.check(
                [(items[i][0].signature or "", items[i][1]) for i in signed], replay_ttl_s(self.window_s)
            )
            return await timed(round_trips, "replay_guard", check)
        except Exception as exc:
            log.warning("replay guard unavailable (%r): admitting the batch", exc)
            return None

    async def _rates(
        self, items: Sequence[tuple[AuthResult, str, str, str]], round_trips: RoundTrips | None
    ) -> list[RateDecision] | None:
        if self.limiter is None:
            return []
        try:
            allow = self.limiter.allow([(auth.client_id, user) for auth, _, _, user in items])
            return await timed(round_trips, "rate_limit", allow)
        except Exception as exc:
            log.warning("rate limiter unavailable (%r): admitting the batch", exc)
            return None


def verdicts_of(
    items: Sequence[tuple[AuthResult, str, str, str]],
    signed: Sequence[int],
    firsts: Sequence[bool],
    rates: Sequence[RateDecision],
) -> list[Rejection | None]:
    """Per item (as :meth:`Admission.admit` takes them): None, or why it is
    refused. ``firsts``: the replay guard's answers for the items at ``signed``;
    ``rates``: the limiter's, one per item. Either may be empty (not asked, or
    unavailable: fail open). A replay is refused as a replay even when its
    token was refused too. Shared with the batch's one-call lookup
    (pipeline/redis_batch.py), whose script admits by the same answers."""
    verdicts: list[Rejection | None] = [None] * len(items)
    for i, first in zip(signed, firsts):
        if not first:
            verdicts[i] = Rejection("replayed", "signature", "this signed message was already received as another record")
    for i, decision in enumerate(rates):
        if verdicts[i] is None and not decision.allowed:
            verdicts[i] = decision.rejection(items[i][2], items[i][3])
    return verdicts
