"""How the scorer's work is timed: its stages, and each Redis round trip.

Two kinds of time, told in two ways:

- **stages** (``validate``, ``cache``, ``features``, ``model``, ``rules``):
  a :class:`StageClock` per batch, whose :meth:`~StageClock.lap` charges the
  time since the last lap to a stage. The batch lookups (:mod:`pipeline.lookup`)
  lap the same clock as the scorer, so a stage is charged the same way
  whichever lookup served the batch. The totals end up in the batch's
  ``monitoring`` record (``stage_ms``) and in each decision's ``latency_ms``.
- **Redis round trips**: reported as they end to whoever built the scorer
  with a :class:`RoundTrips` observer (the worker's metrics), by operation
  name. The scorer's collaborators stay the objects it was built with; no
  proxy is put in front of them.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable
from typing import Protocol, TypeVar

__all__ = ["Laps", "RoundTrips", "StageClock", "timed"]

T = TypeVar("T")


class Laps(Protocol):
    def lap(self, stage: str) -> None:
        """Charge the time since the previous lap to ``stage``."""
        ...


class RoundTrips(Protocol):
    def observe_round_trip(self, op: str, seconds: float, failed: bool) -> None:
        """One Redis round trip ``op`` took ``seconds``; ``failed``: it raised (or was cancelled)."""
        ...


class StageClock:
    """One batch's stage timer: ``lap(stage)`` adds the ms since the previous lap to ``stage``."""

    __slots__ = ("last", "ms", "start")

    def __init__(self) -> None:
        self.start = self.last = time.perf_counter()
        self.ms: dict[str, float] = {}

    def lap(self, stage: str) -> None:
        now = time.perf_counter()
        self.ms[stage] = round(self.ms.get(stage, 0.0) + (now - self.last) * 1000, 3)
        self.last = now

    def elapsed_ms(self) -> float:
        return (time.perf_counter() - self.start) * 1000

    def started_wall(self, wall_now: float) -> float:
        """The wall-clock time the batch started at, given the wall clock now (for queue wait)."""
        return wall_now - (time.perf_counter() - self.start)


def timed(round_trips: RoundTrips | None, op: str, call: Awaitable[T]) -> Awaitable[T]:
    """``call``, reported to ``round_trips`` as ``op`` when it ends; ``call``
    itself when nobody observes (no extra coroutine on an unobserved path)."""
    return call if round_trips is None else _timed(round_trips, op, call)


async def _timed(round_trips: RoundTrips, op: str, call: Awaitable[T]) -> T:
    started = time.perf_counter()
    failed = True
    try:
        result = await call
        failed = False
        return result
    finally:
        # NOTE: finally, not except Exception: a call cancelled by a timeout
        # (asyncio.wait_for) is a failed round trip too.
        round_trips.observe_round_trip(op, time.perf_counter() - started, failed)
