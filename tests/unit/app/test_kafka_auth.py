"""SASL/TLS settings reach every Kafka client: aiokafka options and faust credentials."""

from __future__ import annotations

import ssl
from pathlib import Path

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


def test_the_password_comes_from_its_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    secret = tmp_path / "scoring.password"
    secret.write_text("from-the-file\n")
    monkeypatch.setenv("FRAUD_KAFKA_SASL_MECHANISM", "SCRAM-SHA-512")
    monkeypatch.setenv("FRAUD_KAFKA_SASL_USERNAME", "scoring")
    monkeypatch.setenv("FRAUD_KAFKA_SASL_PASSWORD_FILE", str(secret))
    assert kafka_auth(Settings())["sasl_plain_password"] == "from-the-file"
    # A password set directly wins over the file.
    monkeypatch.setenv("FRAUD_KAFKA_SASL_PASSWORD", "direct")
    assert kafka_auth(Settings())["sasl_plain_password"] == "direct"


def test_a_private_ca_file_is_what_the_client_trusts(tmp_path: Path) -> None:
    import subprocess

    ca = tmp_path / "ca.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(ca) + ".key",
         "-out", str(ca), "-days", "1", "-subj", "/CN=unit test CA"],
        check=True, capture_output=True,
    )  # fmt: skip
    context = kafka_auth(Settings(kafka_ssl=True, kafka_ssl_cafile=ca))["ssl_context"]
    assert isinstance(context, ssl.SSLContext)
    subjects = [dict(x[0] for x in cert["subject"]) for cert in context.get_ca_certs()]
    assert {"commonName": "unit test CA"} in subjects
    assert context.verify_mode == ssl.CERT_REQUIRED and context.check_hostname
