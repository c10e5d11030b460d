"""Which Kafka the local stack runs (``KAFKA_VERSION``, the jars in the class
path) and what follows from it, without starting one: the logging flag of each
line, a version that was not set up, and a log dir a newer Kafka formatted."""

from __future__ import annotations

from pathlib import Path

import pytest

from app.errors import StackError
from tools.stack import broker
from tools.stack.broker import FORMATTED_BY, kafka_lib_dir, log_config_flag, start_broker, write_log_config


def _jars(tmp_path: Path, version: str, monkeypatch: pytest.MonkeyPatch) -> Path:
    lib = tmp_path / f"lib-{version}"
    lib.mkdir()
    (lib / f"kafka_2.13-{version}.jar").write_bytes(b"")
    monkeypatch.setenv("FRAUD_KAFKA_LIB", str(lib))
    return lib


def test_each_version_has_its_own_folder_and_the_pom_names_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FRAUD_KAFKA_LIB", raising=False)
    monkeypatch.delenv("KAFKA_VERSION", raising=False)
    assert kafka_lib_dir() == broker.KAFKA_HOME / broker.default_kafka_version() / "lib"
    assert broker.default_kafka_version().startswith("4.")
    monkeypatch.setenv("KAFKA_VERSION", "3.9.1")
    assert kafka_lib_dir() == broker.KAFKA_HOME / "3.9.1" / "lib"


def test_a_version_not_set_up_names_the_command_that_fetches_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("FRAUD_KAFKA_LIB", raising=False)
    monkeypatch.setenv("KAFKA_VERSION", "3.0.99")
    with pytest.raises(StackError, match=r"KAFKA_VERSION=3\.0\.99 make setup"):
        start_broker(workdir=tmp_path)


def test_a_version_that_is_no_release_number_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FRAUD_KAFKA_LIB", raising=False)
    monkeypatch.setenv("KAFKA_VERSION", "../../etc")
    with pytest.raises(StackError, match="release number"):
        start_broker(workdir=tmp_path)


@pytest.mark.parametrize(
    ("version", "file", "flag"),
    [
        ("4.4.0", "broker-log4j2.properties", "-Dlog4j2.configurationFile="),
        ("3.9.1", "broker-log4j.properties", "-Dlog4j.configuration=file:"),
    ],
)
def test_each_line_gets_the_logging_config_its_jars_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, version: str, file: str, flag: str
) -> None:
    _jars(tmp_path, version, monkeypatch)
    out = tmp_path / "state"
    out.mkdir()
    assert write_log_config(out) == log_config_flag(out) == f"{flag}{out / file}"
    assert [p.name for p in out.iterdir()] == [file]
    assert "WARN" in (out / file).read_text()


def test_an_older_kafka_is_refused_a_log_dir_a_newer_one_formatted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Kafka does not downgrade (3.9.1 exits on a 4.4.0 log dir with a
    deserialization error in its log): the stack says so, and what to do, before
    starting it."""
    state = tmp_path / "state"
    (state / "kafka-logs").mkdir(parents=True)
    (state / "kafka-logs" / "meta.properties").write_text("version=1\n")
    (state / FORMATTED_BY).write_text("4.4.0\n")
    _jars(tmp_path, "3.9.1", monkeypatch)
    with pytest.raises(StackError, match=r"formatted by Kafka 4\.4\.0, which 3\.9\.1 cannot read.*KAFKA_VERSION=4\.4\.0"):
        start_broker(workdir=state)
    assert not (state / "broker.log").exists()  # nothing was started
