"""The faust ceiling: a faust worker that forwards ``transactions`` to ``decisions``.

It consumes with faust's own stream (``take_events(batch_size, within)``,
``concurrency=1``) on the worker's faust configuration (:func:`app.faust_app.base_app`:
fetch max wait, producer linger, session timeout) and produces each message's
bytes unchanged, under its input key, to ``decisions``, outside any
transaction. It is what faust's per-event path allows with no work to do: the
scoring worker consumes and produces through librdkafka instead
(:mod:`app.eos`, in Kafka transactions), because this path alone cost more CPU
than a decision (docs/decisions.md). The load generator matches outputs by
the ``transaction_id`` inside the value, which the forwarded transaction has.

    python -m bench.passthrough --web-port 6070     # used by ``python -m bench.run``
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from typing import Any, cast

import faust

# The scoring app's own configuration, so the two cannot drift apart.
from app.faust_app import RAW, base_app
from app.produce import RawTopic
from app.settings import Settings

#: faust's batch window when the worker's is 0 (see ``forward``).
FAUST_WINDOW_S = 0.01

__all__ = ["create_passthrough_app", "main"]


def create_passthrough_app(settings: Settings) -> faust.App:
    """A faust app on the workers' base configuration whose one agent forwards instead of scoring."""
    app = base_app(settings)
    transactions = app.topic(settings.topic_transactions, partitions=settings.partitions, **RAW)
    decisions = RawTopic(app, settings.topic_decisions)  # the scoring app's produce path

    @app.agent(transactions, concurrency=1)  # as the scoring agent (faust-streaming #606)
    async def forward(stream: faust.StreamT[bytes]) -> None:
        # NOTE: faust's take has no "what is queued" mode: with a window of 0
        # it waits for a whole batch. The scoring loop's default window is 0,
        # so this takes the 10 ms window the loop had when the two were first
        # measured side by side.
        size, within = settings.batch_size, settings.batch_window_s or FAUST_WINDOW_S
        # NOTE: faust's StreamT does not declare take_events; the Stream it passes has it.
        async for events in cast("faust.Stream[bytes]", stream).take_events(size, within=within):
            # As the scoring app emits: enqueue the batch, then await deliveries together
            # (a record without a value forwarded empty, as the scoring loop reads one).
            pending = [await decisions.send(event.message.key, event.message.value or b"") for event in events]
            await asyncio.gather(*pending)

    return app


def main(argv: list[str] | None = None) -> int:
    """Run one pass-through worker (settings from ``FRAUD_*``, as ``fraud-pipeline worker``)."""
    from app.topics import ensure_topics

    parser = argparse.ArgumentParser(prog="python -m bench.passthrough", description=__doc__.splitlines()[0])
    parser.add_argument("--web-port", type=int, help="faust web port (one per worker on a machine)")
    parser.add_argument("--loglevel", default="info")
    parser.add_argument("--broker-wait", type=float, default=60.0, help="seconds to wait for the broker")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    overrides: dict[str, Any] = {"web_port": args.web_port} if args.web_port else {}
    settings = Settings(**overrides)
    asyncio.run(ensure_topics(settings, wait_s=args.broker_wait))
    app = create_passthrough_app(settings)
    faust.Worker(app, loglevel=args.loglevel, quiet=True).execute_from_commandline()
    return 0


if __name__ == "__main__":
    sys.exit(main())
