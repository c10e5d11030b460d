"""The bench's Kafka Streams peer on the real broker: each transaction's key and
value come out once, without the input's headers, visible to a read_committed
reader, and the peer's group commits the offsets it consumed.

Needs the peer built (``make streams``; ``make bench`` builds it, ``make test``
does not): skipped otherwise."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from confluent_kafka import Consumer, Producer, TopicPartition

from bench import streams_peer

pytestmark = [
    pytest.mark.integration,
    pytest.mark.timeout(180),
    pytest.mark.skipif(
        not (streams_peer.CLASSES_DIR / "fraud" / "bench" / "PassThrough.class").exists(),
        reason="the Kafka Streams peer is not built (make streams)",
    ),
]

REPO = Path(__file__).resolve().parents[2]
PARTITIONS = 2
RECORDS = 200


@pytest.fixture
def peer(kafka_bootstrap: str, unique_name: Callable[[str], str], tmp_path: Path) -> Iterator[dict[str, str]]:
    """A running peer on fresh topics at a 25 ms commit interval; its settings."""
    env = {
        "FRAUD_KAFKA_BOOTSTRAP": kafka_bootstrap,
        "FRAUD_APP_ID": unique_name("peer"),
        "FRAUD_DATA_DIR": str(tmp_path / "data"),
        "FRAUD_PARTITIONS": str(PARTITIONS),
        **{f"FRAUD_TOPIC_{name.upper()}": unique_name(name) for name in
           ("transactions", "decisions", "dlq", "monitoring", "feedback", "labels")},
    }  # fmt: skip
    log = tmp_path / "peer.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [*streams_peer.launcher_argv(0.025)], cwd=REPO, env={**os.environ, **env},
            stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 90
        while b"Ready" not in log.read_bytes():
            assert proc.poll() is None, log.read_text(errors="replace")
            assert time.monotonic() < deadline, f"not Ready:\n{log.read_text(errors='replace')}"
            time.sleep(0.1)
        yield env
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=20)  # closes on SIGTERM: raises if it hangs
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=5)


def test_each_record_comes_out_once_under_its_key_without_headers(peer: dict[str, str]) -> None:
    bootstrap = peer["FRAUD_KAFKA_BOOTSTRAP"]
    source, out = peer["FRAUD_TOPIC_TRANSACTIONS"], peer["FRAUD_TOPIC_DECISIONS"]
    sent = [(f"u-{i % 17}".encode(), b'{"transaction_id":"t-%d"}' % i) for i in range(RECORDS)]
    producer = Producer({"bootstrap.servers": bootstrap})
    for key, value in sent:
        producer.produce(source, value, key, headers=[("signature", b"s" * 64)])
    assert producer.flush(10.0) == 0

    reader = Consumer({"bootstrap.servers": bootstrap, "group.id": f"{peer['FRAUD_APP_ID']}-reader",
                       "isolation.level": "read_committed", "enable.auto.commit": False})  # fmt: skip
    try:
        reader.assign([TopicPartition(out, p, 0) for p in range(PARTITIONS)])
        got: list[tuple[bytes, bytes]] = []
        deadline = time.monotonic() + 60
        while len(got) < RECORDS and time.monotonic() < deadline:
            for msg in reader.consume(1000, 0.5):
                assert msg.error() is None, msg.error()
                assert not msg.headers(), msg.headers()
                got.append((msg.key(), msg.value()))
        for msg in reader.consume(1000, 1.0):  # nothing more than was sent
            got.append((msg.key(), msg.value()))
        assert Counter(got) == Counter(sent)
    finally:
        reader.close()
    # The offsets went in the same transactions as the outputs: every output
    # visible means every input's offset committed, in the peer's group (its
    # application id; asked there without joining it).
    group = Consumer({"bootstrap.servers": bootstrap, "group.id": peer["FRAUD_APP_ID"], "enable.auto.commit": False})
    try:
        committed = group.committed([TopicPartition(source, p) for p in range(PARTITIONS)], 10.0)
    finally:
        group.close()
    assert sum(tp.offset for tp in committed if tp.offset >= 0) == RECORDS
