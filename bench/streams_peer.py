"""The benchmark's peer: a Kafka Streams ``exactly_once_v2`` pass-through.

The Java program in ``bench/streams/`` (``make streams`` builds it with Maven,
Kafka Streams at the broker's version) reads ``transactions`` and writes each
record's key and value unchanged to ``decisions`` in Kafka Streams'
transactions, one stream thread. It is what a well-known exactly-once stream
processor pays to move a record, measured beside ``bare``, the faust ``ceiling``
and the pipeline in one run of ``python -m bench.run``. The load generator
matches its outputs by the ``transaction_id`` inside the forwarded value, as
for the other pass-throughs.

This module is its launcher: it takes the worker's ``FRAUD_*`` settings, creates
the topics (Kafka Streams creates none it does not own), then replaces itself
with the JVM, so the process the bench started and samples is the JVM.

    python -m bench.streams_peer --commit-interval-ms 25     # used by python -m bench.run
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from app.errors import ConfigError
from app.settings import Settings

__all__ = [
    "CLASSES_DIR",
    "DEFAULT_COMMIT_INTERVAL_MS",
    "LIB_DIR",
    "MAIN_CLASS",
    "PEERS",
    "against_peer",
    "commit_interval_ms",
    "java_command",
    "launcher_argv",
    "main",
]

STREAMS_DIR = Path(__file__).resolve().parent / "streams"
#: What ``make streams`` builds: the compiled class and its runtime class path.
CLASSES_DIR = STREAMS_DIR / "target" / "classes"
LIB_DIR = STREAMS_DIR / "target" / "lib"
MAIN_CLASS = "fraud.bench.PassThrough"
#: Kafka Streams' own default under exactly-once (StreamsConfig: 100 ms with
#: exactly_once_v2, 30 s at least once): the interval a user gets by default.
DEFAULT_COMMIT_INTERVAL_MS = 100
#: A pass-through holds a few batches in memory: a small heap, taken at start,
#: leaves the shared 2 cores' memory to the broker and Redis.
HEAP = ("-Xms128m", "-Xmx256m")
#: The peer's variants in bench.run, compared with the pipeline by :func:`against_peer`.
PEERS = ("streams", "streams-25ms")


def commit_interval_ms(commit_interval_s: float | None) -> int:
    """A variant's commit interval for Kafka Streams: None is Kafka Streams' default."""
    if commit_interval_s is None:
        return DEFAULT_COMMIT_INTERVAL_MS
    if commit_interval_s < 0:
        raise ConfigError(f"a commit interval cannot be negative: {commit_interval_s} s")
    return round(commit_interval_s * 1000)


def launcher_argv(commit_interval_s: float | None) -> list[str]:
    """How the bench starts the peer (its worker options are appended after)."""
    interval = str(commit_interval_ms(commit_interval_s))
    return [sys.executable, "-m", "bench.streams_peer", "--commit-interval-ms", interval]


def java_command(settings: Settings, *, commit_interval_ms: int, java: str = "java") -> list[str]:
    """The JVM's command line for the worker ``settings`` name: its broker, its
    topics, its app id (Kafka Streams' group and transactional id) and a state
    directory under its data dir (a pass-through keeps no state, but Kafka
    Streams locks one per task)."""
    if settings.kafka_sasl_mechanism or settings.kafka_ssl:
        # NOTE: the bench's main run is on the plaintext broker; passing SASL and
        # TLS on to the JVM would be code no run exercises.
        raise ConfigError("the Kafka Streams pass-through runs on the plaintext broker only (no SASL, no TLS)")
    classpath = f"{CLASSES_DIR}{os.pathsep}{LIB_DIR / '*'}"
    return [
        java, *HEAP, "-XX:+UseG1GC", "-Djava.awt.headless=true", "-cp", classpath, MAIN_CLASS,
        "--bootstrap", settings.kafka_bootstrap,
        "--input", settings.topic_transactions,
        "--output", settings.topic_decisions,
        "--application-id", settings.app_id,
        "--state-dir", str((settings.data_dir / "streams").resolve()),
        "--commit-interval-ms", str(commit_interval_ms),
    ]  # fmt: skip


def against_peer(
    runs: Sequence[Mapping[str, Any]], pipeline: str = "batched", threshold_ms: float = 200.0
) -> dict[str, Any]:
    """The pipeline's p99 against each peer variant's at every offered rate both
    were measured at, up to the pipeline's knee (its runs with p99 under
    ``threshold_ms``, nothing lost). ``beats``: per peer, whether the pipeline's
    p99 was the lower at every such rate (None: no rate in common). A rate
    measured twice (a repeat on a fresh worker) counts with its last run, as
    the bench's verdicts do."""
    last: dict[tuple[str, float], Mapping[str, Any]] = {}
    for run in runs:
        if run["variant"] in (pipeline, *PEERS) and run.get("p99_ms") is not None:
            last[run["variant"], run["offered_tps"]] = run
    rows: list[dict[str, Any]] = []
    for (variant, rate), run in sorted(last.items(), key=lambda item: item[0][1]):
        if variant != pipeline or run["lost"] or run.get("error") or run["p99_ms"] >= threshold_ms:
            continue
        peers = {peer: last[peer, rate]["p99_ms"] for peer in PEERS if (peer, rate) in last}
        if peers:
            rows.append({"offered_tps": rate, "p99_ms": {pipeline: run["p99_ms"], **peers}})
    beats: dict[str, bool | None] = {}
    for peer in PEERS:
        p99s: list[dict[str, float]] = [row["p99_ms"] for row in rows]
        pairs = [(p99[pipeline], p99[peer]) for p99 in p99s if peer in p99]
        beats[peer] = all(ours < theirs for ours, theirs in pairs) if pairs else None
    return {"pipeline": pipeline, "threshold_ms": threshold_ms, "rates": rows, "beats": beats}


def _java() -> str:
    home = os.environ.get("JAVA_HOME")
    found = str(Path(home) / "bin" / "java") if home else shutil.which("java")
    if not found or not os.access(found, os.X_OK):
        raise ConfigError("java is not on PATH: the Kafka Streams pass-through needs Java 17+")
    return found


def main(argv: list[str] | None = None) -> int:
    """Create the topics, then exec the JVM (settings from ``FRAUD_*``, as a worker)."""
    from app.topics import ensure_topics

    parser = argparse.ArgumentParser(prog="python -m bench.streams_peer", description=__doc__.splitlines()[0])
    parser.add_argument("--commit-interval-ms", type=int, default=DEFAULT_COMMIT_INTERVAL_MS)
    parser.add_argument("--web-port", type=int, help="unused: accepted as a worker's is")
    parser.add_argument("--loglevel", default="info", help="unused: the JVM logs warnings and errors")
    parser.add_argument("--broker-wait", type=float, default=60.0, help="seconds to wait for the broker")
    args = parser.parse_args(argv)
    if not (CLASSES_DIR / MAIN_CLASS.replace(".", "/")).with_suffix(".class").exists():
        print(f"{CLASSES_DIR} has no {MAIN_CLASS}: run `make streams` first", file=sys.stderr)
        return 2
    settings = Settings()
    command = java_command(settings, commit_interval_ms=args.commit_interval_ms, java=_java())
    asyncio.run(ensure_topics(settings, wait_s=args.broker_wait))
    sys.stdout.flush()
    os.execv(command[0], command)


if __name__ == "__main__":
    sys.exit(main())
