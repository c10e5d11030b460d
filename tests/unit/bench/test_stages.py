"""A profile's samples by stage: a thread blocked in a wait is waiting, not working."""

from __future__ import annotations

from bench.stages import breakdown


def test_a_sample_waiting_in_a_pool_or_condition_is_a_wait_not_its_caller_s_stage() -> None:
    lines = [
        # the client thread idle between calls, and waiting on the offsets thread's answer
        "thread (1): eos_0;_bootstrap (threading.py:1002);_worker (concurrent/futures/thread.py:81) 5",
        "thread (1): eos_0;_worker (concurrent/futures/thread.py:83);_WorkItem.run (concurrent/futures/thread.py:58);"
        "ExactlyOnce._send (app/eos.py:510);Future.result (concurrent/futures/_base.py:451);"
        "Condition.wait (threading.py:331) 3",
        # the same thread producing: the transaction's own work
        "thread (1): eos_0;_worker (concurrent/futures/thread.py:83);_WorkItem.run (concurrent/futures/thread.py:58);"
        "ExactlyOnce._send (app/eos.py:515) 2",
        "thread (2): MainThread;BaseEventLoop._run_once (asyncio/base_events.py:1898);"
        "EpollSelector.select (selectors.py:468) 4",
        "thread (2): MainThread;ScoringLoop.step (agents/score.py:131);DecisionSigner.headers "
        "(pipeline/decision_signing.py:132) 6",
    ]
    got = breakdown(lines)
    assert got["samples"] == 20
    assert got["stage_pct"] == {
        "threads waiting (pool queue, condition)": 40.0,
        "sign decisions (Ed25519)": 30.0,
        "event loop waiting (epoll)": 20.0,
        "produce + commit (librdkafka transaction)": 10.0,
    }
