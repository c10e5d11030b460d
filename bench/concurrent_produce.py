"""Does the local broker keep every acknowledged record when several producers
write into the same partitions at once (as scoring workers do to `decisions`)?

    python -m bench.concurrent_produce [--producers 3] [--per-producer 6000] [--rate 1500]

Starts its own broker (app.stack) on a free port, creates an 8-partition topic,
runs the producers concurrently at a paced rate (acks=all), then reads the
topic back from offset 0 and prints how many acknowledged records are missing
and whether two acknowledgements named the same (partition, offset). Written
for RELIABILITY.md's open ``lost=1``; session 5 result: 18,000 acked, 18,000
read, 0 missing, 0 collisions.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

from app import stack

TOPIC, PARTITIONS = "concurrent-produce", 8


async def _produce(bootstrap: str, n: int, rate: float, tag: str) -> dict[str, tuple[int, int]]:
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, linger_ms=2, acks="all")
    await producer.start()
    try:
        futures, start = [], time.monotonic()
        for i in range(n):
            name = f"{tag}-{i}".encode()
            futures.append(await producer.send(TOPIC, key=name, value=name))
            delay = start + (i + 1) / rate - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
        metas = await asyncio.gather(*futures)
    finally:
        await producer.stop()
    return {f"{tag}-{i}": (m.partition, m.offset) for i, m in enumerate(metas)}


async def _read_all(bootstrap: str) -> set[str]:
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False, fetch_max_wait_ms=20)
    await consumer.start()
    seen: set[str] = set()
    try:
        parts = [TopicPartition(TOPIC, p) for p in range(PARTITIONS)]
        consumer.assign(parts)
        await consumer.seek_to_beginning(*parts)
        idle = 0
        while idle < 10:  # 2 s without a record: the end
            batches = await consumer.getmany(timeout_ms=200)
            idle = 0 if batches else idle + 1
            for records in batches.values():
                seen.update(r.value.decode() for r in records)
    finally:
        await consumer.stop()
    return seen


async def run(producers: int, per_producer: int, rate: float) -> dict[str, int]:
    with tempfile.TemporaryDirectory(prefix="concurrent-produce-") as workdir:
        broker = stack.start_broker(workdir=Path(workdir))
        try:
            admin = AIOKafkaAdminClient(bootstrap_servers=broker.url)
            await admin.start()
            try:
                await admin.create_topics([NewTopic(TOPIC, PARTITIONS, 1)])
            finally:
                await admin.close()
            acked: dict[str, tuple[int, int]] = {}
            for part in await asyncio.gather(*(_produce(broker.url, per_producer, rate, f"p{k}") for k in range(producers))):
                acked.update(part)
            seen = await _read_all(broker.url)
        finally:
            broker.stop()
    return {
        "acked": len(acked),
        "read": len(seen),
        "missing": sum(1 for name in acked if name not in seen),
        "offset_collisions": len(acked) - len(set(acked.values())),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--producers", type=int, default=3)
    parser.add_argument("--per-producer", type=int, default=6000)
    parser.add_argument("--rate", type=float, default=1500.0, help="records per second, each producer")
    args = parser.parse_args()
    print(asyncio.run(run(args.producers, args.per_producer, args.rate)))


if __name__ == "__main__":
    main()
