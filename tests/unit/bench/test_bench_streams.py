"""The Kafka Streams peer: how the bench starts it and where it stands in the plan."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from app.errors import ConfigError
from app.settings import Settings
from bench import streams_peer
from bench.plan import FULL_PLAN, MAIN_VARIANTS, QUICK_PLAN, STREAMS, STREAMS_25MS, Variant

REPO = Path(__file__).resolve().parents[3]


def _option(command: list[str], name: str) -> str:
    return command[command.index(name) + 1]


def test_the_default_variant_runs_at_kafka_streams_own_interval_and_the_short_one_at_25_ms() -> None:
    assert streams_peer.launcher_argv(STREAMS.commit_interval_s) == [
        sys.executable, "-m", "bench.streams_peer", "--commit-interval-ms", "100",
    ]  # fmt: skip
    assert _option(streams_peer.launcher_argv(STREAMS_25MS.commit_interval_s), "--commit-interval-ms") == "25"
    assert streams_peer.commit_interval_ms(0.0) == 0


def test_a_negative_commit_interval_is_refused() -> None:
    with pytest.raises(ConfigError, match="negative"):
        streams_peer.commit_interval_ms(-0.01)


def test_the_jvm_reads_and_writes_the_workers_topics_under_its_app_id(tmp_path: Path) -> None:
    settings = Settings(
        kafka_bootstrap="127.0.0.1:40123", topic_transactions="bench-tx-a", topic_decisions="bench-dec-a",
        app_id="bench-streams-a", data_dir=tmp_path / "faust",
    )  # fmt: skip
    command = streams_peer.java_command(settings, commit_interval_ms=25, java="/opt/java/bin/java")
    assert command[0] == "/opt/java/bin/java"
    assert command[command.index("-cp") + 2] == streams_peer.MAIN_CLASS
    classpath = _option(command, "-cp").split(":")
    assert classpath == [str(streams_peer.CLASSES_DIR), str(streams_peer.LIB_DIR / "*")]
    assert _option(command, "--bootstrap") == "127.0.0.1:40123"
    assert _option(command, "--input") == "bench-tx-a"
    assert _option(command, "--output") == "bench-dec-a"
    assert _option(command, "--application-id") == "bench-streams-a"
    assert _option(command, "--state-dir") == str((tmp_path / "faust" / "streams").resolve())
    assert _option(command, "--commit-interval-ms") == "25"


@pytest.mark.parametrize("secure", [{"kafka_sasl_mechanism": "SCRAM-SHA-512"}, {"kafka_ssl": True}])
def test_a_secured_broker_is_refused_rather_than_reached_without_credentials(secure: dict[str, object]) -> None:
    with pytest.raises(ConfigError, match="plaintext"):
        streams_peer.java_command(Settings(**secure), commit_interval_ms=100)  # type: ignore[arg-type]


def test_the_peer_is_a_pass_through_whose_interval_is_not_the_pipelines() -> None:
    env = STREAMS_25MS.env()
    assert STREAMS_25MS.passthrough
    assert env["FRAUD_DECISION_PUBLIC_KEYS"] == ""  # forwards transactions: no signature to check
    assert "FRAUD_COMMIT_INTERVAL_S" not in env
    pipeline = Variant("p", kind="pipeline", batch_size=64, batch_window_s=0.01, commit_interval_s=0.025)
    assert pipeline.env()["FRAUD_COMMIT_INTERVAL_S"] == "0.025"


def test_both_streams_variants_are_measured_and_searched_in_a_full_run() -> None:
    assert FULL_PLAN.variants == MAIN_VARIANTS
    streams = [v for v in FULL_PLAN.variants if v.kind == "streams"]
    assert [(v.name, v.commit_interval_s) for v in streams] == [("streams", None), ("streams-25ms", 0.025)]
    names = [v.name for v in FULL_PLAN.variants]
    assert {"bare", "ceiling", "batched"} <= set(names)
    assert FULL_PLAN.search_steps[0] > 0


def test_a_quick_run_measures_one_streams_variant_beside_every_other() -> None:
    quick = [v.name for v in QUICK_PLAN.variants]
    assert [n for n in quick if n.startswith("streams")] == ["streams-25ms"]
    assert set(quick) == {v.name for v in MAIN_VARIANTS} - {"streams"}


def test_kafka_streams_takes_the_brokers_kafka_version() -> None:
    """The peer's pom names no Kafka version of its own: the Makefile gives it
    deploy/kafka/pom.xml's, so a broker upgrade moves Kafka Streams too."""
    pom = (REPO / "bench" / "streams" / "pom.xml").read_text()
    streams = re.search(r"<artifactId>kafka-streams</artifactId>\s*<version>([^<]+)</version>", pom)
    assert streams is not None and streams.group(1) == "${kafka.version}"
    assert "<kafka.version>" not in pom
    broker = re.search(r"<kafka.version>([^<]+)</kafka.version>", (REPO / "deploy" / "kafka" / "pom.xml").read_text())
    assert broker is not None
    # What `make streams` would run (-n: print only; -B: as if out of date), by
    # default and with KAFKA_VERSION naming another version (the broker's too).
    for version, expected in ((None, broker.group(1)), ("3.9.1", "3.9.1")):
        env = {k: v for k, v in os.environ.items() if k != "KAFKA_VERSION"} | ({"KAFKA_VERSION": version} if version else {})
        dry = subprocess.run(["make", "-n", "-B", "streams"], cwd=REPO, env=env, capture_output=True, text=True, check=True)
        build = next(line for line in dry.stdout.splitlines() if "bench/streams/pom.xml" in line and "mvn" in line)
        assert f"-Dkafka.version={expected} " in build


def _run(variant: str, rate: float, p99: float, *, phase: str = "rate", lost: int = 0) -> dict[str, object]:
    return {"variant": variant, "phase": phase, "offered_tps": rate, "p99_ms": p99, "lost": lost}


def test_the_pipeline_is_compared_with_each_peer_up_to_its_own_knee() -> None:
    runs = [
        _run("batched", 500.0, 60.0), _run("streams", 500.0, 130.0), _run("streams-25ms", 500.0, 50.0),
        _run("batched", 1000.0, 45.0), _run("streams", 1000.0, 120.0), _run("streams-25ms", 1000.0, 48.0),
        # Past the pipeline's knee: not compared, however the peer did.
        _run("batched", 4000.0, 2400.0), _run("streams", 4000.0, 110.0), _run("streams-25ms", 4000.0, 40.0),
        _run("batched", 3000.0, 150.0, lost=3), _run("streams", 3000.0, 100.0),
        _run("bare", 1000.0, 20.0),  # not a peer
    ]  # fmt: skip
    found = streams_peer.against_peer(runs)
    assert [row["offered_tps"] for row in found["rates"]] == [500.0, 1000.0]
    assert found["rates"][1]["p99_ms"] == {"batched": 45.0, "streams": 120.0, "streams-25ms": 48.0}
    assert found["beats"] == {"streams": True, "streams-25ms": False}


def test_a_repeated_rate_is_compared_by_its_last_run_and_no_common_rate_decides_nothing() -> None:
    runs = [
        _run("batched", 1000.0, 45.0), _run("streams-25ms", 1000.0, 260.0),
        _run("streams-25ms", 1000.0, 40.0, phase="repeat"),  # the spike did not reproduce
    ]  # fmt: skip
    assert streams_peer.against_peer(runs)["beats"] == {"streams": None, "streams-25ms": False}
    assert streams_peer.against_peer([_run("batched", 1000.0, 45.0)]) == {
        "pipeline": "batched", "threshold_ms": 200.0, "rates": [], "beats": {"streams": None, "streams-25ms": None},
    }  # fmt: skip


def test_the_report_prints_the_pipeline_against_the_peer() -> None:
    from bench.plan import BATCHED
    from bench.report import format_report
    from tests.unit.bench.test_bench import record, results_doc

    runs = [record(BATCHED, 1000.0, p99=40.0), record(STREAMS, 1000.0, p99=120.0), record(STREAMS_25MS, 1000.0, p99=60.0)]
    doc = results_doc(runs) | {"against_peer": streams_peer.against_peer(runs)}
    text = format_report(doc)
    assert "1,000 TPS batched 40, streams 120, streams-25ms 60" in text
    assert "batched lower at every rate: vs streams True, vs streams-25ms True" in text
