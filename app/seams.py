"""Every reach into faust's, mode's and aiokafka's private internals, in one place.

Each seam names the upstream code it depends on and why the public API does not
suffice; tests/unit/test_seams.py holds a canary per seam that fails when an
upgrade makes the seam a silent no-op. The versions are pinned exactly in
pyproject.toml for the same reason.
"""

from __future__ import annotations

from typing import Any

from faust.transport.drivers import aiokafka as faust_aiokafka

__all__ = ["install_read_committed"]


def install_read_committed() -> None:
    """Make faust's worker consumer read with ``isolation_level=read_committed``.

    NOTE: faust-streaming 0.15.3 reads committed data only in its own
    exactly-once mode (``processing_guarantee="exactly_once"``, which this
    project does not use: app/transactional.py says why). Everything the
    scoring agent writes is transactional, and the feedback loop's agents read
    ``feedback`` from the same consumer: an aborted batch's records must stay
    invisible to them. The consumer is built before it starts, and aiokafka
    hands ``_isolation_level`` to its fetcher at start, so setting it on the
    new consumer is enough. tests/integration/test_exactly_once.py checks it end to end.
    """
    thread_cls = faust_aiokafka.AIOKafkaConsumerThread
    original = thread_cls._create_worker_consumer
    if getattr(original, "_fraud_patched", False):
        return

    def _create_worker_consumer(self: Any, transport: Any) -> Any:
        consumer = original(self, transport)
        consumer._isolation_level = "read_committed"
        return consumer

    _create_worker_consumer._fraud_patched = True  # type: ignore[attr-defined]
    thread_cls._create_worker_consumer = _create_worker_consumer
