"""How long the scoring loop waits for a batch, and when its transaction commits.

Two regimes, chosen by the rate this worker takes records at:

- **busy** (the defaults): a batch is up to ``FRAUD_BATCH_SIZE`` records
  within ``FRAUD_BATCH_WINDOW_S`` (10 ms), and one transaction spans the
  batches of ``FRAUD_COMMIT_INTERVAL_S`` (25 ms). The number of transactions a
  second is bounded whatever the rate: more load makes batches fuller, never
  transactions more frequent.
- **quiet** (under ``FRAUD_QUIET_BELOW_TPS``, 1,200 records a second): a
  batch waits for ~25 records (:data:`QUIET_BATCH`), at least the busy window
  and at most ``FRAUD_QUIET_WINDOW_S`` (100 ms), and commits on its own, at once.

Why: a batch and a transaction each cost the worker a fixed amount of CPU
whatever they hold (a Redis round trip, thread hand-offs, the model call,
the transaction's requests: ~1 ms of librdkafka's CPU per commit on this
machine). At 100 TPS the busy regime's batches hold one record each, so
those fixed costs are paid per decision; at 1,000 about ten. Waiting a little
longer for a fuller batch and committing it right away pays them once per
~10 decisions at 100 TPS and ~25 at 1,000. The price is latency where there
is room for it: at 100 TPS p99 ~120 ms instead of ~70 (the goal is 200); at
1,000 none, as a record waits for its batch, not also for the transaction it
joins (docs/performance.md, ``knobs-quiet-*.json``). At higher rates the busy
regime's shape is kept: one transaction per batch is bounded by the commit's
round trips (a batch of at most ``FRAUD_BATCH_SIZE`` per commit), and at
2,000 TPS with 25 ms windows it fell behind.

The rate is counted over whole periods of about a second, and the switch has
hysteresis (into quiet below 80 % of the threshold, out above it), so a rate
near the threshold does not flip the regime every period. A full batch ends
the quiet regime at once: an idle worker is quiet, and a burst (or a backlog
after a restart) must not wait a period or two for the busy regime.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

__all__ = ["Pace", "QUIET_BATCH", "QUIET_HYSTERESIS", "RATE_PERIOD_S"]

log = logging.getLogger(__name__)

#: Records are counted over periods of at least this long.
RATE_PERIOD_S = 1.0
#: Quiet is entered below this share of the threshold, left above the threshold.
QUIET_HYSTERESIS = 0.8
#: The records a quiet batch waits for (at most ``quiet_window_s``): by ~25 a
#: batch's fixed costs are a small share of its decisions' CPU, and the wait
#: for them shrinks as the rate grows (25 ms at 1,000 TPS, 50 at 500, 100 at 250 and under).
QUIET_BATCH = 25


@dataclass
class Pace:
    """The scoring loop's batch window and commit interval (pure: the clock is passed in)."""

    window_s: float
    """The busy regime's batch window."""
    interval_s: float
    """The busy regime's commit interval."""
    quiet_window_s: float
    """The quiet regime's batch window; each batch commits at once."""
    quiet_below_tps: float
    """The rate under which the quiet regime is used; 0: never."""
    quiet: bool = False
    rate_tps: float | None = None
    """The rate over the last whole period; None before the first."""
    _since: float | None = field(default=None, repr=False)
    _count: int = field(default=0, repr=False)

    @property
    def window(self) -> float:
        if not self.quiet:
            return self.window_s
        if not self.rate_tps:
            return self.quiet_window_s
        # As long as ~QUIET_BATCH records take to arrive, within [window_s, quiet_window_s].
        return min(self.quiet_window_s, max(self.window_s, QUIET_BATCH / self.rate_tps))

    @property
    def interval(self) -> float:
        return 0.0 if self.quiet else self.interval_s

    def taken(self, records: int, now: float, *, full: bool = False) -> None:
        """Count a take of ``records`` (0 included) at ``now`` (``time.monotonic()``);
        ``full``: the take returned as many records as a batch holds."""
        if self._since is None:
            self._since = now  # the first take starts the first period
            return
        self._count += records
        if full and self.quiet:
            # A burst (or a backlog): records come faster than a quiet batch
            # holds them. Busy at once, not after the period: one transaction
            # per full batch falls behind where shared ones keep up.
            self._switch(False, None)
            self._since, self._count = now, 0
            return
        elapsed = now - self._since
        if elapsed < RATE_PERIOD_S:
            return
        self.rate_tps = rate = self._count / elapsed
        self._since, self._count = now, 0
        if self.quiet_below_tps <= 0:
            return
        if self.quiet:
            quiet = rate <= self.quiet_below_tps
        else:
            quiet = rate < self.quiet_below_tps * QUIET_HYSTERESIS
        if quiet != self.quiet:
            self._switch(quiet, rate)

    def _switch(self, quiet: bool, rate: float | None) -> None:
        self.quiet = quiet
        log.info(
            "%s: %s",
            "a full batch" if rate is None else f"{rate:.0f} records/s",
            f"quiet: batches of up to {self.quiet_window_s * 1000:.0f} ms, each committed at once"
            if quiet
            else f"busy: batches of up to {self.window_s * 1000:.0f} ms, one transaction per "
            f"{self.interval_s * 1000:.0f} ms",
        )
