"""The only broker killed under load and restarted on its log dir: nothing lost or
doubled, and how long until decisions flow again.

Three scoring workers (default settings) score 120 TPS; 10 s in, the single
KRaft node is killed with SIGKILL and started again 7 s later on the same log
dir and ports. A ``read_committed`` aiokafka reader (not the workers' librdkafka
path) checks every transaction. Prints::

    FAULT broker-restart sent=… decided=… dead_lettered=… duplicated=0 disagreeing=0 lost=0 provisional=… down_s=… ready_s=… recover_s=… decide_s=…

``down_s``: broker down (kill to restart); ``ready_s``: the restarted JVM until
this test's probe gets a metadata answer (under load the probe itself lags the
broker by a second or more); ``decide_s``: that answer until the first decision
made after it (``decided_at``); ``recover_s``: until the reader sees one;
``back_s``: the restart until the reader sees the first decision after the kill;
``gap_s``: the longest time the reader saw no decision.

About two minutes: marked ``cluster`` (``make test-cluster``).
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import pandas as pd
import pytest
import redis
from workers import (
    Collector,
    Msg,
    Topics,
    TxFactory,
    Workers,
    committed_offsets,
    duplicate_detail,
    lost_detail,
    make_producer,
    report,
    rescan,
    send_paced,
    tally,
    tx_msg,
    worker_env,
)

from agents.wiring import scoring_group
from app.settings import Settings
from tools import stack
from tools.materialize import materialize

pytestmark = [
    pytest.mark.integration,
    pytest.mark.timeout(400),
    pytest.mark.cluster,  # minutes of load
]

PARTITIONS = 8
RATE = 120.0
LOAD_S = 45.0
KILL_AT_S = 10.0
DOWN_S = 7.0
#: The acceptance: a reader sees decisions again within this long of the
#: broker's return. Its parts, from the broker's and the workers' logs: while
#: the broker is down every worker's consumer loses its group session (6 s,
#: ``FRAUD_SESSION_TIMEOUT_S``) and rejoins with a new member id, and the
#: restarted group coordinator waits out the old members' session before the
#: rebalance completes ("Member … has failed, removing it from the group" 6 s
#: after "Loaded classic group"); then, on 4.4.0, the first transaction's
#: TxnOffsetCommit often goes unanswered and the worker's 2 s hang watchdog
#: (``OFFSETS_HUNG_S``) abandons it and decides those records again (seen in
#: 1 to 3 of the 3 workers, with and without the resend index). Measured 6.3-8.9 s;
#: the bound catches a second rebalance or a worker stuck past its watchdog.
RESUME_S = 10.0


def test_the_only_broker_killed_and_restarted_under_load(
    redis_url: str, sim_frame: pd.DataFrame, trained_registry: Path, tmp_path: Path
) -> None:
    client = redis.Redis.from_url(redis_url)
    try:
        materialize(sim_frame, client, progress=False)
    finally:
        client.close()
    port, controller = stack.free_ports(2)
    broker = stack.start_broker(port, tmp_path / "broker", controller_port=controller)
    bootstrap = broker.url
    topics = Topics.unique("brk")
    env = worker_env(bootstrap=bootstrap, redis_url=redis_url, topics=topics, registry=trained_registry,
                     workdir=tmp_path / "w", partitions=PARTITIONS)  # fmt: skip
    for name in ("FRAUD_MODEL_BUDGET_MS", "FRAUD_REDIS_TIMEOUT_S", "FRAUD_RATE_USER_PER_S", "FRAUD_RATE_USER_BURST"):
        env.pop(name)  # the product's defaults, as users run it
    workers = Workers(tmp_path / "w", env)
    make = TxFactory(sim_frame, f"t-brk-{topics.transactions[-6:]}")
    sent: list[Msg] = []
    times: dict[str, float] = {}
    diagnosis: list[str] = []

    async def scenario() -> Collector:
        nonlocal broker
        await topics.create(bootstrap, PARTITIONS)
        async with Collector(bootstrap, topics, PARTITIONS) as col:
            started = [workers.start() for _ in range(3)]
            for w in started:
                await w.wait_for_log("Ready", 150)
            # Idempotent: the payment client's retries across the crash write each record once.
            producer = make_producer(bootstrap, enable_idempotence=True, request_timeout_ms=60_000)
            await producer.start()
            try:
                load = asyncio.create_task(send_paced(producer, topics.transactions, lambda i: tx_msg(make()),
                                                      rate=RATE, duration=LOAD_S, sent=sent))  # fmt: skip
                await asyncio.sleep(KILL_AT_S)
                os.kill(broker.pid, signal.SIGKILL)
                times["killed"] = time.time()
                await asyncio.sleep(DOWN_S)
                times["restart"] = time.time()
                broker = await asyncio.to_thread(stack.start_broker, port, tmp_path / "broker", controller)
                times["ready"] = time.time()
                await load
            finally:
                await producer.stop()
            await col.wait_all(sent, 120)
            assert all(w.alive() for w in started), workers.logs()
            # What a failure needs said, asked while the broker still runs: whether
            # the lost records were never decided or only not read, where the
            # group's committed offsets stand, and what the doubled ones were.
            t = tally(col, sent, by="transaction")
            if t.lost:
                group = scoring_group(Settings(app_id=env["FRAUD_APP_ID"]))
                committed = await committed_offsets(bootstrap, group, topics.transactions, PARTITIONS)
                diagnosis.append(f"{lost_detail(t, committed)}; {await rescan(bootstrap, col, t.lost_ids)}")
            if t.duplicated:
                diagnosis.append(duplicate_detail(col, t, sent))
            return col

    try:
        col = asyncio.run(scenario())
    finally:
        workers.stop_all()
        broker.stop()
    ready, restart = times["ready"], times["restart"]
    seen = sorted(d["_seen_at"] for d in col.decisions)
    gap_s = max((b - a for a, b in zip(seen, seen[1:], strict=False)), default=0.0)
    back_s = min((x for x in seen if x >= times["killed"]), default=float("inf")) - restart
    seen_after = [d["_seen_at"] for d in col.decisions if d["_seen_at"] >= ready]
    decided_after = [float(d["decided_at"]) for d in col.decisions if float(d["decided_at"]) >= ready]
    recover_s = min(seen_after) - ready if seen_after else float("inf")
    decide_s = min(decided_after) - ready if decided_after else float("inf")
    t = tally(col, sent, by="transaction")
    provisional = sum(bool(d.get("provisional")) for d in col.decisions)
    report(t.line("broker-restart", provisional=provisional, down_s=f"{times['restart'] - times['killed']:.1f}",
                  ready_s=f"{ready - restart:.1f}", recover_s=f"{recover_s:.1f}",
                  decide_s=f"{decide_s:.1f}", back_s=f"{back_s:.1f}", gap_s=f"{gap_s:.1f}"))  # fmt: skip
    why = "\n".join([t.line("broker-restart"), *diagnosis, workers.logs(80)])
    skipped = stack.skipped_markers(tmp_path / "broker")
    if not skipped:
        assert (t.lost, t.duplicated, len(t.mismatched)) == (0, 0, 0), why
    else:
        # NOTE: Kafka 4.4.0 (KRaftMetadataCache since its move to Java, KAFKA-20734)
        # answers "no leader" for a partition whose leader is offline, and the
        # transaction coordinator then takes the partition for a deleted one and
        # completes the transaction without its marker there. The restarted single
        # node is fenced by its own controller a moment after it loads its
        # transactions (every partition leaderless for a second), so a transaction
        # caught by the kill can be left hanging on some partitions: the broker
        # itself breaks exactly-once. What the product still owes then: nothing
        # lost (the resend index's restore stops waiting for a hanging transaction,
        # app/changelog.py) and no decision contradicted; a transaction the
        # coordinator aborted but whose records hang can be committed by the same
        # producer's next commit on those partitions, so agreeing doubles are the
        # broker's, reported and not failed (RELIABILITY.md, known gaps).
        report(f"FAULT broker-restart-skipped-markers lines={len(skipped)} duplicated={t.duplicated} lost={t.lost}")
        assert (t.lost, len(t.mismatched)) == (0, 0), why + "\nthe broker skipped markers:\n" + "\n".join(skipped)
    assert provisional == 0, t.line("broker-restart")
    assert recover_s <= RESUME_S, f"decisions resumed {recover_s:.1f} s after the broker was back"
