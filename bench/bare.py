"""The transport's own limit: a librdkafka consumer feeding a librdkafka producer.

No faust, no scoring, no transaction: batches taken as the scoring worker takes
them (``FRAUD_BATCH_SIZE`` records or ``FRAUD_BATCH_WINDOW_S``, the same client
settings as :mod:`app.eos`), each record's bytes produced unchanged under its
key to ``decisions``, the consumed offsets committed asynchronously after each
batch (at least once). What the pipeline costs is measured against this, on
the same broker in the same run (``python -m bench.run``).

    python -m bench.bare --web-port 6070     # the port only names the process, as for a worker
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from typing import Any

from agents.pace import IDLE_WAIT_S
from app.librdkafka import client_config
from app.settings import Settings

__all__ = ["main", "run"]

log = logging.getLogger("bench.bare")


def run(settings: Settings) -> None:
    """Forward until SIGTERM or SIGINT."""
    import confluent_kafka as kafka

    base = client_config(settings, f"{settings.app_id}-bare")
    consumer = kafka.Consumer({
        **base, "group.id": f"{settings.app_id}-score", "enable.auto.commit": False,
        "auto.offset.reset": "earliest", "queued.max.messages.kbytes": 8192,
        "fetch.min.bytes": settings.fetch_min_bytes, "fetch.wait.max.ms": settings.consumer_fetch_max_wait_ms,
        "session.timeout.ms": int(settings.session_timeout_s * 1000),
    })  # fmt: skip
    producer = kafka.Producer({**base, "linger.ms": settings.producer_linger_s * 1000, "acks": "all"})
    stopping = False

    def stop(*_: Any) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)

    def assigned(_: Any, partitions: list[Any]) -> None:
        log.info("assigned %d partitions; Ready", len(partitions))

    consumer.subscribe([settings.topic_transactions], on_assign=assigned)
    topic = settings.topic_decisions
    while not stopping:
        batch = consumer.consume(settings.batch_size, settings.batch_window_s)
        if not batch:
            # As the scoring loop takes (app/eos.py): nothing queued, so wait
            # for the first record and take what queued behind it, instead of
            # polling again at once (a window of 0 would spin a core).
            batch = consumer.consume(1, IDLE_WAIT_S)
            if batch and settings.batch_size > 1:
                batch += consumer.consume(settings.batch_size - 1, 0)
        good = [m for m in batch if m.error() is None]
        for msg in good:
            while True:
                try:
                    producer.produce(topic, msg.value(), msg.key())
                    break
                except BufferError:
                    producer.poll(0.005)
        producer.poll(0)
        if good:
            consumer.commit(asynchronous=True)
    producer.flush(10)
    consumer.close()


def main(argv: list[str] | None = None) -> int:
    from app.topics import ensure_topics

    parser = argparse.ArgumentParser(prog="python -m bench.bare", description=__doc__.splitlines()[0])
    parser.add_argument("--web-port", type=int, help="unused: accepted as a worker's is")
    parser.add_argument("--loglevel", default="info")
    parser.add_argument("--broker-wait", type=float, default=60.0, help="seconds to wait for the broker")
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.loglevel.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    settings = Settings()
    asyncio.run(ensure_topics(settings, wait_s=args.broker_wait))
    run(settings)
    return 0


if __name__ == "__main__":
    sys.exit(main())
