"""The scoring loop's watchdog: a loop that stops stepping dumps its stacks, then exits."""

from __future__ import annotations

import asyncio
import threading

import pytest

from agents.watchdog import EXIT_STATUS, LoopWatchdog, exit_on_failure


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_stepping_loop_is_left_alone_a_stalled_one_is_dumped_once_then_stopped() -> None:
    clock = Clock()
    dog = LoopWatchdog(120.0, clock=clock)
    clock.now += 39.9
    assert dog.check() is None
    clock.now += 0.2  # a third of the limit
    assert dog.check() == "dump"
    clock.now += 10
    assert dog.check() is None  # once per stall
    dog.beat()  # the step ended after all
    clock.now += 39.0
    assert dog.check() is None
    clock.now += 2.0
    assert dog.check() == "dump"  # a new stall is reported again
    clock.now += 80.0
    assert dog.check() == "exit"


def test_the_thread_exits_the_process_of_a_stuck_loop_with_its_stacks(capfd) -> None:
    exited = threading.Event()
    codes: list[int] = []

    def fake_exit(code: int) -> None:
        codes.append(code)
        exited.set()

    dog = LoopWatchdog(0.3, exit=fake_exit)
    dog.start()
    try:
        assert exited.wait(5.0)
    finally:
        dog.stop()
    assert codes == [EXIT_STATUS]
    err = capfd.readouterr().err
    assert "loop-watchdog" in err or "Thread 0x" in err  # faulthandler's dump of every thread


def test_a_loop_that_keeps_stepping_is_never_stopped() -> None:
    codes: list[int] = []
    dog = LoopWatchdog(0.3, exit=codes.append)
    dog.start()
    try:
        for _ in range(20):
            dog.beat()
            threading.Event().wait(0.03)
    finally:
        dog.stop()
    assert codes == []


def test_zero_turns_it_off() -> None:
    codes: list[int] = []
    dog = LoopWatchdog(0.0, exit=codes.append)
    dog.start()
    threading.Event().wait(0.3)
    assert codes == []


def test_a_failed_loop_exits_the_worker_a_cancelled_or_finished_one_does_not() -> None:
    exits: list[int] = []

    async def run(body: BaseException | None) -> None:
        with exit_on_failure("the loop", exit=exits.append):
            await asyncio.sleep(0)
            if body is not None:
                raise body

    asyncio.run(run(RuntimeError("a bug")))
    assert exits == [EXIT_STATUS]
    with pytest.raises(asyncio.CancelledError):  # a clean stop: the worker is stopping anyway
        asyncio.run(run(asyncio.CancelledError()))
    asyncio.run(run(None))
    assert exits == [EXIT_STATUS]
