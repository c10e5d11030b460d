"""The benchmark pass-through's produce path: straight to the app's producer.

(The scoring loop produces through its own transactional librdkafka producer, app/eos.py.)

faust's ``Topic.send`` wraps each record in a ``PendingMessage`` and a
``FutureMessage``, runs it through the channel's send path and its callbacks,
then calls the transport producer. For raw bytes to an existing topic none of
that adds anything, and it was measured at about half of the produce cost on
the worker's event loop (py-spy at 550 TPS: ``Topic.send`` 16.9 % of the main
thread's busy samples, of which the transport producer's own ``send`` 8.8 %).

:class:`RawTopic` calls the transport producer (``app.producer.send``, public
faust API, called positionally through :func:`app.seams.send_raw`) directly:
the same aiokafka producer, partitioner (by key, as ``Topic.send`` with no
partition), linger and acknowledgements; each call
returns the delivery future, awaited by the caller as before. What it leaves
out is faust's per-send sensor callbacks (``FRAUD_FAUST_SENSORS`` loses its
per-topic send counts; our own metrics are unaffected).

NOTE: not ``send_batch`` / one record batch per partition: that, together
with acknowledgements overlapped with the next batch, was tried and reverted
after the rebalance fault test lost records (docs/decisions.md).
This keeps faust's per-message accumulator path, only without faust's layers.
"""

from __future__ import annotations

from collections.abc import Awaitable
from typing import Any

import faust

from app.seams import send_raw

__all__ = ["RawTopic"]


class RawTopic:
    """Sends raw ``bytes`` records to one topic through ``app.producer``."""

    __slots__ = ("app", "name")

    def __init__(self, app: faust.App, name: str) -> None:
        self.app = app
        self.name = name

    async def send(self, key: bytes | None, value: bytes) -> Awaitable[Any]:
        """Hand one record to the producer; returns its delivery future (RecordMetadata)."""
        return await send_raw(self.app.producer, self.name, key, value)

    def __repr__(self) -> str:
        return f"RawTopic({self.name!r})"
