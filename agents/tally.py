"""The live confirmed-fraud tally per merchant, read by the rules of every batch.

A GlobalTable: every worker holds all of it, since any worker may score any
merchant. The ``labels`` agent re-keys labels by merchant, so one merchant's
labels are counted by one partition (a GlobalTable written from two partitions
would race). The scoring loop reads it while it scores a batch (through the
lookup :func:`install_merchant_tally` returns, on the event loop); writes
need a current faust event, so they happen here, in the ``labels`` agent.
"""

from __future__ import annotations

from collections.abc import Callable

import faust

from app.faust_app import RAW
from app.settings import Settings
from pipeline.labels import MerchantTally, parse_label

__all__ = ["install_merchant_tally"]


def install_merchant_tally(app: faust.App, settings: Settings) -> Callable[[str], MerchantTally | None]:
    """Adds the table and the ``labels`` agent to ``app``; returns the tally lookup."""
    labels = app.topic(settings.topic_labels, **RAW)
    # Partitions as the repartitioned labels stream faust declares (the app default).
    # NOTE: no value_type: with value_type=dict faust's changelog recovery calls
    # dict.from_data(), fails ("Error in recovery ...") and never finishes, so a
    # worker restarted after any tallied label never became ready. Without one,
    # values are JSON and come back as plain dicts.
    merchant_labels = app.GlobalTable("merchant-labels", key_type=str, partitions=settings.partitions)

    def merchant_tally(merchant_id: str) -> MerchantTally | None:
        doc = merchant_labels.get(merchant_id)
        return MerchantTally.from_json(doc) if doc else None

    @app.agent(labels)
    async def tally_labels(stream: faust.StreamT[bytes]) -> None:
        async for raw in stream.group_by(_label_merchant, name="labels-by-merchant"):
            label = parse_label(raw)
            if isinstance(label, str) or label.merchant_id is None:
                continue  # malformed or merchant-less labels do not feed the tally
            tally = MerchantTally.from_json(merchant_labels.get(label.merchant_id))
            if tally.apply(label):
                merchant_labels[label.merchant_id] = tally.to_json()

    return merchant_tally


def _label_merchant(raw: bytes) -> bytes:
    label = parse_label(raw)
    merchant = None if isinstance(label, str) else label.merchant_id
    return (merchant or "").encode()
