"""Which offsets of `transactions` have been decided, and what may be committed.

faust commits the offsets a stream acks. With ``take_events()`` and an eager
rebalance that loses transactions (RELIABILITY.md, gap 1): events fetched
before a revocation are still delivered or acked after the partition has been
reassigned, faust fills the hole before them as a "gap" it treats as acked, or
drops the re-fetched records as already read, and its commit moves past offsets
that were never scored.

So the scoring agent keeps its own books, and the `transactions` topic is
declared with ``acks=False`` so faust never commits it:

- on assignment, each partition's *next offset to decide* is read from the
  group's committed offset (the log start when there is none);
- a batch is filtered before scoring: an event of a partition not assigned
  now, or below the next offset (already decided), is skipped; one *above* it
  means records in between never reached the agent, so the partition is sought
  back to the next offset and its events are skipped until that offset arrives;
- a batch's outcomes and its next offsets are committed in one Kafka
  transaction per partition (app/transactional.py); the next offsets advance
  for the partitions whose transaction committed.

A seek can be undone by records already on their way (faust then drops the
re-fetched ones as read), so a partition still waiting after ``reseek_after_s``
is sought back again, by the next batch or by the watchdog timer. Offsets
within a partition are contiguous only when producers are not transactional: a
transactional producer's commit markers (and compaction) leave real holes. So
the agent reads the log at every hole it meets, with a reader of its own
(app/commits.py): offsets that hold no committed record are skipped at once
(``skip_to``); a record there means faust did not deliver it, and the partition
is sought back. A partition whose seeks keep failing is checked again after
``max_seeks``. Nothing is ever skipped on a guess.

A partition can also go quiet with records waiting and no hole to see: the
agent receives nothing of it at all, so nothing above trips. ``stalled``
reports an assigned partition whose consumer fetch highwater is past its next
offset but that decided nothing for ``after_s``; the watchdog timer
(``FRAUD_WATCHDOG_INTERVAL_S``) then logs the fetch state and seeks it back
(app/commits.py). Seen in the CI run that
found it and in 5 of 44 runs of the rebalance test since, when the surviving
worker got its partitions back: faust dropped records aiokafka had already
handed it (RELIABILITY.md, gap 1).

Pure bookkeeping, no I/O: the glue to faust's consumer (assignment, seeks,
reading the log at a hole, the watchdog's timer) is :mod:`app.commits`, wired
into the scoring agent by :mod:`agents.score`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Generic, TypeVar

__all__ = ["Admitted", "PartitionProgress"]

log = logging.getLogger(__name__)

TP = TypeVar("TP", bound=Hashable)
E = TypeVar("E")


@dataclass
class Admitted(Generic[TP, E]):
    """The events of a batch that should be scored, and what to do about the rest."""

    events: list[E]
    generation: int
    #: partition -> offset to seek back to (records before the first event seen never arrived)
    rewind: dict[TP, int] = field(default_factory=dict)
    #: partition -> (next offset, first offset seen) after ``max_seeks`` seeks did not bring
    #: the next one: the caller reads the log to tell a real hole from records faust drops
    verify: dict[TP, tuple[int, int]] = field(default_factory=dict)
    skipped_unassigned: int = 0
    skipped_decided: int = 0
    skipped_rewinding: int = 0


@dataclass
class _Rewind:
    offset: int
    since: float
    last_seek: float
    seeks: int = 1


class PartitionProgress(Generic[TP]):
    """Next offset to decide per assigned partition; see the module docstring."""

    def __init__(self, reseek_after_s: float = 1.0, max_seeks: int = 10) -> None:
        self.reseek_after_s = reseek_after_s
        self.max_seeks = max_seeks
        #: rebalances seen; a batch admitted in one generation cannot move offsets in another
        self.generation = 0
        self._next: dict[TP, int] = {}  # decided and delivered up to here (exclusive)
        self._admitted: dict[TP, int] = {}  # handed to a batch up to here (exclusive)
        self._committed: dict[TP, int] = {}  # last offset committed (or read at assignment)
        self._rewinding: dict[TP, _Rewind] = {}
        self._quiet_since: dict[TP, float] = {}  # first check that saw no move (see ``stalled``)

    # --- rebalance ------------------------------------------------------------------------------

    def assign(self, positions: Mapping[TP, int]) -> None:
        """Partitions assigned, each with the group's committed offset (or the log start)."""
        self.generation += 1
        self._next = dict(positions)
        self._admitted = dict(positions)
        self._committed = dict(positions)
        self._rewinding.clear()
        self._quiet_since.clear()

    def revoke(self) -> dict[TP, int]:
        """Partitions revoked: returns what is still to commit, and forgets everything."""
        pending = self.uncommitted()
        self.generation += 1
        self._next.clear()
        self._admitted.clear()
        self._committed.clear()
        self._rewinding.clear()
        self._quiet_since.clear()
        return pending

    @property
    def assigned(self) -> frozenset[TP]:
        return frozenset(self._next)

    # --- batches --------------------------------------------------------------------------------

    def admit(self, events: Iterable[E], key: Callable[[E], tuple[TP, int]], now: float) -> Admitted[TP, E]:
        """Filter a batch: keep the events that are next in their partition, in order."""
        out: Admitted[TP, E] = Admitted(events=[], generation=self.generation)
        for event in events:
            tp, offset = key(event)
            expected = self._admitted.get(tp)
            if expected is None:
                out.skipped_unassigned += 1
                continue
            rewind = self._rewinding.get(tp)
            if offset < expected:
                out.skipped_decided += 1
                continue
            if offset == expected:
                if rewind is not None:
                    del self._rewinding[tp]
                out.events.append(event)
                self._admitted[tp] = offset + 1
                continue
            # offset > expected: records in between did not reach us.
            if rewind is None:
                self._rewinding[tp] = _Rewind(expected, since=now, last_seek=now)
                out.rewind[tp] = expected
                out.skipped_rewinding += 1
            elif now - rewind.last_seek < self.reseek_after_s:
                out.skipped_rewinding += 1  # most likely on its way since before the seek
            elif rewind.seeks < self.max_seeks:
                rewind.seeks += 1
                rewind.last_seek = now
                out.rewind[tp] = expected
                out.skipped_rewinding += 1
            else:
                # Never skipped on a guess: the caller checks the log (skip_to) or keeps seeking.
                rewind.seeks = 0
                rewind.last_seek = now
                out.verify[tp] = (expected, offset)
                out.skipped_rewinding += 1
        return out

    def skip_to(self, tp: TP, offset: int) -> None:
        """Offsets of ``tp`` below ``offset`` were read from the log and hold no
        record to decide (transaction markers, compaction): continue from ``offset``."""
        if tp in self._admitted and offset > self._admitted[tp]:
            self._admitted[tp] = offset
            self._rewinding.pop(tp, None)

    def forget(self, tps: Iterable[TP]) -> None:
        """This worker lost ``tps`` (fenced by their new owner): skip them until the next assignment."""
        for tp in tps:
            for books in (self._next, self._admitted, self._committed, self._rewinding, self._quiet_since):
                books.pop(tp, None)

    def done(
        self, admitted: Admitted[TP, E], key: Callable[[E], tuple[TP, int]], only: set[TP] | None = None
    ) -> bool:
        """The batch's outcomes were delivered (for the partitions in ``only``,
        when given): they move on. False if a rebalance came in between (nothing
        moves; the new owner decides them again)."""
        if admitted.generation != self.generation:
            return False
        for event in admitted.events:
            tp, offset = key(event)
            if only is not None and tp not in only:
                continue
            if tp in self._next and offset >= self._next[tp]:
                self._next[tp] = offset + 1
                self._quiet_since.pop(tp, None)
        return True

    def stalled_rewinds(self, now: float) -> dict[TP, int]:
        """Partitions still waiting for a sought offset (no batch came to re-seek them)."""
        due: dict[TP, int] = {}
        for tp, rewind in self._rewinding.items():
            if now - rewind.last_seek >= self.reseek_after_s:
                rewind.last_seek = now
                due[tp] = rewind.offset
        return due

    def stalled(self, now: float, highwater: Callable[[TP], int | None], after_s: float) -> dict[TP, int]:
        """Partitions with records past their next offset (``highwater``: the
        consumer's fetch highwater, None when unknown) that decided nothing for
        ``after_s`` and wait on no rewind: the agent is not receiving them.
        Each is reported once per ``after_s`` while it stays stuck.

        The clock of a partition starts at the first call that finds it not
        moved, so it reads in steps of the caller's period."""
        due: dict[TP, int] = {}
        for tp, offset in self._next.items():
            end = highwater(tp)
            if tp in self._rewinding or end is None or end <= offset:
                self._quiet_since.pop(tp, None)
                continue
            since = self._quiet_since.setdefault(tp, now)
            if now - since >= after_s:
                self._quiet_since[tp] = now
                due[tp] = offset
        return due

    # --- commits --------------------------------------------------------------------------------

    def uncommitted(self) -> dict[TP, int]:
        """Offsets to commit: partitions that moved since their last commit."""
        return {tp: n for tp, n in self._next.items() if self._committed.get(tp) != n}

    def committed(self, offsets: Mapping[TP, int], generation: int) -> None:
        """A commit of ``offsets`` (taken in ``generation``) succeeded."""
        if generation == self.generation:
            self._committed.update({tp: n for tp, n in offsets.items() if tp in self._next})

    def positions(self) -> dict[TP, int]:
        return dict(self._next)

    def committed_offsets(self) -> dict[TP, int]:
        """The group's committed offset (next to read) per assigned partition (for lag metrics)."""
        return dict(self._committed)


def event_position(event: object) -> tuple[object, int]:
    """(topic-partition, offset) of a faust event."""
    message = event.message  # type: ignore[attr-defined]
    return message.tp, message.offset

