"""A scoring loop that stops stepping is a dead worker: say where it stopped, then exit.

Every step of the scoring loop is bounded (a take waits at most the idle wait,
every transactional call its timeout, Redis calls theirs), so a loop that has
not finished a step in ``FRAUD_LOOP_STALL_EXIT_S`` is stuck where no timeout
reaches. Such a worker still heartbeats its consumer group from librdkafka's
own threads, so the group never moves its partitions: their payments wait
with nobody deciding them and nothing in the log. The watchdog, a thread of
its own (it must run while the event loop or the client thread is blocked):

- after a third of the limit, logs every thread's stack and the scoring
  task's, once per stall: where it is stuck;
- at the limit, exits the process (status 70) so its supervisor restarts it
  and the group moves its partitions meanwhile. Nothing is lost: as after a
  ``kill -9``, the open transaction stays invisible and is aborted by the
  restarted worker (same ``FRAUD_WORKER_ID``) or the broker's transaction
  timeout, and the records are decided again from the committed offsets.

At any time, ``kill -USR1`` makes the worker (faust's ``mode``) print every
thread's stack and every task's to stderr, as long as the event loop runs.
"""

from __future__ import annotations

import asyncio
import faulthandler
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

__all__ = ["EXIT_STATUS", "LoopWatchdog", "exit_on_failure"]

log = logging.getLogger(__name__)

#: The exit status of a worker that stopped itself (as for a failed loop).
EXIT_STATUS = 70


@contextmanager
def exit_on_failure(what: str, exit: Callable[[int], object] = os._exit) -> Iterator[None]:
    """Around a loop the worker cannot do without (the scoring loop, the
    feedback loop): any failure but a cancellation (a clean stop) is logged
    and exits the process with :data:`EXIT_STATUS`, so its supervisor
    restarts it, rather than leaving a worker that serves ``/metrics`` and
    does nothing. What the loop had not committed is read again after the
    restart."""
    try:
        yield
    except asyncio.CancelledError:
        raise
    except BaseException:
        log.critical("%s failed; exiting so the worker is restarted", what, exc_info=True)
        exit(EXIT_STATUS)


class LoopWatchdog:
    """Watches :meth:`beat`; see the module's docstring."""

    def __init__(
        self,
        exit_after_s: float,
        *,
        clock: Callable[[], float] = time.monotonic,
        exit: Callable[[int], object] = os._exit,
    ) -> None:
        self.exit_after_s = exit_after_s
        self.warn_after_s = exit_after_s / 3
        self._clock = clock
        self._exit = exit
        self._last = clock()
        self._warned_for = -1.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def beat(self) -> None:
        """The loop finished a step."""
        self._last = self._clock()

    def check(self) -> str | None:
        """What a stall this long calls for: ``"dump"`` (once per stall), ``"exit"`` or None."""
        stalled = self._clock() - self._last
        if stalled >= self.exit_after_s:
            return "exit"
        if stalled >= self.warn_after_s and self._warned_for != self._last:
            self._warned_for = self._last
            return "dump"
        return None

    def start(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        if self.exit_after_s <= 0:
            return  # off
        self._loop = loop
        self.beat()
        self._thread = threading.Thread(target=self._run, name="loop-watchdog", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        every = min(1.0, self.warn_after_s / 4)
        while not self._stop.wait(every):
            action = self.check()
            if action == "dump":
                log.error(
                    "the scoring loop has not finished a step in %.0f s (it exits at %.0f s): stacks follow",
                    self._clock() - self._last,
                    self.exit_after_s,
                )
                self.dump()
            elif action == "exit":
                log.critical(
                    "the scoring loop has not finished a step in %.0f s: exiting so the worker is restarted "
                    "and its partitions move",
                    self.exit_after_s,
                )
                self.dump()
                logging.shutdown()
                self._exit(EXIT_STATUS)
                return

    def dump(self) -> None:
        """Every thread's stack, then (if the event loop still runs) every task's."""
        # NOTE: the process's own stderr: faust replaces sys.stderr with a
        # logging proxy that has no file descriptor for faulthandler to write to.
        stderr = sys.__stderr__  # None only in a process started without one
        if stderr is not None:
            faulthandler.dump_traceback(file=stderr, all_threads=True)
        loop = self._loop
        if loop is not None and loop.is_running():
            loop.call_soon_threadsafe(_dump_tasks)


def _dump_tasks() -> None:
    for task in asyncio.all_tasks():
        frames = task.get_stack()
        if frames:
            where = " <- ".join(f"{f.f_code.co_name} ({f.f_code.co_filename}:{f.f_lineno})" for f in reversed(frames))
            log.error("task %s: %s", task.get_name(), where)
