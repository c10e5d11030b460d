"""app.retry: the doubling back-off shared by the broker wait and the feedback loop's writes."""

from __future__ import annotations

import asyncio
import time

import pytest

from app import retry as retry_module
from app.retry import retry


class Flaky:
    """Fails ``failures`` times with ``error``, then returns ``"ok"``."""

    def __init__(self, failures: int, error: Exception | None = None) -> None:
        self.failures = failures
        self.error = error or ConnectionError("away")
        self.calls = 0

    async def __call__(self) -> str:
        self.calls += 1
        if self.calls <= self.failures:
            raise self.error
        return "ok"


@pytest.fixture
def sleeps(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The sleeps asked for, without sleeping."""
    asked: list[float] = []

    async def fake_sleep(delay: float) -> None:
        asked.append(delay)

    monkeypatch.setattr(retry_module.asyncio, "sleep", fake_sleep)
    return asked


def test_sleeps_double_up_to_the_cap_until_the_call_succeeds(sleeps: list[float]) -> None:
    call = Flaky(5)
    seen: list[tuple[str, float]] = []
    result = asyncio.run(retry(call, first_s=0.25, cap_s=1.0, on_retry=lambda exc, s: seen.append((str(exc), s))))
    assert result == "ok" and call.calls == 6
    assert sleeps == [0.25, 0.5, 1.0, 1.0, 1.0]
    assert seen == [("away", s) for s in sleeps]


def test_gives_up_with_the_last_error_after_the_attempts_without_a_last_sleep(sleeps: list[float]) -> None:
    call = Flaky(10)
    with pytest.raises(ConnectionError):
        asyncio.run(retry(call, first_s=0.2, attempts=3))
    assert call.calls == 3
    assert sleeps == [0.2, 0.4]


def test_gives_up_when_the_next_sleep_would_pass_the_deadline(sleeps: list[float]) -> None:
    call = Flaky(10)
    with pytest.raises(ConnectionError):
        asyncio.run(retry(call, first_s=1.0, deadline=time.monotonic() + 1.5))
    assert sleeps == [1.0]  # a second sleep of 2 s would end past the deadline (no real time passes)
    assert call.calls == 2


def test_other_errors_are_not_retried(sleeps: list[float]) -> None:
    call = Flaky(1, ValueError("a bug"))
    with pytest.raises(ValueError):
        asyncio.run(retry(call, first_s=0.1, retry_on=(ConnectionError,)))
    assert call.calls == 1 and sleeps == []
