"""What a benchmark run must show to count: shared by the harness and its plots."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["GENERATOR_LAG_LIMIT_MS", "THRESHOLDS_MS", "generator_kept_up"]

#: p99 latency limits a rate is searched against: the checkout's budget, and a tight one.
THRESHOLDS_MS = (200.0, 50.0)
#: The generator sends on a Poisson schedule; a send later than this (p99) means
#: it could not keep the schedule, so the load was not what the run claims.
#: (The count sent is the schedule's, Poisson noise included: not a test of it.)
GENERATOR_LAG_LIMIT_MS = 100.0


def generator_kept_up(run: Mapping[str, Any]) -> bool:
    lag = run.get("generator_lag_p99_ms")
    return lag is None or lag <= GENERATOR_LAG_LIMIT_MS
