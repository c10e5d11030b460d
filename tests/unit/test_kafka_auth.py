"""SASL/TLS settings reach every Kafka client: aiokafka options and faust credentials."""

from __future__ import annotations

import ssl

import faust
import pytest

from app.faust_app import _credentials
from app.settings import Settings
from app.topics import kafka_auth


def test_plaintext_by_default() -> None:
    assert kafka_auth(Settings()) == {}
    assert _credentials(Settings()) is None


def test_tls_only() -> None:
    opts = kafka_auth(Settings(kafka_ssl=True))
    assert opts["security_protocol"] == "SSL" and isinstance(opts["ssl_context"], ssl.SSLContext)
    creds = _credentials(Settings(kafka_ssl=True))
    assert isinstance(creds, faust.SSLCredentials)


@pytest.mark.parametrize(("tls", "protocol"), [(False, "SASL_PLAINTEXT"), (True, "SASL_SSL")])
def test_sasl(tls: bool, protocol: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FRAUD_KAFKA_SASL_MECHANISM", "SCRAM-SHA-512")
    monkeypatch.setenv("FRAUD_KAFKA_SASL_USERNAME", "fraud")
    monkeypatch.setenv("FRAUD_KAFKA_SASL_PASSWORD", "s3cret")
    monkeypatch.setenv("FRAUD_KAFKA_SSL", "true" if tls else "false")
    settings = Settings()
    assert "s3cret" not in repr(settings)  # a SecretStr: never in logs
    opts = kafka_auth(settings)
    assert opts["security_protocol"] == protocol
    assert (opts["sasl_mechanism"], opts["sasl_plain_username"], opts["sasl_plain_password"]) == (
        "SCRAM-SHA-512", "fraud", "s3cret")
    creds = _credentials(settings)
    assert isinstance(creds, faust.SASLCredentials)
    assert (creds.mechanism.value, creds.username, creds.password) == ("SCRAM-SHA-512", "fraud", "s3cret")
    assert (creds.ssl_context is not None) is tls
