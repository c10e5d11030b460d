"""The agent's offset books (app/offsets.py): what is scored, what is committed."""

from __future__ import annotations

from app.offsets import PartitionProgress

P0, P1 = ("tx", 0), ("tx", 1)


def ev(tp: tuple[str, int], offset: int) -> tuple[tuple[str, int], int]:
    return (tp, offset)


def key(event: tuple[tuple[str, int], int]) -> tuple[tuple[str, int], int]:
    return event


def test_in_order_events_are_scored_and_committed_after_delivery() -> None:
    books: PartitionProgress[tuple[str, int]] = PartitionProgress()
    books.assign({P0: 10, P1: 0})
    batch = books.admit([ev(P0, 10), ev(P1, 0), ev(P0, 11)], key, now=0.0)
    assert batch.events == [ev(P0, 10), ev(P1, 0), ev(P0, 11)]
    assert books.uncommitted() == {}  # nothing committable before delivery
    assert books.done(batch, key)
    assert books.uncommitted() == {P0: 12, P1: 1}
    books.committed({P0: 12, P1: 1}, books.generation)
    assert books.uncommitted() == {}


def test_already_decided_offsets_are_skipped() -> None:
    books: PartitionProgress[tuple[str, int]] = PartitionProgress()
    books.assign({P0: 5})
    batch = books.admit([ev(P0, 3), ev(P0, 4), ev(P0, 5)], key, now=0.0)
    assert batch.events == [ev(P0, 5)]
    assert batch.skipped_decided == 2


def test_events_of_partitions_not_assigned_are_not_scored_nor_committed() -> None:
    books: PartitionProgress[tuple[str, int]] = PartitionProgress()
    books.assign({P0: 0})
    batch = books.admit([ev(P1, 7)], key, now=0.0)
    assert batch.events == [] and batch.skipped_unassigned == 1
    books.done(batch, key)
    assert P1 not in books.uncommitted()


def test_a_hole_before_an_event_seeks_back_instead_of_committing_past_it() -> None:
    """The rebalance loss: records 5-9 never reached the agent, 10 did."""
    books: PartitionProgress[tuple[str, int]] = PartitionProgress()
    books.assign({P0: 5})
    batch = books.admit([ev(P0, 10), ev(P0, 11)], key, now=0.0)
    assert batch.events == [] and batch.rewind == {P0: 5}
    books.done(batch, key)
    assert books.uncommitted() == {}  # nothing moved past 5
    # Stale copies behind the seek are skipped without seeking again...
    again = books.admit([ev(P0, 12)], key, now=0.1)
    assert again.events == [] and again.rewind == {}
    # ...and once 5 arrives the partition goes on from there.
    resumed = books.admit([ev(P0, 5), ev(P0, 6)], key, now=0.2)
    assert resumed.events == [ev(P0, 5), ev(P0, 6)]
    books.done(resumed, key)
    assert books.uncommitted() == {P0: 7}


def test_a_rewind_undone_by_records_in_flight_is_sought_again() -> None:
    books: PartitionProgress[tuple[str, int]] = PartitionProgress(reseek_after_s=1.0)
    books.assign({P0: 5})
    assert books.admit([ev(P0, 8)], key, now=0.0).rewind == {P0: 5}
    assert books.admit([ev(P0, 9)], key, now=0.5).rewind == {}  # too soon: in flight before the seek
    assert books.admit([ev(P0, 10)], key, now=1.2).rewind == {P0: 5}  # the seek was lost: again
    assert books.admit([ev(P0, 5)], key, now=1.3).events == [ev(P0, 5)]


def test_the_commit_timer_re_seeks_a_partition_that_went_quiet() -> None:
    books: PartitionProgress[tuple[str, int]] = PartitionProgress(reseek_after_s=1.0)
    books.assign({P0: 5})
    books.admit([ev(P0, 8)], key, now=0.0)
    assert books.stalled_rewinds(now=0.5) == {}
    assert books.stalled_rewinds(now=1.1) == {P0: 5}
    assert books.stalled_rewinds(now=1.2) == {}


def test_a_hole_is_never_skipped_on_a_guess_only_after_the_log_was_read() -> None:
    books: PartitionProgress[tuple[str, int]] = PartitionProgress(reseek_after_s=1.0, max_seeks=3)
    books.assign({P0: 5})
    assert books.admit([ev(P0, 8)], key, now=0.0).rewind == {P0: 5}
    assert books.admit([ev(P0, 8)], key, now=1.0).rewind == {P0: 5}
    assert books.admit([ev(P0, 8)], key, now=2.0).rewind == {P0: 5}
    late = books.admit([ev(P0, 8), ev(P0, 9)], key, now=3.0)
    assert late.events == [] and late.verify == {P0: (5, 8)}  # the caller reads the log at 5
    # Still nothing skipped while nobody has read the log: the next batch waits too.
    assert books.admit([ev(P0, 8)], key, now=3.5).events == []
    books.skip_to(P0, 8)  # the log holds no committed record at 5-7 (markers, compaction)
    after = books.admit([ev(P0, 8), ev(P0, 9)], key, now=4.0)
    assert after.events == [ev(P0, 8), ev(P0, 9)]
    books.done(after, key)
    assert books.uncommitted() == {P0: 10}


def test_a_fenced_partition_is_skipped_until_assigned_again() -> None:
    books: PartitionProgress[tuple[str, int]] = PartitionProgress()
    books.assign({P0: 0, P1: 0})
    batch = books.admit([ev(P0, 0), ev(P1, 0)], key, now=0.0)
    books.done(batch, key, only={P1})  # P0's transaction was fenced
    books.forget([P0])
    assert books.positions() == {P1: 1}
    assert books.admit([ev(P0, 0), ev(P1, 1)], key, now=1.0).skipped_unassigned == 1


def test_a_batch_that_straddles_a_rebalance_moves_nothing() -> None:
    books: PartitionProgress[tuple[str, int]] = PartitionProgress()
    books.assign({P0: 0})
    batch = books.admit([ev(P0, 0), ev(P0, 1)], key, now=0.0)
    pending = books.revoke()
    assert pending == {}
    books.assign({P0: 0})  # committed offset is still 0: the new owner decides them again
    assert not books.done(batch, key)
    assert books.uncommitted() == {}
    assert books.admit([ev(P0, 0)], key, now=0.0).events == [ev(P0, 0)]


def test_revoke_hands_back_what_was_decided_but_not_committed() -> None:
    books: PartitionProgress[tuple[str, int]] = PartitionProgress()
    books.assign({P0: 0, P1: 3})
    batch = books.admit([ev(P0, 0), ev(P0, 1)], key, now=0.0)
    books.done(batch, key)
    assert books.revoke() == {P0: 2}
    assert books.assigned == frozenset()


def test_a_commit_from_an_earlier_generation_does_not_count() -> None:
    books: PartitionProgress[tuple[str, int]] = PartitionProgress()
    books.assign({P0: 0})
    batch = books.admit([ev(P0, 0)], key, now=0.0)
    books.done(batch, key)
    old = books.generation
    books.assign({P0: 1})
    books.committed({P0: 1}, old)
    assert books.uncommitted() == {}  # assign() read 1 as committed already
    batch = books.admit([ev(P0, 1)], key, now=0.0)
    books.done(batch, key)
    books.committed({P0: 2}, old)
    assert books.uncommitted() == {P0: 2}


def test_a_partition_with_records_waiting_that_decides_nothing_is_reported_as_stalled() -> None:
    """The quiet form: nothing of a partition reaches the agent, so no hole shows."""
    books: PartitionProgress[tuple[str, int]] = PartitionProgress()
    books.assign({P0: 181, P1: 40})
    ends = {P0: 214, P1: 40}  # P1 is at its end: nothing to wait for
    assert books.stalled(0.0, ends.get, after_s=10.0) == {}  # the clock starts here
    assert books.stalled(9.0, ends.get, after_s=10.0) == {}
    assert books.stalled(10.0, ends.get, after_s=10.0) == {P0: 181}
    # Reported once per after_s while it stays stuck, not on every check.
    assert books.stalled(11.0, ends.get, after_s=10.0) == {}
    assert books.stalled(20.0, ends.get, after_s=10.0) == {P0: 181}


def test_a_partition_that_keeps_deciding_is_not_stalled() -> None:
    books: PartitionProgress[tuple[str, int]] = PartitionProgress()
    books.assign({P0: 0})
    ends = {P0: 1000}
    for second in range(30):
        assert books.stalled(float(second), ends.get, after_s=10.0) == {}
        batch = books.admit([ev(P0, second)], key, now=float(second))
        books.done(batch, key)


def test_a_partition_waiting_on_a_rewind_or_without_a_highwater_is_not_stalled() -> None:
    books: PartitionProgress[tuple[str, int]] = PartitionProgress()
    books.assign({P0: 5, P1: 0})
    books.admit([ev(P0, 9)], key, now=0.0)  # P0 rewinds (its own re-seek handles it)
    highwaters = {P0: 100}  # P1: no fetch response yet
    assert books.stalled(0.0, highwaters.get, after_s=1.0) == {}
    assert books.stalled(50.0, highwaters.get, after_s=1.0) == {}


def test_a_rebalance_restarts_the_stall_clock() -> None:
    books: PartitionProgress[tuple[str, int]] = PartitionProgress()
    books.assign({P0: 0})
    ends = {P0: 10}
    books.stalled(0.0, ends.get, after_s=10.0)
    books.revoke()
    books.assign({P0: 0})
    assert books.stalled(12.0, ends.get, after_s=10.0) == {}
    assert books.stalled(22.0, ends.get, after_s=10.0) == {P0: 0}
