"""Fixtures for the real broker and Redis, started lazily by ``tools.stack``.

``kafka_bootstrap`` and ``redis_url`` use ``KAFKA_BOOTSTRAP`` / ``REDIS_URL`` when
set (a running ``python -m tools.stack up``, CI service containers, docker compose),
else start a private server on a free port for the test session and stop it, by
PID, at the end. Tests that request none of them start nothing.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import redis

from tools import stack

if TYPE_CHECKING:
    import pandas as pd


# Real processes, not containers (no Docker engine where these run; testcontainers is not a dependency).
@pytest.fixture(scope="session")
def kafka_bootstrap(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """``host:port`` of a ready Kafka-compatible broker."""
    external = os.environ.get("KAFKA_BOOTSTRAP")
    if external:
        stack.wait_broker_ready(external)
        yield external
        return
    handle = stack.start_broker(workdir=tmp_path_factory.mktemp("broker"))
    try:
        yield handle.url
    finally:
        handle.stop()


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """``redis://host:port/db`` of a ready Redis."""
    external = os.environ.get("REDIS_URL")
    if external:
        stack.wait_redis_ready(external)
        yield external
        return
    handle = stack.start_redis(workdir=tmp_path_factory.mktemp("redis"))
    try:
        yield handle.url
    finally:
        handle.stop()


@pytest.fixture
def redis_client(redis_url: str) -> Iterator[redis.Redis]:
    """A client on an empty database.

    NOTE: flushes the database of ``REDIS_URL`` when that is set: point it at a
    database kept for tests.
    """
    client = redis.Redis.from_url(redis_url)
    client.flushdb()
    try:
        yield client
    finally:
        client.close()


@pytest.fixture
def unique_name() -> Callable[[str], str]:
    """A factory of names no other test uses: ``unique_name("txn")`` -> ``"txn-1f0c…"``.

    The broker lives for the whole session (and may be shared), so each test
    takes fresh topics and consumer groups instead of cleaning up after others.
    """

    def make(prefix: str = "test") -> str:
        return f"{prefix}-{uuid.uuid4().hex[:12]}"

    return make


@pytest.fixture(scope="session")
def decision_keys() -> tuple[Path, Path]:
    """(private key, public keys file) of the decision signing key every test worker uses."""
    from tests.factories import decision_key_files

    return decision_key_files()


# --- data and a trained model, shared by the session --------------------------

#: A small simulation: big enough for the 7/7/7-day protocol and 30-day profiles.
TINY_SIM = {"n_users": 300, "n_merchants": 600, "days": 40, "seed": 11}


@pytest.fixture(scope="session")
def sim_frame() -> pd.DataFrame:
    from datetime import UTC, datetime

    from tools.simulator import SimulationConfig, simulate

    end = datetime.now(UTC).replace(hour=0, minute=0, second=0, microsecond=0)
    return simulate(SimulationConfig(**TINY_SIM, end=end), progress=False)


@pytest.fixture(scope="session")
def trained_registry(sim_frame: pd.DataFrame, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A registry serving one version trained on :func:`sim_frame` (fewer rounds).

    Training only registers; the version is promoted as an operator would, so
    the registry's log holds that one promotion.
    """
    from models.lifecycle import promote
    from models.training import TrainConfig, train

    registry = tmp_path_factory.mktemp("registry")
    result = train(sim_frame, registry, TrainConfig(rounds_scale=0.2), progress=False)
    promote(registry, result.version, by="tests", reason="first model")
    return registry


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """Show the fault tests' one-line outcomes (``FAULT name sent=… lost=…``) after the run."""
    path = os.environ.get("FRAUD_FAULT_REPORT")
    if path and os.path.isfile(path):
        lines = [line.rstrip() for line in open(path) if line.startswith("FAULT ")]
        if lines:
            terminalreporter.section("fault tests")
            for line in lines:
                terminalreporter.write_line(line)
