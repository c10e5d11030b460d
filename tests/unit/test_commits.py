"""The scoring agent's stall watchdog (app/commits.py ``tick``): its diagnostics
read faust's and aiokafka's internals, and may fail; the re-seek may not."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
from aiokafka.structs import TopicPartition

from app import seams
from app.commits import TransactionCommits

TOPIC = "transactions"
TP0 = TopicPartition(TOPIC, 0)


class _Consumer:
    """faust's consumer as the watchdog uses it: flowing, a highwater past the next offset."""

    flow_active = True

    def __init__(self) -> None:
        self.seeks: list[tuple[Any, int]] = []

    def highwater(self, tp: Any) -> int:
        return 100

    async def seek(self, tp: Any, offset: int) -> None:
        self.seeks.append((tp, offset))


def _stalled_commits() -> tuple[TransactionCommits, _Consumer, list[str]]:
    consumer = _Consumer()
    app = SimpleNamespace(consumer=consumer, rebalancing=False)
    commits = TransactionCommits(app, TOPIC, emitter=None, topics={}, stall_after_s=0.0)  # type: ignore[arg-type]
    commits.progress.assign({TP0: 5})  # next offset 5, the log reaches 100: stalled at once
    reasons: list[str] = []
    commits.on_reseek = reasons.append
    return commits, consumer, reasons


def _raise(exc: BaseException) -> Callable[..., Any]:
    def fail(*_: Any, **__: Any) -> Any:
        raise exc

    return fail


def test_tick_reseeks_a_stalled_partition() -> None:
    commits, consumer, reasons = _stalled_commits()
    asyncio.run(commits.tick())
    assert consumer.seeks == [(TP0, 5)]
    assert reasons == ["quiet"]


def test_tick_reseeks_when_the_stall_diagnostics_raise(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    commits, consumer, reasons = _stalled_commits()
    monkeypatch.setattr(commits, "_fetch_state", _raise(AttributeError("'Consumer' has no attribute '_fetcher'")))
    with caplog.at_level(logging.WARNING, logger="app.commits"):
        asyncio.run(commits.tick())
    assert consumer.seeks == [(TP0, 5)]
    assert reasons == ["quiet"]
    assert "fetch state: unknown (AttributeError" in caplog.text


@pytest.mark.parametrize("seam", ["faust_partition_flags", "aiokafka_partition_state", "worker_consumer"])
def test_tick_reseeks_when_a_seam_it_reads_for_diagnostics_raises(
    seam: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    commits, consumer, reasons = _stalled_commits()
    monkeypatch.setattr(seams, "worker_consumer", lambda app: SimpleNamespace())
    flags = dict.fromkeys(("active", "paused", "buffered"), True)
    monkeypatch.setattr(seams, "faust_partition_flags", lambda consumer, tp: flags)
    monkeypatch.setattr(seams, seam, _raise(AttributeError(f"upgraded away: {seam}")))
    with caplog.at_level(logging.WARNING, logger="app.commits"):
        asyncio.run(commits.tick())
    assert consumer.seeks == [(TP0, 5)]
    assert reasons == ["quiet"]
    assert f"fetch state: unknown (AttributeError('upgraded away: {seam}')" in caplog.text


def test_tick_reseeks_when_the_highwater_read_for_the_log_line_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    commits, consumer, reasons = _stalled_commits()
    calls = {"n": 0}

    def highwater(tp: Any) -> int | None:  # answers the stall check, then fails for the log line
        calls["n"] += 1
        if calls["n"] > 1:
            raise AttributeError("gone")
        return 100

    monkeypatch.setattr(commits, "_highwater", highwater)
    asyncio.run(commits.tick())
    assert consumer.seeks == [(TP0, 5)]
    assert reasons == ["quiet"]
