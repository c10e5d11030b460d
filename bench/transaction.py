"""What one Kafka transaction of the scoring loop's shape costs the client
(``python -m bench.transaction``): CPU of the whole process (librdkafka's
threads included) and wall time per transaction, without the pipeline.

Each transaction: ``begin_transaction``, three records produced (a batch's
decision, feedback and monitoring record), ``send_offsets_to_transaction``
with a consumer's group metadata, ``commit_transaction``, as app/eos.py makes
them. Variants alternate in one run:

- ``offsets``: as the worker does;
- ``deliver_first``: the records delivered (``flush``) before the offsets go
  (the flush's round trip is a pause before AddOffsetsToTxn);
- ``no_offsets``: produce and commit only, for the offsets' share;
- ``settled``: as ``offsets``, each transaction begun ``FRAUD_COMMIT_SETTLE_S``
  (its default) after the last commit ended, as app/eos.py begins them. Back to back (the other
  three), the next transaction's requests reach the coordinator while it
  still writes the last one's markers, and are refused
  CONCURRENT_TRANSACTIONS (counted here from librdkafka's ``eos`` debug log):
  librdkafka asks again 20 ms later;
- ``offsets_first``: back to back, the offsets added before the records (the
  transaction's first request to the coordinator is then AddOffsetsToTxn,
  retried after ``retry.backoff.ms``; records first make it
  AddPartitionsToTxn, retried only 20 ms later), and again before the
  commit: measured, not kept in app/eos.py (docs/performance.md).

Why: a batch that commits on its own pays this whole cost, so it bounds what
fewer transactions save (docs/performance.md).
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from app.settings import Settings
from bench.workers import services

#: The worker's default pause after a commit (app/eos.py).
SETTLE_S: float = Settings.model_fields["commit_settle_s"].default


class _Refusals(logging.Handler):
    """Counts the coordinator's CONCURRENT_TRANSACTIONS answers in librdkafka's debug log."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        # Each refused answer once: AddOffsetsToTxn's is logged by the error's
        # name, AddPartitionsToTxn's by its text (librdkafka's eos debug lines).
        text = record.getMessage()
        if ("AddOffsetsToTxn response" in text and "CONCURRENT_TRANSACTIONS" in text) or (
            "AddPartitionsToTxn response" in text and "another concurrent operation" in text
        ):
            self.count += 1


REFUSALS = _Refusals()

VARIANTS = ("offsets", "deliver_first", "no_offsets", "settled", "offsets_first")


def _clients(bootstrap: str, backoff_ms: int) -> tuple[Any, Any, str]:
    rdkafka_log = logging.getLogger("bench.transaction.rdkafka")
    rdkafka_log.propagate = False
    rdkafka_log.setLevel(logging.DEBUG)
    rdkafka_log.addHandler(REFUSALS)
    from confluent_kafka import Consumer, Producer
    from confluent_kafka.admin import AdminClient
    from confluent_kafka.cimpl import NewTopic  # where it is defined: confluent_kafka.admin does not export it

    tag = f"txn-bench-{uuid.uuid4().hex[:8]}"
    base: dict[str, str | int | float | bool] = {"bootstrap.servers": bootstrap, "socket.nagle.disable": True, "log_level": 3}
    admin = AdminClient(base)  # kept until the topics exist: a destroyed client fails its futures
    for f in admin.create_topics([NewTopic(f"{tag}-in", 8, 1), NewTopic(f"{tag}-out", 8, 1)]).values():
        f.result()
    seed = Producer(base)
    for i in range(16):
        seed.produce(f"{tag}-in", b"x" * 300, str(i).encode())
    seed.flush(10)
    consumer = Consumer({**base, "group.id": tag, "enable.auto.commit": False, "auto.offset.reset": "earliest"})
    consumer.subscribe([f"{tag}-in"])
    deadline = time.monotonic() + 30
    while not consumer.assignment() and time.monotonic() < deadline:
        consumer.poll(0.2)
    producer = Producer(
        {**base, "transactional.id": tag, "enable.idempotence": True, "acks": "all", "linger.ms": 2,
         "retry.backoff.ms": backoff_ms, "debug": "eos", "logger": rdkafka_log}
    )  # fmt: skip
    producer.init_transactions(60)
    return producer, consumer, tag


def _one(producer: Any, consumer: Any, tag: str, variant: str) -> tuple[float, float]:
    from confluent_kafka import TopicPartition

    if variant == "settled":
        time.sleep(SETTLE_S)  # the last call ended with its commit
    producer.begin_transaction()
    if variant == "offsets_first":
        producer.send_offsets_to_transaction(
            [TopicPartition(f"{tag}-in", 0, 1)], consumer.consumer_group_metadata(), 10
        )
    for i in range(3):
        producer.produce(f"{tag}-out", b"y" * 600, str(i).encode())
    started = time.perf_counter()
    if variant == "deliver_first":
        producer.flush(10)
    if variant != "no_offsets":
        producer.send_offsets_to_transaction(
            [TopicPartition(f"{tag}-in", 0, 1)], consumer.consumer_group_metadata(), 10
        )
    offsets_done = time.perf_counter()
    producer.commit_transaction(10)
    producer.poll(0)
    return offsets_done - started, time.perf_counter() - offsets_done


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--transactions", type=int, default=200, help="per variant and round")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--backoff-ms", type=int, default=20, help="the producer's retry.backoff.ms (app/eos.py: 20)")
    parser.add_argument("--out", type=Path, default=Path("bench/results/transaction.json"))
    args = parser.parse_args()
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench-txn-") as tmp, services(Path(tmp)) as svc:
        producer, consumer, tag = _clients(svc.bootstrap, args.backoff_ms)
        for _ in range(20):  # the coordinator's first answers, the partitions' first adds
            _one(producer, consumer, tag, "offsets")
        for rnd in range(args.rounds):
            for variant in VARIANTS:
                offsets_s, commit_s = [], []
                REFUSALS.count = 0
                cpu = time.process_time()
                wall = time.perf_counter()
                for _ in range(args.transactions):
                    o, c = _one(producer, consumer, tag, variant)
                    offsets_s.append(o)
                    commit_s.append(c)
                n = args.transactions
                row = {
                    "round": rnd + 1, "variant": variant, "retry_backoff_ms": args.backoff_ms, "transactions": n,
                    "cpu_ms_per_txn": round((time.process_time() - cpu) * 1000 / n, 3),
                    "wall_ms_per_txn": round((time.perf_counter() - wall) * 1000 / n, 2),
                    "offsets_p50_ms": round(statistics.median(offsets_s) * 1000, 2),
                    "commit_p50_ms": round(statistics.median(commit_s) * 1000, 2),
                    "concurrent_transactions_refusals": REFUSALS.count,
                }  # fmt: skip
                rows.append(row)
                print(json.dumps(row), flush=True)
        consumer.close()
    from bench.procs import machine_info

    doc = {"machine": machine_info(), "setup": "one local KRaft broker, the client alone", "rows": rows}
    args.out.write_text(json.dumps(doc, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
