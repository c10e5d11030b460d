"""The scoring loop's regimes: busy batches sharing transactions, or quiet ones committed at once."""

from __future__ import annotations

import pytest

from agents.pace import Pace


def pace(below: float = 1200.0) -> Pace:
    return Pace(window_s=0.01, interval_s=0.025, quiet_window_s=0.1, quiet_below_tps=below)


def feed(p: Pace, rate: float, seconds: float, start: float, step: float = 0.01) -> float:
    """Takes of ``rate * step`` records every ``step`` seconds; returns the time after the last."""
    t, carry = start, 0.0
    while t < start + seconds:
        carry += rate * step
        n = int(carry)
        carry -= n
        p.taken(n, t)
        t += step
    return t


def test_a_worker_starts_busy_and_turns_quiet_after_a_second_of_light_traffic() -> None:
    p = pace()
    assert (p.quiet, p.window, p.interval) == (False, 0.01, 0.025)
    t = feed(p, 100, 0.5, 0.0)
    assert not p.quiet  # not a whole period counted yet
    feed(p, 100, 1.0, t)
    assert p.quiet
    assert (p.window, p.interval) == (0.1, 0.0)  # up to 100 ms a batch, each committed at once
    assert p.rate_tps is not None and 90 < p.rate_tps < 110


@pytest.mark.parametrize(("rate", "window"), [(20, 0.1), (200, 0.1), (500, 0.05), (950, 0.026)])
def test_a_quiet_batch_waits_for_about_25_records_within_the_windows(rate: float, window: float) -> None:
    p = pace()
    feed(p, rate, 2.5, 0.0)
    assert p.quiet and p.interval == 0.0
    assert p.window == pytest.approx(window, rel=0.05)


def test_heavy_traffic_keeps_the_busy_regime_and_turns_a_quiet_worker_busy_within_a_period() -> None:
    p = pace()
    t = feed(p, 3000, 2.5, 0.0)
    assert not p.quiet
    t = feed(p, 50, 2.5, t)
    assert p.quiet
    feed(p, 3000, 1.1, t)
    assert not p.quiet
    assert (p.window, p.interval) == (0.01, 0.025)


def test_a_rate_near_the_threshold_does_not_flip_the_regime_each_period() -> None:
    p = pace()
    t = feed(p, 1100, 3.0, 0.0)  # under the threshold, over 80 % of it: a busy worker stays busy
    assert not p.quiet
    t = feed(p, 100, 2.0, t)
    assert p.quiet
    feed(p, 1100, 3.0, t)  # the same rate: a quiet worker stays quiet
    assert p.quiet


def test_an_idle_worker_is_quiet_and_a_threshold_of_zero_keeps_it_busy() -> None:
    idle, never = pace(), pace(below=0)
    for p in (idle, never):
        feed(p, 0, 2.0, 0.0, step=0.25)
    assert idle.quiet and idle.rate_tps == 0.0 and idle.window == 0.1
    assert not never.quiet and never.rate_tps == 0.0


def test_a_full_batch_turns_a_quiet_worker_busy_at_once() -> None:
    """An idle worker is quiet; a burst must not wait a period or two for shared transactions."""
    p = pace()
    t = feed(p, 0, 2.0, 0.0, step=0.25)
    assert p.quiet
    p.taken(64, t + 0.03, full=True)
    assert not p.quiet and (p.window, p.interval) == (0.01, 0.025)
    p.taken(64, t + 0.06, full=True)  # busy already: nothing changes
    assert not p.quiet
