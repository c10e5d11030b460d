"""Retry with a doubling back-off, for calls to a service that may be away for a while.

One loop for every place that waits out a broker or Redis outage the same way:
try, sleep, try again with the sleep doubled, and give up (raising the last
error) after a number of attempts or past a deadline.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

__all__ = ["retry"]

T = TypeVar("T")


async def retry(
    call: Callable[[], Awaitable[T]],
    *,
    first_s: float,
    cap_s: float = math.inf,
    attempts: int | None = None,
    deadline: float | None = None,
    retry_on: tuple[type[Exception], ...] = (Exception,),
    on_retry: Callable[[Exception, float], None] | None = None,
) -> T:
    """What ``call()`` returns, calling it again after each failure in ``retry_on``.

    The first sleep is ``first_s``; each one after it doubles, up to ``cap_s``.
    The last error is raised once ``attempts`` calls have failed, or when the
    next sleep would end past ``deadline`` (a ``time.monotonic()`` time); with
    neither it retries for as long as the call fails. ``on_retry(error, sleep)``
    is called before each sleep (to log the wait). Cancellation is never retried.
    """
    delay = first_s
    failed = 0
    while True:
        try:
            return await call()
        except retry_on as exc:
            failed += 1
            if attempts is not None and failed >= attempts:
                raise
            if deadline is not None and time.monotonic() + delay > deadline:
                raise
            if on_retry is not None:
                on_retry(exc, delay)
            await asyncio.sleep(delay)
            delay = min(delay * 2, cap_s)
