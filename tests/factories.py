"""Builders the unit and integration tests share: rules, transactions, a constant model,
Redis features, key partitioning. (Imported as ``tests.factories``.)"""

from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import tempfile
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from pipeline.features import FEATURE_NAMES
from pipeline.model import Prediction
from pipeline.rules import RuleSet, parse_rules


def iso(epoch: float) -> str:
    """A transaction timestamp as producers write it: ISO 8601, milliseconds, ``Z``."""
    return datetime.fromtimestamp(epoch, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def rules_doc(version: str, *, blocked_device: str | None = None, **over: Any) -> dict[str, Any]:
    """A rules file's content: the defaults (review at 0.5, decline at 0.9), with
    ``blocked_device`` on the block list and top-level keys replaced by ``over``."""
    doc: dict[str, Any] = {
        "version": version,
        "thresholds": {"review": 0.5, "decline": 0.9},
        "force_review_amount_usd": 10000,
        "degraded_review_amount_usd": 1000,
        "allow": {"user_id": [], "device_id": [], "merchant_id": []},
        "block": {"user_id": [], "device_id": [blocked_device] if blocked_device else [], "merchant_id": []},
    }
    doc.update(over)
    return doc


def rules(version: str, *, blocked_device: str | None = None, **over: Any) -> RuleSet:
    return parse_rules(rules_doc(version, blocked_device=blocked_device, **over))


#: Rules for scorer-level unit tests that need no particular version or block list.
RULES = rules("rules-unit-1")


class ConstantModel:
    """Every row gets ``score``; optionally sleeps first (a model over its budget).
    Counts its calls; explains rows scored at or above ``explain_above``."""

    def __init__(self, score: float = 0.1, sleep_s: float = 0.0, version: str = "const-1") -> None:
        self.score = score
        self.sleep_s = sleep_s
        self.version = version
        self.calls = 0

    def predict(self, matrix: np.ndarray, explain_above: float | None = 0.0) -> Prediction:
        self.calls += 1
        assert matrix.shape[1] == len(FEATURE_NAMES)
        if self.sleep_s:
            time.sleep(self.sleep_s)
        n = matrix.shape[0]
        explained = explain_above is not None and self.score >= explain_above
        return Prediction(np.full(n, self.score), [[("amount_usd", 0.5)] if explained else [] for _ in range(n)])


def tx_doc(i: int, now: float | None = None, **over: Any) -> dict[str, Any]:
    """A valid transaction document, ``t-{i:04d}`` of user ``u-{i % 7:03d}``, sent a
    second before ``now`` (default: the current time); ``over`` replaces fields."""
    now = time.time() if now is None else now
    doc: dict[str, Any] = {
        "transaction_id": f"t-{i:04d}",
        "user_id": f"u-{i % 7:03d}",
        "amount": 10.0 + i,
        "merchant_id": "m-000001",
        "timestamp": iso(now - 1.0),
    }
    doc.update(over)
    return doc


def tx_bytes(i: int, now: float | None = None, **over: Any) -> bytes:
    return orjson.dumps(tx_doc(i, now, **over))


def partition_of(key: bytes, partitions: int) -> int:
    """The partition a producer (murmur2, as Java clients) puts ``key`` on."""
    from aiokafka.partitioner import DefaultPartitioner

    every = list(range(partitions))
    return int(DefaultPartitioner()(key, every, every))


def materialize_into(frame: Any, url: str, *, flush: bool = False) -> None:
    """Write ``frame``'s features to the Redis at ``url`` (``flush``: empty it first)."""
    import redis

    from tools.materialize import materialize

    client = redis.Redis.from_url(url)
    try:
        if flush:
            client.flushdb()
        materialize(frame, client, progress=False)
    finally:
        client.close()


# --- decision signing keys ------------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def decision_key_files() -> tuple[Path, Path]:
    """One decision signing key for the whole test process: (private key PEM, public keys file).

    Every worker a test starts signs with it and every gateway verifies with it,
    as one deployment's workers and gateways share a key.
    """
    from pipeline.decision_signing import DecisionSigner, DecisionVerifier, write_private_key, write_public_keys

    folder = Path(tempfile.mkdtemp(prefix="decision-keys-"))
    signer = DecisionSigner.generate()
    write_private_key(signer, folder / "decision-key.pem")
    write_public_keys(DecisionVerifier([signer.public_key]), folder / "decision-public-keys.json")
    return folder / "decision-key.pem", folder / "decision-public-keys.json"


def decision_key_env() -> dict[str, str]:
    key, public = decision_key_files()
    return {"FRAUD_DECISION_SIGNING_KEY_FILE": str(key), "FRAUD_DECISION_PUBLIC_KEYS_FILE": str(public)}


def write_keys(path: Path, **clients: str) -> Path:
    """A producer or API keys file: ``{"clients": {id: key}}``."""
    path.write_text(json.dumps({"clients": clients}))
    return path


def new_key() -> str:
    return uuid.uuid4().hex + uuid.uuid4().hex  # 32 bytes as hex


def stop_process(proc: subprocess.Popen[Any]) -> None:
    """SIGTERM a process this test started, SIGKILL it after 15 s."""
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
