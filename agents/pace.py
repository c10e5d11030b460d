"""When the scoring loop takes a batch, and when its transaction commits.

A record is decided as soon as the worker can: the loop takes what is queued
(``FRAUD_BATCH_WINDOW_S``, 0 by default: no wait for a batch to fill), and
the open transaction commits as soon as a take comes back with less than a
full batch (``FRAUD_COMMIT_CAUGHT_UP``): the worker has caught up with its
partitions, so nothing is gained by keeping the transaction open. The next
batch is scored while that commit runs (agents/score.py), so a commit costs
the loop only what it takes beyond scoring.

Batches grow with the load by themselves: what arrives while one batch is
scored and committed is the next batch. Only when a queue has formed (a take
fills a whole batch of ``FRAUD_BATCH_SIZE``) does a transaction span
consecutive batches, for at most ``FRAUD_COMMIT_INTERVAL_S``: the number of
transactions a second, and what each costs the broker (its requests, a marker
in every partition written), stays bounded however deep the backlog.

Why not wait for fuller batches at low rates: a batch and a transaction each
cost a fixed amount of CPU (~1 ms of librdkafka's per commit on a 2-core
machine), and waiting for ~25 records before committing halved the worker's
CPU per decision at 100 TPS, but every payment then waited up to 100 ms for
others to arrive, at the rates where the machine had the most room
(docs/performance.md). Latency is what a shopper sees; idle CPU is not.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["IDLE_WAIT_S", "Pace"]

#: How long an idle worker waits for a record before looking around (a
#: promoted model, shutdown): a record ends the wait as soon as it arrives.
IDLE_WAIT_S = 0.25


@dataclass(frozen=True)
class Pace:
    """The scoring loop's take and commit rules (pure: the clock is passed in)."""

    window_s: float
    """The longest a take waits for a batch to fill, counted from the last take."""
    interval_s: float
    """The longest a transaction stays open over consecutive batches."""
    caught_up: bool = True
    """Commit as soon as a take finds less than a full batch."""

    def waits(self, now: float, last_take: float, opened: float | None) -> tuple[float, float]:
        """(within, idle) for the next take (``ExactlyOnce.take``): wait up to
        ``within`` for a batch to fill and, if nothing came, up to ``idle``
        more for the first record."""
        # NOTE: the window counts from the last take: what arrived while the
        # last batch was scored and committed has waited already.
        within = max(0.0, self.window_s - (now - last_take))
        if opened is None:
            return within, IDLE_WAIT_S  # nothing to commit: sleep until a record comes
        due = max(0.0, opened + self.interval_s - now)
        within = min(within, due)
        # Caught-up commits: an empty take means commit now, so do not wait for
        # a record; otherwise wait for one as long as the commit is not due.
        return within, 0.0 if self.caught_up else due - within

    def commit_due(self, opened: float | None, now: float, *, full: bool) -> bool:
        """Whether the transaction open since ``opened`` commits now, after a
        take that came back ``full`` (a whole batch: a queue has formed) or not."""
        if opened is None:
            return False
        return now - opened >= self.interval_s or (self.caught_up and not full)
