"""``/metrics`` of a real worker: it parses as Prometheus text and its counters
move with signed and unsigned traffic through the real broker and Redis."""

from __future__ import annotations

import asyncio
import secrets
import time
import urllib.request
from collections import defaultdict
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
from prometheus_client.parser import text_string_to_metric_families

from models.registry import current_version
from pipeline.auth import sign
from tests.integration.workers import (
    Collector,
    Msg,
    Topics,
    TxFactory,
    Workers,
    make_producer,
    send_all,
    tx_msg,
    worker_env,
)
from tests.unit.test_deploy import metric_family, metrics_table, rules_metric_names
from tools.autoscale import advise, measure

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

PARTITIONS = 8
CLIENT = "metrics-client"

Samples = dict[str, dict[tuple[tuple[str, str], ...], float]]


def scrape(port: int) -> tuple[str, Samples]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        assert reply.status == 200
        assert reply.headers["Content-Type"].startswith("text/plain")
        text = reply.read().decode()
    samples: Samples = defaultdict(dict)
    for family in text_string_to_metric_families(text):  # raises on malformed exposition text
        for s in family.samples:
            samples[s.name][tuple(sorted(s.labels.items()))] = s.value
    return text, samples


def total(samples: Samples, name: str, **labels: str) -> float:
    want = set(labels.items())
    return sum(v for k, v in samples.get(name, {}).items() if want <= set(k))


def test_metrics_move_with_traffic(
    kafka_bootstrap: str, redis_url: str, sim_frame: pd.DataFrame, trained_registry: Path, tmp_path: Path
) -> None:
    key = secrets.token_bytes(32)
    topics = Topics.unique("mt")
    env = worker_env(
        bootstrap=kafka_bootstrap, redis_url=redis_url, topics=topics, registry=trained_registry,
        workdir=tmp_path, partitions=PARTITIONS,
        FRAUD_CLIENT_KEYS=f"{CLIENT}:{key.hex()}", FRAUD_ALLOW_UNSIGNED="false", FRAUD_FAUST_SENSORS="true",
    )  # fmt: skip
    workers = Workers(tmp_path, env)
    make = TxFactory(sim_frame, f"t-metrics-{topics.transactions[-6:]}")

    def signed(doc: dict[str, Any], corr: str) -> Msg:
        m = tx_msg(doc, corr)
        m.headers = list(sign(m.value, CLIENT, key, int(time.time() * 1000)).items())
        return m

    good = [signed(make(), f"m-good-{i}") for i in range(40)]
    unsigned = [tx_msg(make(), f"m-unsigned-{i}") for i in range(3)]
    not_json = [Msg(key=b"u-x", value=b"{nope", correlation=f"m-badjson-{i}") for i in range(2)]
    for m in not_json:
        m.headers = list(sign(m.value, CLIENT, key, int(time.time() * 1000)).items())
    traffic = good + unsigned + not_json

    async def scenario() -> dict[str, Any]:
        await topics.create(kafka_bootstrap, PARTITIONS)
        async with Collector(kafka_bootstrap, topics, PARTITIONS) as col:
            worker = workers.start()
            await worker.wait_for_log("Ready", 90)
            producer = make_producer(kafka_bootstrap)
            await producer.start()
            try:
                probe = signed(make(), "m-probe")
                await send_all(producer, topics.transactions, [probe])
                await col.wait_for(lambda: bool(col.by_corr.get("m-probe")), 60, "the probe's decision")
                _, before = await asyncio.to_thread(scrape, worker.port)
                await send_all(producer, topics.transactions, traffic)
                await col.wait_for(lambda: all(col.has_outcome(m) for m in traffic), 60, "every outcome")
            finally:
                await producer.stop()
            # Lag reaches 0 once the last Kafka transaction has committed its offsets
            # (the scoring loop's transactions commit them: app/eos.py).
            deadline = time.monotonic() + 30
            while True:
                text, after = await asyncio.to_thread(scrape, worker.port)
                if total(after, "fraud_consumer_lag") == 0 or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.5)
            actions = [d["action"] for m in good for d in col.by_corr[m.correlation]]
            # What `fraud-pipeline scale advise` measures from this worker (now idle).
            measured = await measure([f"127.0.0.1:{worker.port}"], 1.0)
            return {"before": before, "after": after, "text": text, "actions": actions, "measured": measured}

    try:
        out = asyncio.run(scenario())
    finally:
        workers.stop_all()
    before, after, text = out["before"], out["after"], out["text"]
    (tmp_path / "scrape.txt").write_text(text)
    print("\n".join(line for line in text.splitlines() if line.startswith("fraud_") and "_bucket" not in line))

    def delta(name: str, **labels: str) -> float:
        return total(after, name, **labels) - total(before, name, **labels)

    # Every metric deploy/README.md's table or an alerting/recording rule names is one this worker serves.
    served = {f.name for f in text_string_to_metric_families(text)}
    named = set(metrics_table()) | rules_metric_names()
    assert not {n for n in named if metric_family(n) not in served}, f"named in deploy/ but not served: {sorted(named)}"
    assert delta("fraud_messages_total") == len(traffic)
    for action in ("approve", "review", "decline"):
        assert delta("fraud_decisions_total", action=action, cached="false") == out["actions"].count(action), action
    assert delta("fraud_decisions_total") == len(good)  # unauthenticated and unreadable ones get none
    assert delta("fraud_dead_letters_total", reason="unauthenticated") == len(unsigned)
    assert delta("fraud_dead_letters_total", reason="bad_json") == len(not_json)
    assert delta("fraud_end_to_end_seconds_count") == len(traffic)
    assert delta("fraud_stage_seconds_count", stage="model") >= 1
    # One Redis server: a batch's admission and features are one call; resends are
    # told by the resend index (restored when the partitions were assigned), so no
    # decision is written to Redis.
    assert delta("fraud_redis_round_trip_seconds_count", op="batch_lookup") >= 1
    assert delta("fraud_redis_round_trip_seconds_count", op="cache_put") == 0
    assert total(after, "fraud_index_restore_seconds_count") >= 1
    assert delta("fraud_batch_size_sum") == len(traffic)
    # Every batch committed in Kafka transactions (each spans a commit interval's batches), none fenced or aborted.
    assert delta("fraud_kafka_transactions_total", result="committed") >= 1
    assert delta("fraud_kafka_transactions_total", result="fenced") == 0
    assert delta("fraud_kafka_transactions_total", result="aborted") == 0
    # Lag per partition: one worker holds all of them; every message is committed.
    assert len(after["fraud_consumer_lag"]) == PARTITIONS
    assert total(after, "fraud_consumer_lag") == 0, after["fraud_consumer_lag"]
    assert total(after, "fraud_consumer_highwater") == 1 + len(traffic)  # the probe too
    assert total(after, "fraud_assigned_partitions") == PARTITIONS
    assert total(after, "fraud_worker_capacity_tps") > 0
    [(labels, one)] = after["fraud_model_info"].items()
    assert one == 1 and dict(labels)["model_version"] == current_version(trained_registry)
    # faust's own sensor is served alongside when asked for (FRAUD_FAUST_SENSORS). NOTE: it never sees
    # `transactions`, which the scoring loop consumes through librdkafka (app/eos.py),
    # so fraud_messages_total is the count of transactions taken.
    assert "faust_messages_received_total" in after and "faust_consumer_commit_latency_count" in after
    # The autoscaling advice from it: one worker, all partitions seen, nothing behind.
    m = out["measured"]
    assert (m.workers, m.partitions_seen, m.lag) == (1, PARTITIONS, 0)
    assert m.capacity_per_worker_tps is not None and m.capacity_per_worker_tps > 0
    a = advise(lag=m.lag, arrival_tps=m.arrival_tps, capacity_per_worker_tps=m.capacity_per_worker_tps,
               partitions=PARTITIONS, current_workers=m.workers)  # fmt: skip
    assert a.workers == 1, a.reasons
