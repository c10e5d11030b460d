"""The scoring loop's take and commit rules: a record is decided as soon as the
worker can; transactions span batches only while a queue has formed."""

from __future__ import annotations

import pytest

from agents.pace import IDLE_WAIT_S, Pace


def pace(window_s: float = 0.0, interval_s: float = 0.025, caught_up: bool = True) -> Pace:
    return Pace(window_s=window_s, interval_s=interval_s, caught_up=caught_up)


def test_an_idle_worker_sleeps_until_a_record_arrives_and_takes_it_at_once() -> None:
    assert pace().waits(now=10.0, last_take=9.0, opened=None) == (0.0, IDLE_WAIT_S)


def test_with_a_transaction_open_a_caught_up_worker_takes_what_is_queued_without_waiting() -> None:
    # An empty take then commits at once: waiting for a record would only delay that commit.
    assert pace().waits(now=10.0, last_take=10.0, opened=9.995) == (0.0, 0.0)


def test_without_caught_up_commits_the_worker_waits_for_a_record_until_the_commit_is_due() -> None:
    within, idle = pace(caught_up=False).waits(now=10.0, last_take=10.0, opened=9.995)
    assert within == 0.0
    assert idle == pytest.approx(0.02)


def test_a_batch_window_counts_from_the_last_take_and_never_past_a_due_commit() -> None:
    p = pace(window_s=0.01)
    assert p.waits(now=10.004, last_take=10.0, opened=None)[0] == pytest.approx(0.006)
    assert p.waits(now=10.02, last_take=10.0, opened=None)[0] == 0.0  # waited already, while scoring
    assert p.waits(now=10.0, last_take=10.0, opened=9.98)[0] == pytest.approx(0.005)  # due in 5 ms


def test_a_take_that_is_not_full_commits_the_open_transaction() -> None:
    p = pace()
    assert p.commit_due(opened=10.0, now=10.001, full=False)
    assert not p.commit_due(opened=None, now=10.001, full=False)  # nothing open


def test_while_a_queue_has_formed_a_transaction_spans_batches_up_to_the_interval() -> None:
    p = pace()
    assert not p.commit_due(opened=10.0, now=10.01, full=True)
    assert p.commit_due(opened=10.0, now=10.025, full=True)


def test_without_caught_up_commits_only_the_interval_ends_a_transaction() -> None:
    p = pace(caught_up=False)
    assert not p.commit_due(opened=10.0, now=10.01, full=False)
    assert p.commit_due(opened=10.0, now=10.03, full=False)
    assert pace(interval_s=0.0, caught_up=False).commit_due(opened=10.0, now=10.0, full=True)
