"""Every fault of the replicated stack in one run under load: a broker, a
transaction coordinator and the Redis primary, each lost to ``kill -9``.

The cluster of ``python -m tools.stack up --brokers 3`` (three brokers, three
dedicated KRaft controllers, a Redis primary with 2 replicas and 3 Sentinels);
three scoring workers with the product's default settings score 120 TPS for
90 s, while

1. 15 s in, the broker leading the most ``transactions`` partitions is killed,
   and started again on its log dir and ports 10 s later
   (``CLUSTER_FIRST_KILL=controller``: the active KRaft controller
   instead, a fault of its own: the other two elect a new one, the brokers keep
   serving; its fields are then ``controller_…``);
2. once it is back in every ISR, the broker that coordinates worker 1's
   transactional id (``<app_id>-score-<topic>-<FRAUD_WORKER_ID>``) is killed:
   under load that worker always has a transaction open (one per 25 ms
   commit interval); it is started again 10 s later;
3. 72 s in (once that broker has restarted), the Redis primary is killed; the
   Sentinels promote a replica and the workers follow without a restart.

A second, shorter line (:func:`test_labels_flow_while_a_broker_is_down_and_the_scoring_worker_restarts`)
runs the feedback side: a scoring worker (which keeps the merchant tally) and
a feedback-loop worker, labels for every decision, and, while the broker that
leads the most partitions of the tally's topic is down, the scoring worker
restarted: it must recover the tally from the surviving replicas and decide
again. Prints ``FAULT cluster_labels …`` with the same accounting, and the
labels sent, joined into live quality and counted by the tally.

A ``read_committed`` aiokafka reader (not the workers' librdkafka path)
checks every transaction. Prints::

    FAULT cluster sent=… decided=… dead_lettered=… duplicated=0 disagreeing=0 lost=0 provisional=… recover_s=… gap_s=…

per fault (``broker_`` or ``controller_``, ``coordinator_``, ``redis_``): ``…_recover_s`` from the
kill until the reader sees the first decision made after it (``decided_at``);
``…_gap_s`` the longest time the reader saw no decision, of the silences that
ended after the kill and by the next fault (the restart 10 s later included),
``…_gap_from_s`` when that silence began, from the kill. ``recover_s`` is the
longest of the three recoveries, ``gap_s`` the longest silence of the whole
run; ``events`` when each step happened, from the start of the load. The
acceptance: losing any one broker (or controller), or the coordinator, leaves
no gap over 5 s.

Several minutes (six JVMs, three workers and the load on two cores): marked
``cluster`` (``make test-cluster``).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import pandas as pd
import pytest
from aiokafka import AIOKafkaConsumer
from aiokafka.admin import AIOKafkaAdminClient
from workers import (
    REPO,
    Collector,
    Msg,
    Topics,
    TxFactory,
    Workers,
    committed_offsets,
    end_offsets,
    make_producer,
    read_shares,
    report,
    send_all,
    send_paced,
    tally,
    tally_by_merchant,
    tx_msg,
    worker_env,
)

from app.redis_client import sync_client
from app.settings import Settings
from tools import cluster, redis_ha
from tools.materialize import materialize

pytestmark = [
    pytest.mark.integration,
    pytest.mark.timeout(600),
    pytest.mark.cluster,  # minutes of load on six JVMs
]

PARTITIONS = 8
RATE = 120.0
LOAD_S = 90.0
BROKER_AT_S = 15.0
#: The earliest the coordinator is killed: it also waits for the first node to be back in sync.
COORDINATOR_AT_S = 40.0
#: When the Redis primary is killed: while the coordinator's node restarts
#: (a node restarted under load took 10-30 s to be back here, and the load is
#: 90 s), so this fault always meets the load.
REDIS_AT_S = 72.0
DOWN_S = 10.0
#: The acceptance: losing any one broker or the coordinator leaves no longer gap in decisions.
MAX_GAP_S = 5.0
#: ``find_coordinator``'s key type for a transactional id (0: a group).
TRANSACTION_COORDINATOR = 1
#: ``CLUSTER_FIRST_KILL=controller``: the first fault takes the active
#: KRaft controller process instead of a broker: the quorum elects another
#: while the brokers keep their leaderships (RELIABILITY.md).
FIRST_KILL = os.environ.get("CLUSTER_FIRST_KILL", "leader")
FIRST = "controller" if FIRST_KILL == "controller" else "broker"


@dataclass
class Stack:
    state: Path
    layout: cluster.Cluster
    env: dict[str, str]

    def pid(self, name: str) -> int:
        """The PID that ``up`` (or :func:`cluster.start_node`) wrote for ``name`` (``broker-2``, ``controller-1``)."""
        return int((self.state / f"{name}.pid").read_text())

    @property
    def bootstrap(self) -> str:
        return self.env["KAFKA_BOOTSTRAP"]


@pytest.fixture
def up(tmp_path: Path) -> Iterator[Stack]:
    """The replicated stack, as ``python -m tools.stack up --brokers 3`` starts it, on free ports."""
    state = (tmp_path / "cluster").resolve()
    layout = cluster.Cluster.free()
    try:
        yield Stack(state, layout, cluster.cluster_up(state, layout))
    finally:
        cluster.cluster_down(state)  # stops the PIDs its files name, restarted nodes' included


async def _leader_of_most(settings: Settings, topic: str) -> int:
    parts = (await cluster.describe_partitions(settings, [topic]))[topic]
    leaders: list[int] = [p["leader"] for p in parts]
    return max(set(leaders), key=leaders.count)


async def _coordinator(bootstrap: str, transactional_id: str) -> int:
    """The broker coordinating ``transactional_id`` (its ``__transaction_state`` partition's leader)."""
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        return int(await admin.find_coordinator(transactional_id, TRANSACTION_COORDINATOR))
    finally:
        await admin.close()


async def _in_sync(settings: Settings, topics: Sequence[str], timeout: float = 90.0) -> None:
    """Until every partition of ``topics`` has all 3 replicas in sync."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            now = await cluster.describe_partitions(settings, topics)
        except Exception:  # metadata of a node just back: ask again
            now = {}
        if now and all(len(p["isr"]) == 3 for parts in now.values() for p in parts):
            return
        assert time.monotonic() < deadline, f"not back in sync after {timeout:g} s: {now}"
        await asyncio.sleep(0.5)


def _redis_primary(up: Stack) -> tuple[str, int]:
    """The primary's ``host:port`` and the index of its node (``redis-<i>``)."""
    view = redis_ha.topology([f"redis://127.0.0.1:{port}/0" for port in up.layout.sentinels])
    return view.primary, up.layout.redis_nodes.index(int(view.primary.rsplit(":", 1)[1])) + 1


def _promoted(up: Stack, old: str, timeout: float = 30.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            primary, _ = _redis_primary(up)
        except Exception:  # the Sentinels busy electing: ask again
            primary = old
        if primary != old:
            return primary
        time.sleep(0.1)
    raise AssertionError(f"no replica promoted within {timeout:g} s")


def _gap(seen: Sequence[float], start: float, end: float) -> float:
    """The longest time without a decision seen that ended after ``start`` and
    by ``end``: a silence belongs to the fault it ends after (one that began
    just before the kill counts whole)."""
    pairs = zip(seen, seen[1:], strict=False)
    return max((b - a for a, b in pairs if start < b <= end), default=float("inf"))


def _gap_at(seen: Sequence[float], start: float, end: float) -> float:
    """When (``time.time()``) the silence :func:`_gap` measures began."""
    pairs = [(b - a, a) for a, b in zip(seen, seen[1:], strict=False) if start < b <= end]
    return max(pairs, default=(0.0, start))[1]


def _recover(decisions: Sequence[dict[str, Any]], at: float) -> float:
    """From ``at`` until the reader saw a decision made after it."""
    after = [d["_seen_at"] for d in decisions if float(d["decided_at"]) >= at]
    return min(after) - at if after else float("inf")


def test_a_broker_the_coordinator_and_the_redis_primary_lost_under_load(
    up: Stack, sim_frame: pd.DataFrame, trained_registry: Path, tmp_path: Path
) -> None:
    admin_redis = sync_client(Settings(redis_url=up.env["REDIS_URL"]), timeout_s=30)
    try:
        materialize(sim_frame, admin_redis, progress=False)
        # The replicas have the features, so the promoted one serves them.
        admin_redis.execute_command("WAIT", 2, 10000)
    finally:
        admin_redis.close()
    topics = Topics.unique("clf")
    settings = topics.settings(up.bootstrap, PARTITIONS)
    watched = [*topics.partition_counts(PARTITIONS), "__transaction_state", "__consumer_offsets"]
    env = worker_env(bootstrap=up.bootstrap, redis_url=up.env["REDIS_URL"], topics=topics, registry=trained_registry,
                     workdir=tmp_path / "w", partitions=PARTITIONS)  # fmt: skip
    for name in ("FRAUD_MODEL_BUDGET_MS", "FRAUD_REDIS_TIMEOUT_S", "FRAUD_RATE_USER_PER_S", "FRAUD_RATE_USER_BURST"):
        env.pop(name)  # the product's defaults, as users run it
    workers = Workers(tmp_path / "w", env)
    make = TxFactory(sim_frame, f"t-clf-{topics.transactions[-6:]}")
    sent: list[Msg] = []
    at: dict[str, float] = {}  # time.time() of each event
    nodes: dict[str, int] = {}

    async def kill_node(index: int, event: str, role: str = "broker") -> None:
        os.kill(up.pid(f"{role}-{index}"), signal.SIGKILL)
        at[event] = time.time()
        nodes[event] = index
        await asyncio.sleep(DOWN_S)
        at[f"{event}_restart"] = time.time()
        await asyncio.to_thread(cluster.start_node, up.state, index, role)  # same config, log dir and ports
        at[f"{event}_ready"] = time.time()

    async def in_sync(event: str) -> None:
        await _in_sync(settings, watched)
        at[f"{event}_in_sync"] = time.time()

    async def scenario() -> Collector:
        await topics.create(up.bootstrap, PARTITIONS)
        await _in_sync(settings, watched)
        async with Collector(up.bootstrap, topics, PARTITIONS) as col:
            started = [workers.start(FRAUD_WORKER_ID=f"w{i}") for i in (1, 2, 3)]
            for w in started:
                await w.wait_for_log("Ready", 180)
            txid = f"{env['FRAUD_APP_ID']}-score-{topics.transactions}-w1"
            # Idempotent: the payment client's retries across the crash write each record once.
            producer = make_producer(up.bootstrap, enable_idempotence=True, request_timeout_ms=60_000)
            await producer.start()
            try:
                begin = time.monotonic()
                load = asyncio.create_task(send_paced(producer, topics.transactions, lambda i: tx_msg(make()),
                                                      rate=RATE, duration=LOAD_S, sent=sent))  # fmt: skip
                at["load"] = time.time()
                await asyncio.sleep(BROKER_AT_S)
                if FIRST == "controller":
                    await kill_node(cluster.active_controller(up.state), FIRST, "controller")
                else:
                    await kill_node(await _leader_of_most(settings, topics.transactions), FIRST)
                await in_sync(FIRST)
                await asyncio.sleep(max(0.0, begin + COORDINATOR_AT_S - time.monotonic()))
                # Restarted in the background: a node takes 10-30 s to be back on
                # these cores, and the Redis primary must die under load, on time.
                coordinator = asyncio.create_task(kill_node(await _coordinator(up.bootstrap, txid), "coordinator"))
                await asyncio.sleep(max(0.0, begin + REDIS_AT_S - time.monotonic()))
                old, index = await asyncio.to_thread(_redis_primary, up)
                os.kill(up.pid(f"redis-{index}"), signal.SIGKILL)
                at["redis"] = time.time()
                await asyncio.to_thread(_promoted, up, old)
                at["redis_promoted"] = time.time()
                await load
                at["load_end"] = time.time()
                await coordinator
                await in_sync("coordinator")
            finally:
                await producer.stop()
            if await col.wait_all(sent, 30, settle=0) >= 30:
                # Still waiting: every worker prints its threads' and tasks' stacks
                # (faust's SIGUSR1) into its log, kept in tmp_path, for a stuck one.
                for w in started:
                    if w.alive():
                        os.kill(w.pid, signal.SIGUSR1)
                await col.wait_all(sent, 120)
            # The Redis failover is followed in place: the same three processes throughout.
            assert all(w.alive() for w in started), workers.logs()
            return col

    try:
        col = asyncio.run(scenario())
    finally:
        workers.stop_all()
    seen = sorted(d["_seen_at"] for d in col.decisions)
    ends = {FIRST: at["coordinator"], "coordinator": at["redis"], "redis": at["load_end"]}
    gaps = {f: _gap(seen, at[f], end) for f, end in ends.items()}
    recover = {f: _recover(col.decisions, at[f]) for f in ends}
    degraded = [d for d in col.decisions if d["degraded"] and d["_seen_at"] >= at["redis"]]
    t = tally(col, sent, by="transaction")

    def offsets(key: str) -> str:
        return f"{at[key] - at['load']:.0f}s"

    events = "/".join(f"{name}@{offsets(name)}" for name in sorted(at, key=at.__getitem__) if name != "load")
    events = events.replace(f"{FIRST}@", f"{FIRST}{nodes[FIRST]}@").replace(
        "coordinator@", f"coordinator{nodes['coordinator']}@"
    )
    report(t.line("cluster", provisional=sum(bool(d.get("provisional")) for d in col.decisions),
                  recover_s=f"{max(recover.values()):.1f}", gap_s=f"{_gap(seen, at['load'], at['load_end']):.1f}",
                  **{f"{f}_recover_s": f"{s:.1f}" for f, s in recover.items()},
                  **{f"{f}_gap_s": f"{s:.1f}" for f, s in gaps.items()},
                  **{f"{f}_gap_from_s": f"{_gap_at(seen, at[f], end) - at[f]:+.1f}" for f, end in ends.items()},
                  redis_degraded=len(degraded), promoted_s=f"{at['redis_promoted'] - at['redis']:.1f}",
                  events=events))  # fmt: skip
    assert (t.lost, t.duplicated, len(t.mismatched)) == (0, 0, 0), t.line("cluster")
    assert max(gaps[FIRST], gaps["coordinator"]) <= MAX_GAP_S, gaps
    # The Redis primary's loss degrades decisions; the resend index (its changelog at RF 3) needs no Redis.
    assert not [d for d in col.decisions if d.get("provisional")], "provisional decisions"


# --- labels flowing through a broker loss and a worker restart ---------------------------------

LABELS_RATE = 30.0
LABELS_LOAD_S = 60.0
#: The broker is killed this far into the load, the scoring worker stopped 2 s
#: later and started again; the broker stays down until the new worker has
#: decided for a few seconds, so its start (the tally's recovery) meets the loss.
LABELS_KILL_AT_S = 10.0


async def _faust_topics(settings: Settings, app_id: str) -> dict[str, list[dict[str, Any]]]:
    """The topics the workers create themselves: the merchant tally's, and
    faust's own of the app ``app_id`` and of its feedback workers."""
    admin = AIOKafkaAdminClient(bootstrap_servers=settings.kafka_bootstrap)
    await admin.start()
    try:
        names = [t for t in await admin.list_topics() if t.startswith(f"{app_id}-")]
    finally:
        await admin.close()
    return await cluster.describe_partitions(settings, names)


def test_labels_flow_while_a_broker_is_down_and_the_scoring_worker_restarts(
    up: Stack, sim_frame: pd.DataFrame, trained_registry: Path, tmp_path: Path
) -> None:
    admin_redis = sync_client(Settings(redis_url=up.env["REDIS_URL"]), timeout_s=30)
    try:
        materialize(sim_frame, admin_redis, progress=False)
    finally:
        admin_redis.close()
    topics = Topics.unique("cll")
    settings = topics.settings(up.bootstrap, PARTITIONS)
    env = worker_env(bootstrap=up.bootstrap, redis_url=up.env["REDIS_URL"], topics=topics, registry=trained_registry,
                     workdir=tmp_path / "w", partitions=PARTITIONS, FRAUD_QUALITY_EVERY_S="1")  # fmt: skip
    app_id = env["FRAUD_APP_ID"]
    tally_topic = f"{app_id}-merchant-tally"
    workers = Workers(tmp_path / "w", env)
    make = TxFactory(sim_frame, f"t-cll-{topics.transactions[-6:]}")
    sent: list[Msg] = []
    labels: dict[str, dict[str, Any]] = {}  # by transaction id
    at: dict[str, float] = {}
    victim = 0
    resent: list[tuple[str, Msg]] = []  # (the first decision's transaction id, its resend)

    async def label_decided(col: Collector, producer: Any, until: asyncio.Event) -> None:
        """A label for each decision once it is read, as an analyst or a chargeback would."""
        futures = []
        while not until.is_set():
            for m in list(sent):
                txid = m.transaction_id
                if txid is None or txid in labels or not col.by_tx.get(txid):
                    continue
                if col.by_tx[txid][0]["action"] == "reject":
                    continue  # no feedback record to join (an invalid or rate-limited message)
                doc = orjson.loads(m.value)
                label = {"transaction_id": txid, "label": "fraud" if len(labels) % 7 == 0 else "legit",
                         "source": "chargeback", "merchant_id": doc["merchant_id"]}  # fmt: skip
                labels[txid] = label
                futures.append(await producer.send(topics.labels, orjson.dumps(label), key=txid.encode()))
            await asyncio.sleep(0.5)
        await asyncio.gather(*futures)

    async def scenario() -> Collector:
        nonlocal victim
        await topics.create(up.bootstrap, PARTITIONS)
        async with Collector(up.bootstrap, topics, PARTITIONS) as col:
            scorer = workers.start(FRAUD_WORKER_ROLE="score", FRAUD_WORKER_ID="s1")
            feedback = workers.start(FRAUD_WORKER_ROLE="feedback")
            for w in (scorer, feedback):
                await w.wait_for_log("Ready", 180)
            # faust's own topics, as the replicated stack's: 3 replicas, all in sync.
            internal = await _faust_topics(settings, app_id)
            expected = {tally_topic, f"{app_id}-__assignor-__leader", f"{app_id}-feedback-host-__assignor-__leader"}
            assert expected <= set(internal), sorted(internal)
            replication = {t: {(len(p["replicas"]), len(p["isr"])) for p in parts} for t, parts in internal.items()}
            assert all(r == {(3, 3)} for r in replication.values()), replication
            leaders = [p["leader"] for p in internal[tally_topic]]
            victim = max(set(leaders), key=leaders.count)
            producer = make_producer(up.bootstrap, enable_idempotence=True, request_timeout_ms=60_000)
            await producer.start()
            done_labelling = asyncio.Event()
            try:
                begin = time.monotonic()
                load = asyncio.create_task(send_paced(producer, topics.transactions, lambda i: tx_msg(make()),
                                                      rate=LABELS_RATE, duration=LABELS_LOAD_S, sent=sent))  # fmt: skip
                labeller = asyncio.create_task(label_decided(col, producer, done_labelling))
                at["load"] = time.time()
                await asyncio.sleep(LABELS_KILL_AT_S)
                os.kill(up.pid(f"broker-{victim}"), signal.SIGKILL)
                at["broker"] = time.time()
                await asyncio.sleep(2.0)
                await scorer.stop_async()
                at["worker_stopped"] = time.time()
                restarted = workers.start(FRAUD_WORKER_ROLE="score", FRAUD_WORKER_ID="s1")
                await restarted.wait_for_log("Ready", 120)
                at["worker_ready"] = time.time()
                # The new worker decides (and the labels go on) with the broker still down.
                await col.wait_for(lambda: any(float(d["decided_at"]) > at["worker_ready"] for d in col.decisions),
                                   60, "a decision of the restarted worker")  # fmt: skip
                # The same payments as 60 the first worker decided, under new ids: the
                # restarted worker restored the resend index (its changelog at RF 3)
                # with the broker down, and answers each with the first decision.
                early = [m for m in sent if m.transaction_id and col.by_tx.get(m.transaction_id)][:60]
                for m in early:
                    doc = orjson.loads(m.value)
                    again = tx_msg({**doc, "transaction_id": f"{doc['transaction_id']}-r"})
                    resent.append((m.transaction_id or "", again))
                await send_all(producer, topics.transactions, [r for _, r in resent])
                await asyncio.sleep(3.0)
                at["broker_restart"] = time.time()
                await asyncio.to_thread(cluster.start_node, up.state, victim)
                at["broker_ready"] = time.time()
                await load
                at["load_end"] = time.time()
                await col.wait_all(sent, 60, settle=0)
                await col.wait_for(lambda: all(col.has_outcome(r) for _, r in resent), 60, "the resends")
                await asyncio.sleep(1.0)  # the labeller's last pass
                done_labelling.set()
                await labeller
                assert time.monotonic() - begin < LABELS_LOAD_S + 90, "the line ran long"
            finally:
                done_labelling.set()
                await producer.stop()
            assert restarted.alive() and feedback.alive(), workers.logs()
            return col

    try:
        col = asyncio.run(scenario())

        # Labels processed: both groups committed them to the end, live quality
        # joined every one, and the tally counted each against its merchant.
        def quality_labelled() -> int:
            done = subprocess.run([sys.executable, "-m", "tools.cli", "report", "quality", "--json"], cwd=REPO,
                                  env=env, capture_output=True, text=True, timeout=120)  # fmt: skip
            assert done.returncode == 0, done.stderr
            return sum(m["labelled"] for m in json.loads(done.stdout)["models"].values())

        label_parts = topics.partition_counts(PARTITIONS)[topics.labels]
        ends = asyncio.run(end_offsets(up.bootstrap, topics.labels, label_parts))
        deadline = time.monotonic() + 60
        while True:
            tally_group = asyncio.run(committed_offsets(up.bootstrap, f"{app_id}-tally", topics.labels, label_parts))
            loop_group = asyncio.run(committed_offsets(up.bootstrap, f"{app_id}-feedback", topics.labels, label_parts))
            labelled = quality_labelled()
            if (tally_group == ends and loop_group == ends and labelled == len(labels)) or time.monotonic() > deadline:
                break
            time.sleep(1.0)
        per_merchant: dict[str, int] = {}
        for label in labels.values():
            per_merchant[label["merchant_id"]] = per_merchant.get(label["merchant_id"], 0) + 1
        # The tally's group commits a batch's offsets once its counts are
        # written (above); a reader of the tally's topic sees them too.
        deadline = time.monotonic() + 30
        while True:
            counted = {m: fraud + legit for m, (fraud, legit)
                       in tally_by_merchant(asyncio.run(read_shares(up.bootstrap, tally_topic, PARTITIONS))).items()}  # fmt: skip
            if {m: counted.get(m, 0) for m in per_merchant} == per_merchant or time.monotonic() > deadline:
                break
            time.sleep(1.0)
    finally:
        workers.stop_all()
    t = tally(col, sent, by="transaction")
    seen = sorted(d["_seen_at"] for d in col.decisions)

    def offset(key: str) -> str:
        return f"{at[key] - at['load']:.0f}s"

    answered = Counter(
        "cached" if (again := col.by_tx[r.transaction_id or ""][0])["cached"]
        and again["decided_at"] == col.by_tx[first][0]["decided_at"] else "other"
        for first, r in resent
    )  # fmt: skip
    report(t.line("cluster_labels", labels=len(labels), labelled=labelled, tallied=sum(counted.values()),
                  resends="/".join(f"{k}:{v}" for k, v in sorted(answered.items())),
                  broker=victim, gap_s=f"{_gap(seen, at['broker'], at['load_end']):.1f}",
                  worker_ready_s=f"{at['worker_ready'] - at['worker_stopped']:.1f}",
                  events="/".join(f"{k}@{offset(k)}" for k in sorted(at, key=at.__getitem__) if k != "load")))  # fmt: skip
    assert (t.lost, t.duplicated, len(t.mismatched)) == (0, 0, 0), t.line("cluster_labels")
    assert at["worker_ready"] < at["broker_restart"], at  # the restart met the broker loss
    assert answered == Counter(cached=len(resent)) and len(resent) == 60, answered
    assert tally_group == ends and loop_group == ends, (tally_group, loop_group, ends)
    assert labelled == len(labels), (labelled, len(labels), _unjoined(up, app_id, topics, labels, workers))
    short = {m: (n, counted.get(m, 0)) for m, n in per_merchant.items() if counted.get(m, 0) != n}
    if short:  # what the tally topic says of them: a label never counted, or a count written over
        history: dict[str, list[dict[str, Any]]] = {}
        asyncio.run(read_shares(up.bootstrap, tally_topic, PARTITIONS, history))
        last: dict[str, dict[int, dict[str, Any]]] = {}  # each merchant's shares, their last values
        for m, values in history.items():
            for v in values:
                last.setdefault(m, {})[v["labels_partition"]] = v
        missing = {m: sorted(t for t, label in labels.items() if label["merchant_id"] == m
                             and not any(t in v["recent"] for v in last.get(m, {}).values())) for m in short}  # fmt: skip
        detail = {m: {"labels_then_counted": short[m], "labels_not_in_last_value": missing[m],
                      "values": [(v["labels_partition"], v["partition"], v["offset"], v["fraud"] + v["legit"],
                                  sorted(v["recent"]))
                                 for v in history.get(m, [])]} for m in short}  # fmt: skip
        raise AssertionError(f"tally short for {len(short)} merchants: {detail}; events {at}")


def _unjoined(up: Stack, app_id: str, topics: Topics, labels: dict[str, Any], workers: Workers) -> dict[str, Any]:
    """Why live quality is short: of each label not joined, whether the quality
    store holds its decision (``fb``) or the label (``lab``), where its
    feedback record sits, and what the workers logged of their groups. A
    diagnosis that fails says so instead of hiding the assertion it explains."""
    try:
        return _unjoined_why(up, app_id, topics, labels, workers)
    except Exception as exc:
        return {"diagnosis failed": repr(exc)}


def _unjoined_why(up: Stack, app_id: str, topics: Topics, labels: dict[str, Any], workers: Workers) -> dict[str, Any]:
    from app import redis_keys

    prefix = redis_keys.quality_prefix(app_id)
    client = sync_client(Settings(redis_url=up.env["REDIS_URL"]), timeout_s=30)
    try:
        joined = {
            k.decode() if isinstance(k, bytes) else k for k in client.hkeys(redis_keys.quality_joined_key(prefix))
        }
        missing = sorted(set(labels) - joined)
        sides = {t: ("fb" if client.exists(redis_keys.quality_served_key(prefix, t)) else "-")
                 + "/" + ("lab" if client.exists(redis_keys.quality_label_key(prefix, t)) else "-") for t in missing}  # fmt: skip
    finally:
        client.close()

    async def where() -> dict[str, tuple[int, int]]:
        consumer = AIOKafkaConsumer(topics.feedback, bootstrap_servers=up.bootstrap, isolation_level="read_committed",
                                    auto_offset_reset="earliest", enable_auto_commit=False)  # fmt: skip
        await consumer.start()
        found: dict[str, tuple[int, int]] = {}
        try:
            deadline = time.monotonic() + 20
            while len(found) < len(missing) and time.monotonic() < deadline:
                for tp, records in (await consumer.getmany(timeout_ms=1000)).items():
                    for r in records:
                        if r.key and r.key.decode() in sides:
                            found[r.key.decode()] = (tp.partition, r.offset)
        finally:
            await consumer.stop()
        return found

    wanted = ("quality:", "evok", "ssign", "ebalanc", "oordinator", "enerat", "rror")
    logs = {w.log_path.name: [line for line in w.text().splitlines() if any(n in line for n in wanted)][-40:]
            for w in workers.started}  # fmt: skip
    return {"unjoined": sides, "feedback_records": asyncio.run(where()), "logs": logs}
