"""Decision signatures (pipeline/decision_signing.py): sign, verify, refuse, rotate."""

from __future__ import annotations

import base64
from pathlib import Path

import orjson
import pytest

from app.errors import ConfigError
from app.settings import Settings
from gateway.replies import Replies
from pipeline.decision_signing import (
    KEY_ID,
    SIGNATURE,
    DecisionSigner,
    DecisionVerifier,
    Unverified,
    signer_from_settings,
    verifier_from_settings,
    write_private_key,
    write_public_keys,
)
from pipeline.scorer import BatchOutput, Inbound

VALUE = orjson.dumps({"transaction_id": "t-1", "action": "approve", "correlation_id": "c-1"})


def headers(signer: DecisionSigner, value: bytes = VALUE) -> dict[str, bytes]:
    return dict(signer.headers(value))


def test_a_signed_decision_verifies_with_the_published_key() -> None:
    signer = DecisionSigner.generate()
    assert DecisionVerifier([signer.public_key]).verify(VALUE, headers(signer)) == signer.key_id
    assert len(signer.key_id) == 16 and len(base64.b64decode(headers(signer)[SIGNATURE])) == 64


def test_a_tampered_value_is_refused() -> None:
    signer = DecisionSigner.generate()
    verifier = DecisionVerifier([signer.public_key])
    tampered = VALUE.replace(b"approve", b"decline")
    verdict = verifier.verify(tampered, headers(signer))
    assert isinstance(verdict, Unverified) and verdict.code == "bad_signature"


def test_an_unknown_key_is_refused() -> None:
    signer, other = DecisionSigner.generate(), DecisionSigner.generate()
    verdict = DecisionVerifier([other.public_key]).verify(VALUE, headers(signer))
    assert isinstance(verdict, Unverified) and verdict.code == "unknown_key"


def test_a_known_key_id_with_another_keys_signature_is_refused() -> None:
    genuine, impostor = DecisionSigner.generate(), DecisionSigner.generate()
    forged = {KEY_ID: genuine.key_id.encode(), SIGNATURE: headers(impostor)[SIGNATURE]}
    verdict = DecisionVerifier([genuine.public_key]).verify(VALUE, forged)
    assert isinstance(verdict, Unverified) and verdict.code == "bad_signature"


@pytest.mark.parametrize(
    "bad",
    [{}, {KEY_ID: b"0123456789abcdef"}, {SIGNATURE: b"AAAA"}, {KEY_ID: b"x" * 500, SIGNATURE: b"AAAA"}],
)
def test_missing_or_garbled_headers_are_refused(bad: dict[str, bytes]) -> None:
    signer = DecisionSigner.generate()
    assert isinstance(DecisionVerifier([signer.public_key]).verify(VALUE, bad), Unverified)


def test_garbled_signature_is_refused() -> None:
    signer = DecisionSigner.generate()
    garbled = {KEY_ID: signer.key_id.encode(), SIGNATURE: b"not base64!"}
    verdict = DecisionVerifier([signer.public_key]).verify(VALUE, garbled)
    assert isinstance(verdict, Unverified) and verdict.code == "bad_signature"


def test_rotation_both_published_keys_verify(tmp_path: Path) -> None:
    old, new = DecisionSigner.generate(), DecisionSigner.generate()
    write_public_keys(DecisionVerifier([old.public_key, new.public_key]), tmp_path / "public.json")
    verifier = DecisionVerifier.from_file(tmp_path / "public.json")
    assert set(verifier) == {old.key_id, new.key_id}
    assert verifier.verify(VALUE, headers(old)) == old.key_id
    assert verifier.verify(VALUE, headers(new)) == new.key_id


def test_keys_load_from_pem_raw_hex_and_base64(tmp_path: Path) -> None:
    signer = DecisionSigner.generate()
    write_private_key(signer, tmp_path / "key.pem")
    assert (tmp_path / "key.pem").stat().st_mode & 0o777 == 0o600
    assert DecisionSigner.from_file(tmp_path / "key.pem").key_id == signer.key_id
    seed = signer._key.private_bytes_raw()
    assert DecisionSigner.from_bytes(seed.hex().encode(), "env").key_id == signer.key_id
    assert DecisionSigner.from_bytes(base64.b64encode(seed), "env").key_id == signer.key_id
    settings = Settings(decision_signing_key=seed.hex())
    loaded = signer_from_settings(settings)
    assert loaded is not None and loaded.key_id == signer.key_id
    assert "PRIVATE" not in repr(loaded) and seed.hex() not in repr(loaded)


def test_bad_key_material_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="32 bytes"):
        DecisionSigner.from_bytes(b"abcd", "env")
    with pytest.raises(ConfigError, match="PEM"):
        DecisionSigner.from_bytes(b"-----BEGIN PRIVATE KEY-----\nnope\n-----END PRIVATE KEY-----\n", "env")
    with pytest.raises(ConfigError):
        DecisionSigner.from_file(tmp_path / "missing.pem")
    (tmp_path / "public.json").write_text('{"keys": [{"key_id": "0000000000000000", "public_key": "'
                                         + base64.b64encode(b"\x01" * 32).decode() + '"}]}')  # fmt: skip
    with pytest.raises(ConfigError, match="not the id"):
        DecisionVerifier.from_file(tmp_path / "public.json")
    assert not verifier_from_settings(Settings())


def test_the_worker_refuses_to_start_without_a_key_unless_development() -> None:
    from agents.wiring import load_decision_signer

    with pytest.raises(ConfigError, match="FRAUD_DECISION_SIGNING_KEY_FILE"):
        load_decision_signer(Settings(allow_unsigned=False))
    assert isinstance(load_decision_signer(Settings(allow_unsigned=True)), DecisionSigner)  # throwaway, warned


def test_each_decision_is_signed_over_its_final_bytes_and_nothing_else_is() -> None:
    signer = DecisionSigner.generate()
    verifier = DecisionVerifier([signer.public_key])
    out = BatchOutput()
    out.decide(Inbound(value=b"", partition=3), b"t-1", VALUE, [("decision-content-hash", b"h")])
    out.decide(Inbound(value=b""), b"t-2", VALUE)  # no partition (a message from no topic): on its key's
    out.add("dead_letters", None, b"{}")
    topics = {"decisions": "d", "dead_letters": "dlq", "feedback": "f", "monitoring": "m", "transactions": "tx"}
    records = out.records(topics, signer)
    placed = out.placed(topics, signer)
    (keyed,) = [r for r in records if r[0] == "d"]
    assert verifier.verify(keyed[2], dict(keyed[3])) == signer.key_id
    [(_, partition, _, value, headers)] = placed
    assert partition == 3 and verifier.verify(value, dict(headers)) == signer.key_id
    assert ("decision-content-hash", b"h") in headers  # the index entry's header, beside the signature
    assert all(r[3] == [] for r in records if r[0] != "d")
    assert all(r[3] == [] for r in out.records(topics))  # no signer: no headers


def test_the_gateway_answers_only_with_verified_decisions() -> None:
    signer, impostor = DecisionSigner.generate(), DecisionSigner.generate()
    replies = Replies(Settings(topic_decisions="dec", topic_dlq="dlq"), DecisionVerifier([signer.public_key]))

    async def run() -> None:
        future = replies.expect("c-1")
        assert not replies.deliver("dec", VALUE, impostor.headers(VALUE))
        assert not replies.deliver("dec", VALUE, [])
        assert not future.done() and replies.unverified == 2
        assert replies.deliver("dec", VALUE, signer.headers(VALUE))
        assert (await future).record["action"] == "approve"

    import asyncio

    asyncio.run(run())


def test_decision_key_command_creates_rotates_and_retires(tmp_path: Path) -> None:
    from tools.cli import main

    old_key, new_key, public = tmp_path / "key-1.pem", tmp_path / "key-2.pem", tmp_path / "public.json"
    assert main(["decision-key", "--key", str(old_key), "--public", str(public)]) == 0
    old = DecisionSigner.from_file(old_key)
    assert main(["decision-key", "--key", str(old_key), "--public", str(public)]) == 0  # kept
    assert DecisionSigner.from_file(old_key).key_id == old.key_id
    # Rotation: a second key next to the first; both verify until the old one is retired.
    assert main(["decision-key", "--key", str(new_key), "--public", str(public)]) == 0
    new = DecisionSigner.from_file(new_key)
    both = DecisionVerifier.from_file(public)
    assert both.verify(VALUE, headers(old)) == old.key_id and both.verify(VALUE, headers(new)) == new.key_id
    assert main(["decision-key", "--key", str(old_key), "--public", str(public), "--retire", old.key_id]) == 1
    assert main(["decision-key", "--key", str(new_key), "--public", str(public), "--retire", old.key_id]) == 0
    after = DecisionVerifier.from_file(public)
    assert isinstance(after.verify(VALUE, headers(old)), Unverified) and after.verify(VALUE, headers(new)) == new.key_id
    assert main(["decision-key", "--key", str(new_key), "--public", str(public), "--rotate"]) == 0  # in place
    assert DecisionSigner.from_file(new_key).key_id != new.key_id


def test_public_keys_from_the_environment() -> None:
    from pipeline.decision_signing import public_key_text

    a, b = DecisionSigner.generate(), DecisionSigner.generate()
    settings = Settings(decision_public_keys=f"{public_key_text(a.public_key)}, {public_key_text(b.public_key)}")
    assert set(verifier_from_settings(settings)) == {a.key_id, b.key_id}
    with pytest.raises(ConfigError, match="32 bytes"):
        verifier_from_settings(Settings(decision_public_keys="AAAA"))


def test_the_consumer_snippet_in_security_md_verifies(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """SECURITY.md's Python consumer example, run as written."""
    from dataclasses import dataclass

    source = (Path(__file__).parents[3] / "SECURITY.md").read_text().split("```python\n")[1].split("```")[0]
    signer = DecisionSigner.generate()
    write_public_keys(DecisionVerifier([signer.public_key]), tmp_path / "config" / "decision-public-keys.json")
    monkeypatch.chdir(tmp_path)
    namespace: dict[str, object] = {}
    exec(source, namespace)
    verified = namespace["verified"]

    @dataclass
    class Record:
        value: bytes
        headers: list[tuple[str, bytes]]

    assert verified(Record(VALUE, signer.headers(VALUE)))["action"] == "approve"  # type: ignore[operator]
    for forged in (Record(VALUE, []), Record(VALUE + b" ", signer.headers(VALUE)),
                   Record(VALUE, DecisionSigner.generate().headers(VALUE))):  # fmt: skip
        assert verified(forged) is None  # type: ignore[operator]
