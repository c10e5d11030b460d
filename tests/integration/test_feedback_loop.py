"""The feedback loop against the real broker and Redis, with one `fraud-pipeline worker`.

In order (one worker serves the module):

1. a hand-checked case: 16 decisions whose actions the rules fix (blocked device
   -> decline, amount over the limit -> review, the rest approve), 13 labels;
   live precision/recall per action appear on ``monitoring`` and in
   ``report quality`` and equal the figures worked out by hand below; a rules
   backtest on the replayed feedback reports exactly the flips a lower review
   amount causes, with their labelled outcomes;
2. a shadow model is scored on the same batches and logged in ``feedback``,
   and the decisions carry the served model's version and score;
3. a model promoted mid-stream: decisions switch to its version between two
   batches, never back, and none is lost; drift records (PSI per window of
   100 rows) appear on ``monitoring`` for each model in turn.
4. a rules file promoted with ``rules promote`` decides the next batches, no restart.
5. the loop's consumer group commits every ``feedback`` record it has processed
   within seconds, past the commit markers of the scoring loop's transactions,
   and again when the worker stops: a restart re-reads nothing it had processed.

The registry holds the session's trained version and a second version with
the same boosters but other member weights (the manifest holds the weights,
so its scores differ and its checksums still hold).
"""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import pandas as pd
import pytest
import redis
from aiokafka import TopicPartition
from workers import (
    REPO,
    Collector,
    Msg,
    Topics,
    TxFactory,
    Workers,
    committed_offsets,
    iso,
    make_producer,
    read_to_end,
    send_all,
    tally,
    tx_msg,
    worker_env,
)

from models.registry import current_version, read_manifest
from tests.factories import rules_doc
from tools.materialize import materialize
from tools.replay import read_topic

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

PARTITIONS = 4
BLOCKED = "d-blocked-feedback"
#: Thresholds of 1.0: no score reaches them, so the rules alone fix each action.
RULES = rules_doc(
    "rules-feedback-1", blocked_device=BLOCKED, thresholds={"review": 1.0, "decline": 1.0},
    degraded_review_amount_usd=1_000_000,
)
SECOND = "v29991231-000000"


@dataclass
class Loop:
    bootstrap: str
    topics: Topics
    workers: Workers
    make_tx: TxFactory
    env: dict[str, str]
    registry: Path
    first: str
    workdir: Path

    def cli(self, *args: str) -> str:
        """Run `fraud-pipeline ARGS` against this worker's topics, Redis and registry."""
        done = subprocess.run([sys.executable, "-m", "tools.cli", *args], cwd=REPO, env=self.env,
                              capture_output=True, text=True, timeout=120)  # fmt: skip
        assert done.returncode == 0, f"fraud-pipeline {' '.join(args)} failed:\n{done.stdout}\n{done.stderr}"
        return done.stdout

    def records(self, topic: str) -> list[dict[str, Any]]:
        settings = self.topics.settings(self.bootstrap, PARTITIONS)
        return [orjson.loads(v) for _, v, _ in asyncio.run(read_topic(settings, topic))]


def second_version(registry: Path, first: str) -> None:
    """``first`` with another combination of the same members: other scores, same
    files and checksums (most of the say to ``behaviour``, the odd one out)."""
    shutil.copytree(registry / first, registry / SECOND)
    manifest = read_manifest(registry, first)
    manifest["version"] = SECOND
    say = {m["name"]: (0.8 if m["name"] == "behaviour" else 0.1) for m in manifest["members"]}
    if "combination" in manifest:  # stacked: weights on the members' margins
        manifest["combination"]["weights"] = say
    for member in manifest["members"]:
        member["weight"] = say[member["name"]]
    (registry / SECOND / "manifest.json").write_text(json.dumps(manifest))


@pytest.fixture(scope="module")
def loop(
    kafka_bootstrap: str, redis_url: str, sim_frame: pd.DataFrame, trained_registry: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Loop]:  # fmt: skip
    client = redis.Redis.from_url(redis_url)
    try:
        materialize(sim_frame, client, progress=False)
    finally:
        client.close()
    workdir = tmp_path_factory.mktemp("feedback-loop")
    registry = workdir / "registry"
    shutil.copytree(trained_registry, registry)
    first = current_version(registry)
    second_version(registry, first)
    topics = Topics.unique("fl")
    env = worker_env(
        bootstrap=kafka_bootstrap, redis_url=redis_url, topics=topics, registry=registry, workdir=workdir,
        partitions=PARTITIONS, FRAUD_QUALITY_EVERY_S="1", FRAUD_RELOAD_CHECK_S="0.5", FRAUD_DRIFT_WINDOW_ROWS="100",
        USER="feedback-test",
    )  # fmt: skip
    (workdir / "rules.json").write_text(json.dumps(RULES))  # worker_env wrote the fault tests' rules there
    asyncio.run(topics.create(kafka_bootstrap, PARTITIONS))
    workers = Workers(workdir, env)
    running = Loop(kafka_bootstrap, topics, workers, TxFactory(sim_frame, f"t-fl-{topics.transactions[-6:]}"),
                   env, registry, first, workdir)  # fmt: skip
    try:
        worker = workers.start()
        asyncio.run(worker.wait_for_log("Ready", 90))
        asyncio.run(_decide(running, [tx_msg(running.make_tx(currency="USD"))], timeout=90))  # the group has joined
        yield running
    finally:
        workers.stop_all()


async def _decide(loop: Loop, messages: list[Msg], timeout: float = 60.0) -> dict[str, dict[str, Any]]:
    """Produce ``messages`` and return each one's decision by transaction id."""
    async with Collector(loop.bootstrap, loop.topics, PARTITIONS) as collector:
        producer = make_producer(loop.bootstrap)
        await producer.start()
        try:
            await send_all(producer, loop.topics.transactions, messages)
        finally:
            await producer.stop()
        ids = [m.transaction_id for m in messages]
        try:
            await collector.wait_for(lambda: all(collector.by_tx.get(t) for t in ids), timeout, "decisions")
        except AssertionError as exc:
            raise AssertionError(f"{exc}\n{loop.workers.logs()}") from None
        return {t: collector.by_tx[t][0] for t in ids if t is not None}


async def _produce_labels(loop: Loop, labels: list[dict[str, Any]]) -> None:
    producer = make_producer(loop.bootstrap)
    await producer.start()
    try:
        futures = [await producer.send(loop.topics.labels, orjson.dumps(lb), key=lb["transaction_id"].encode())
                   for lb in labels]  # fmt: skip
        await asyncio.gather(*futures)
    finally:
        await producer.stop()


def _wait(what: str, check: Any, loop: Loop, timeout: float = 60.0) -> Any:
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        time.sleep(1.0)
    raise AssertionError(f"no {what} after {timeout:.0f} s (last: {last})\n{loop.workers.logs()}")


# --- 1. live quality on a hand-checked case, and a rules backtest -------------------------------


def test_live_quality_is_correct_on_a_hand_checked_case_and_a_backtest_reports_flips(loop: Loop) -> None:
    make = loop.make_tx
    since = time.time()  # after the fixture's probe was decided
    # Every amount in USD so the rules' limits read directly.
    declined = [make(device_id=BLOCKED, currency="USD") for _ in range(4)]
    reviewed = [make(amount=20_000.0 + i, currency="USD") for i in range(4)]
    approved = [make(amount=40.0 + 20 * i, currency="USD") for i in range(8)]  # 40, 60, ..., 180 USD
    docs = declined + reviewed + approved
    decided = asyncio.run(_decide(loop, [tx_msg(d) for d in docs]))
    actions = [decided[d["transaction_id"]]["action"] for d in docs]
    assert actions == ["decline"] * 4 + ["review"] * 4 + ["approve"] * 8, actions
    assert {d["model_version"] for d in decided.values()} == {loop.first}

    # Labels: declined 3 fraud + 1 legit; reviewed 1 fraud, 2 legit, 1 none;
    # approved 2 fraud (60, 160 USD), 4 legit (40, 80, 100, 120 USD), 2 none.
    verdicts = {
        0: "fraud", 1: "fraud", 2: "fraud", 3: "legit",
        4: "fraud", 5: "legit", 6: "legit",
        9: "fraud", 14: "fraud", 8: "legit", 10: "legit", 11: "legit", 12: "legit",
    }  # fmt: skip
    labeled_at = time.time() + 3600.0  # as if the verdicts came an hour after the decisions
    labels = [{"transaction_id": docs[i]["transaction_id"], "label": v, "source": "chargeback",
               "labeled_at": iso(labeled_at)} for i, v in verdicts.items()]  # fmt: skip
    asyncio.run(_produce_labels(loop, labels))

    # By hand: 6 labelled frauds. decline: 3 of 4 labelled are fraud -> P 0.75, R 3/6;
    # review: 1 of 3 -> P 0.3333, R 1/6; flagged: 4 of 7 -> P 0.5714, R 4/6.
    # Alert rate: 8 flagged of 17 decisions (the 16 and the fixture's probe, approved).
    expected_actions = {
        "decline": {"labelled": 4, "fraud": 3, "precision": 0.75, "recall": 0.5},
        "review": {"labelled": 3, "fraud": 1, "precision": 0.3333, "recall": 0.1667},
        "flagged": {"labelled": 7, "fraud": 4, "precision": 0.5714, "recall": 0.6667},
    }

    def live() -> dict[str, Any] | None:
        report = json.loads(loop.cli("report", "quality", "--json"))
        model = report["models"].get(loop.first)
        return report if model and model["labelled"] == 13 else None

    report = _wait("13 joined labels in the live figures", live, loop)
    model = report["models"][loop.first]
    assert (model["decisions"], model["fraud"], model["alert_rate"]) == (17, 6, 0.4706)
    assert model["actions"] == expected_actions
    assert 3600 <= model["label_delay_s"]["p50"] < 3600 + 60
    assert report["rules"]["block_list/decline"]["fraud_share"] == 0.75
    assert report["rules"]["amount/review"]["labelled"] == 3
    assert report["rules"]["score/approve"]["fraud"] == 2

    # The same figures on `monitoring`, published by the worker.
    def published() -> dict[str, Any] | None:
        for record in reversed(loop.records(loop.topics.monitoring)):
            if record.get("kind") == "quality" and record["models"].get(loop.first, {}).get("labelled") == 13:
                return record
        return None

    record = _wait("a quality record on monitoring", published, loop, timeout=30)
    assert record["models"][loop.first]["actions"] == expected_actions
    # And recomputed from the topics alone.
    replayed = json.loads(loop.cli("report", "quality", "--replay", "--json"))
    assert replayed["models"][loop.first]["actions"] == expected_actions
    print("\n" + loop.cli("report", "quality"))

    # Backtest: force review above 100 USD instead of 10,000. The approved at
    # 120, 140, 160, 180 USD flip to review (160 labelled fraud, 120 legit,
    # 140 and 180 unlabelled); the rest stay as they were.
    proposal = loop.workdir / "rules-proposal.json"
    proposal.write_text(json.dumps({**RULES, "version": "rules-feedback-2", "force_review_amount_usd": 100}))
    out = json.loads(loop.cli("rules", "backtest", str(proposal), "--since", iso(since), "--json"))
    assert out["replayed"] == 16
    assert out["flips"] == {"approve->review": 4}
    assert out["outcomes"] == {"caught_fraud": 1, "new_false_positives": 1, "fraud_let_through": 0,
                               "false_positives_removed": 0}  # fmt: skip
    print(loop.cli("rules", "backtest", str(proposal), "--since", iso(since)))


# --- 2. a shadow model: scored and logged, never deciding -------------------------------------


def test_a_shadow_model_is_logged_in_feedback_and_never_decides(loop: Loop) -> None:
    entry = json.loads(loop.cli("models", "shadow", SECOND))
    assert (entry["action"], entry["version"], entry["by"]) == ("shadow", SECOND, "feedback-test")
    # Wait until the worker has loaded it: a probe's feedback carries the shadow.
    def shadowed() -> bool:
        probe = tx_msg(loop.make_tx(currency="USD"))
        asyncio.run(_decide(loop, [probe]))
        time.sleep(0.5)
        return any(r["decision"]["transaction_id"] == probe.transaction_id and r.get("shadow")
                   for r in loop.records(loop.topics.feedback))  # fmt: skip

    _wait("the shadow in feedback", shadowed, loop)
    docs = [loop.make_tx(currency="USD") for _ in range(40)]
    decided = asyncio.run(_decide(loop, [tx_msg(d) for d in docs]))
    ids = {d["transaction_id"] for d in docs}

    # NOTE: waited for, not read once: a transaction's markers are written
    # partition by partition, so its decisions can be readable (committed)
    # a moment before its feedback records on other partitions are.
    def all_feedback() -> dict[str, dict[str, Any]] | None:
        found = {r["decision"]["transaction_id"]: r for r in loop.records(loop.topics.feedback)
                 if r["decision"]["transaction_id"] in ids}  # fmt: skip
        return found if set(found) == ids else None

    feedback: dict[str, dict[str, Any]] = _wait("every decision's feedback record", all_feedback, loop)
    differ = 0
    for txid, decision in decided.items():
        shadow = feedback[txid]["shadow"]
        assert decision["model_version"] == loop.first and shadow["model_version"] == SECOND
        assert feedback[txid]["decision"]["fraud_score"] == decision["fraud_score"]
        differ += shadow["fraud_score"] != decision["fraud_score"]
    assert differ >= 30, f"the shadow's scores should differ from the served ones ({differ} of 40 did)"
    shadows = [r for r in loop.records(loop.topics.monitoring) if r.get("kind") == "shadow"]
    assert shadows and shadows[-1]["shadow_version"] == SECOND and shadows[-1]["model_version"] == loop.first
    loop.cli("models", "shadow", "off")


# --- 3. promotion mid-stream ------------------------------------------------------------------


def test_a_model_promoted_mid_stream_decides_the_next_batches_and_none_is_lost(loop: Loop) -> None:
    async def go() -> tuple[list[Msg], Collector, float, float]:
        sent: list[Msg] = []
        stop = asyncio.Event()
        async with Collector(loop.bootstrap, loop.topics, PARTITIONS) as collector:
            producer = make_producer(loop.bootstrap)
            await producer.start()

            async def pump() -> None:  # ~25 TPS until told to stop
                futures = []
                while not stop.is_set():
                    m = tx_msg(loop.make_tx(currency="USD"))
                    futures.append(await producer.send(loop.topics.transactions, m.value, key=m.key,
                                                       headers=m.all_headers()))  # fmt: skip
                    sent.append(m)
                    await asyncio.sleep(0.04)
                await asyncio.gather(*futures)

            try:
                load = asyncio.create_task(pump())
                await asyncio.sleep(3.0)
                asked_at = time.time()
                await asyncio.to_thread(loop.cli, "models", "promote", SECOND, "--reason", "mid-stream test")
                promoted_at = time.time()
                await asyncio.sleep(6.0)  # the stream goes on after the promotion
                stop.set()
                await load
            finally:
                await producer.stop()
            await collector.wait_all(sent, timeout=60.0, settle=2.0)
            return sent, collector, asked_at, promoted_at

    sent, collector, asked_at, promoted_at = asyncio.run(go())
    t = tally(collector, sent, by="transaction")
    assert t.lost == 0 and t.decided == t.sent, f"lost {t.lost}: {t.lost_ids[:5]}"
    ordered = sorted((collector.by_tx[m.transaction_id][0] for m in sent), key=lambda d: d["decided_at"])
    versions = [d["model_version"] for d in ordered]
    assert set(versions) == {loop.first, SECOND}, set(versions)
    switch = versions.index(SECOND)
    assert versions[switch:] == [SECOND] * (len(versions) - switch), "a decision went back to the old model"
    assert all(v == loop.first for v in versions[:switch])
    # The switch came after the promotion was asked for, within seconds of it
    # (the worker checks every 0.5 s and loads in the background).
    assert asked_at < ordered[switch]["decided_at"] < promoted_at + 5.0
    history = loop.cli("models", "list")
    assert f'"version": "{SECOND}", "previous": "{loop.first}", "by": "feedback-test"' in history
    assert "now serving: model" in loop.workers.started[0].text()
    # Drift windows of 100 rows, for each model in turn, against its training reference.
    drift = [r for r in loop.records(loop.topics.monitoring) if r.get("kind") == "drift"]
    assert {r["model_version"] for r in drift} == {loop.first, SECOND}
    assert all(r["rows"] >= 100 and "score" in r["psi"] and len(r["psi"]) == 6 for r in drift)
    print("\nlast drift record:", json.dumps(drift[-1]))
    print(f"promotion mid-stream: {t.sent} sent, {t.decided} decided, {t.lost} lost, "
          f"{switch} by {loop.first} then {len(versions) - switch} by {SECOND}")  # fmt: skip


# --- 4. a rules file promoted while the worker runs -----------------------------------------


def test_a_promoted_rules_file_decides_the_next_batches_without_a_restart(loop: Loop) -> None:
    proposal = loop.workdir / "rules-v3.json"
    proposal.write_text(json.dumps({**RULES, "version": "rules-feedback-3", "force_review_amount_usd": 100}))
    entry = json.loads(loop.cli("rules", "promote", str(proposal)))
    assert (entry["kind"], entry["version"], entry["previous"], entry["by"]) == (
        "rules", "rules-feedback-3", "rules-feedback-1", "feedback-test")  # fmt: skip

    def decided_by_new_rules() -> dict[str, Any] | None:
        doc = loop.make_tx(amount=150.0, currency="USD")
        decision = asyncio.run(_decide(loop, [tx_msg(doc)]))[doc["transaction_id"]]
        return decision if decision["rules_version"] == "rules-feedback-3" else None

    decision = _wait("a decision under the promoted rules", decided_by_new_rules, loop, timeout=30)
    assert decision["action"] == "review"  # 150 USD is over the new 100 USD limit
    assert loop.workers.started[0].alive()


# --- 5. the loop's offsets: committed as processed, and on a clean stop ------------------------


async def _records_end(bootstrap: str, topic: str, partitions: int) -> dict[int, int]:
    """Per partition, the offset after its last committed record: where a group
    that has processed every record stands. The topic's end offset is one more
    (the last transaction's commit marker, which no consumer receives)."""
    after_last = {p: 0 for p in range(partitions)}

    def last(tp: TopicPartition, records: list[Any]) -> None:
        if records:
            after_last[tp.partition] = records[-1].offset + 1

    await read_to_end(bootstrap, topic, partitions, last, isolation_level="read_committed")
    return after_last


def test_the_loop_commits_every_feedback_record_it_processed_and_again_on_stop(loop: Loop) -> None:
    """``feedback`` is written in the scoring loop's transactions: a commit marker
    follows each transaction's records in every partition, so the offsets the
    loop receives jump. Its group commits past them while running and on a
    clean stop (app/at_least_once.py), so a restart re-reads little."""
    group = f"{loop.env['FRAUD_APP_ID']}-feedback"  # --role all runs the loop in its own group too
    partitions = loop.topics.partition_counts(PARTITIONS)[loop.topics.feedback]

    def decisions_counted() -> int:
        report = json.loads(loop.cli("report", "quality", "--json"))
        return sum(m["decisions"] for m in report["models"].values())

    before = decisions_counted()
    # One at a time: each its own transaction, so the partitions hold a marker
    # after (nearly) every record, as at a low rate in production.
    for _ in range(30):
        asyncio.run(_decide(loop, [tx_msg(loop.make_tx(currency="USD"))]))
    _wait("the 30 decisions counted by the loop", lambda: decisions_counted() >= before + 30, loop)
    after_last = asyncio.run(_records_end(loop.bootstrap, loop.topics.feedback, partitions))

    # Committed within a few commit intervals (1 s), while running.
    def caught_up() -> dict[int, int | None] | None:
        committed = asyncio.run(committed_offsets(loop.bootstrap, group, loop.topics.feedback, partitions))
        return committed if all((committed[p] or 0) >= after_last[p] for p in after_last) else None

    deadline, committed = time.monotonic() + 15.0, None
    while committed is None and time.monotonic() < deadline:
        committed = caught_up()
        time.sleep(0.5)
    last = asyncio.run(committed_offsets(loop.bootstrap, group, loop.topics.feedback, partitions))
    assert committed is not None, f"committed {last}, records end {after_last} (15 s after processing)"
    print(f"\nfeedback: committed {committed}, after the last record {after_last}")

    # A clean stop commits what was processed since: none of it is re-read at the next start.
    for _ in range(10):
        asyncio.run(_decide(loop, [tx_msg(loop.make_tx(currency="USD"))]))
    _wait("the 10 decisions counted by the loop", lambda: decisions_counted() >= before + 40, loop, timeout=30)
    worker = loop.workers.started[0]
    worker.stop()
    assert worker.proc.returncode == 0, worker.log()
    after_last = asyncio.run(_records_end(loop.bootstrap, loop.topics.feedback, partitions))
    committed = asyncio.run(committed_offsets(loop.bootstrap, group, loop.topics.feedback, partitions))
    assert all((committed[p] or 0) >= after_last[p] for p in after_last), (
        f"committed {committed}, records end {after_last}"
    )
