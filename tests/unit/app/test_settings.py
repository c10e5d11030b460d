"""Unknown ``FRAUD_*`` variables are refused with the closest valid names."""

from __future__ import annotations

import logging

import pytest

from app.errors import ConfigError
from app.settings import OTHER_VARIABLES, Settings, check_environment, get_settings, unknown_variables
from tools import cli


def test_a_mistyped_limit_is_reported_with_the_real_name(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FRAUD_GATEWAY_RATE_BURST", "3")
    get_settings.cache_clear()
    try:
        with pytest.raises(ConfigError, match=r"FRAUD_GATEWAY_RATE_BURST \(did you mean FRAUD_GATEWAY_BURST"):
            get_settings()
    finally:
        get_settings.cache_clear()


def test_the_cli_refuses_to_start_in_one_line(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("FRAUD_BATCHSIZE", "64")
    assert cli.main(["stack", "status"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "FRAUD_BATCHSIZE (did you mean FRAUD_BATCH_SIZE?)" in err, err


def test_every_setting_and_the_tooling_variables_are_known() -> None:
    env = {f"FRAUD_{name.upper()}": "x" for name in Settings.model_fields}
    env |= {name: "1" for name in OTHER_VARIABLES} | {"KAFKA_BOOTSTRAP": "h:1", "PATH": "/bin"}
    assert unknown_variables(env) == {}
    check_environment(env)


def test_no_suggestion_when_nothing_is_close() -> None:
    assert unknown_variables({"FRAUD_XYZZY": "1"}) == {"FRAUD_XYZZY": []}


def test_warn_only_is_an_explicit_choice(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        check_environment({"FRAUD_GATEWAY_RATE_BURST": "3", "FRAUD_UNKNOWN_ENV": "warn"})
    assert "FRAUD_GATEWAY_BURST" in caplog.text


def test_an_empty_variable_counts_as_unset(monkeypatch: pytest.MonkeyPatch) -> None:
    """docker-compose.yml passes optional settings as ``${NAME:-}``: empty when not given."""
    for name in ("FRAUD_REDIS_PASSWORD_FILE", "FRAUD_KAFKA_SASL_PASSWORD_FILE", "FRAUD_KAFKA_SSL",
                 "FRAUD_KAFKA_SSL_CAFILE", "FRAUD_DECISION_SIGNING_KEY_FILE"):  # fmt: skip
        monkeypatch.setenv(name, "")
    settings = Settings()
    assert settings.redis_password_file is None and settings.kafka_sasl_password_file is None
    assert settings.kafka_ssl is False and settings.kafka_ssl_cafile is None
    assert settings.decision_signing_key_file is None
