"""Signing, verification, client keys and the replay rule (in memory)."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
from collections.abc import Callable
from pathlib import Path

import orjson
import pytest

from app.errors import ConfigError
from app.redis_keys import signature_key
from pipeline.auth import (
    AUTH_CODES,
    UNSIGNED,
    AuthResult,
    ClientKeys,
    InMemoryReplayGuard,
    replay_ttl_s,
    sign,
    verify,
)
from pipeline.validate import Rejection

KEY = bytes(range(32))
OTHER_KEY = bytes(range(1, 33))
CLIENT = "pos-eu-1"
KEYS = ClientKeys({CLIENT: KEY})
NOW = 1_700_000_000.0
NOW_MS = 1_700_000_000_000
WINDOW = 300.0
VALUE = b'{"transaction_id":"t-1","user_id":"u-1","amount":12.5}'


def signed(value: bytes = VALUE, *, at_ms: int = NOW_MS, key: bytes = KEY) -> dict[str, bytes]:
    return sign(value, CLIENT, key, at_ms)


def rejected(result: AuthResult | Rejection) -> Rejection:
    assert isinstance(result, Rejection), result
    assert result.code in AUTH_CODES
    # An auth failure must not become a decision for somebody's transaction id.
    assert result.transaction_id is None and result.user_id is None
    assert KEY.hex() not in result.reason
    return result


# --- sign / verify ------------------------------------------------------------


def test_signature_is_hmac_sha256_of_signed_at_dot_value_byte_exact() -> None:
    headers = sign(b'{"a":1}', CLIENT, KEY, NOW_MS)
    assert headers == {
        "client-id": b"pos-eu-1",
        "signed-at": b"1700000000000",
        "signature": hmac.new(KEY, b'1700000000000.{"a":1}', hashlib.sha256).hexdigest().encode(),
    }
    # Pinned, so the wire format cannot drift without this test noticing.
    assert headers["signature"] == b"2de65ea659b6298da49ee1776aac0233a170be908d39fae855d38fffc5c29f98"


def test_round_trip() -> None:
    headers = signed()
    assert verify(VALUE, headers, KEYS, NOW, WINDOW) == AuthResult(
        CLIENT, headers["signature"].decode(), NOW_MS
    )


@pytest.mark.parametrize(
    "tamper",
    [
        pytest.param(lambda v, h: (v.replace(b"12.5", b"99.5"), h), id="value"),
        pytest.param(lambda v, h: (v + b" ", h), id="value-appended"),
        pytest.param(lambda v, h: (v, {**h, "signed-at": str(NOW_MS + 1).encode()}), id="signed-at"),
        pytest.param(lambda v, h: (v, signed(v, key=OTHER_KEY)), id="other-key"),
    ],
)
def test_tampering_is_a_bad_signature(
    tamper: Callable[[bytes, dict[str, bytes]], tuple[bytes, dict[str, bytes]]],
) -> None:
    value, headers = tamper(VALUE, signed())
    why = rejected(verify(value, headers, KEYS, NOW, WINDOW))
    assert (why.code, why.field) == ("bad_signature", "signature")


def test_signature_must_be_lowercase_hex() -> None:
    headers = signed()
    headers["signature"] = headers["signature"].upper()
    why = rejected(verify(VALUE, headers, KEYS, NOW, WINDOW))
    assert why.code == "bad_signature" and "lowercase hex" in why.reason


def test_unknown_client_is_unauthenticated() -> None:
    headers = {**signed(), "client-id": b"pos-xx-9"}
    why = rejected(verify(VALUE, headers, KEYS, NOW, WINDOW))
    assert (why.code, why.field) == ("unauthenticated", "client-id")
    assert "pos-xx-9" in why.reason


@pytest.mark.parametrize("header", ["client-id", "signed-at", "signature"])
@pytest.mark.parametrize("empty", [False, True])
def test_missing_header_is_unauthenticated_and_named(header: str, empty: bool) -> None:
    headers = signed()
    if empty:
        headers[header] = b""
    else:
        del headers[header]
    why = rejected(verify(VALUE, headers, KEYS, NOW, WINDOW))
    assert (why.code, why.field) == ("unauthenticated", header)
    assert header in why.reason


@pytest.mark.parametrize("signed_at", [b"1.7e12", b"-5", b" 1700000000000", b"1" * 16])
def test_unreadable_signed_at_is_unauthenticated(signed_at: bytes) -> None:
    headers = {**signed(), "signed-at": signed_at}
    why = rejected(verify(VALUE, headers, KEYS, NOW, WINDOW))
    assert (why.code, why.field) == ("unauthenticated", "signed-at")


@pytest.mark.parametrize(
    ("offset_s", "words"), [(-301, "s ago"), (301, "in the future"), (-86_400, "86,400 s ago")]
)
def test_outside_the_window_is_stale(offset_s: int, words: str) -> None:
    headers = signed(at_ms=NOW_MS + offset_s * 1000)
    why = rejected(verify(VALUE, headers, KEYS, NOW, WINDOW))
    assert (why.code, why.field) == ("stale_signature", "signed-at")
    assert words in why.reason


@pytest.mark.parametrize("offset_s", [-300, 0, 300])
def test_inside_the_window_edges_included(offset_s: int) -> None:
    assert isinstance(verify(VALUE, signed(at_ms=NOW_MS + offset_s * 1000), KEYS, NOW, WINDOW), AuthResult)


def test_signature_is_checked_before_the_window() -> None:
    # Only authentic messages are told their clock is off.
    headers = signed(VALUE + b"x", at_ms=NOW_MS - 3_600_000)
    assert rejected(verify(VALUE, headers, KEYS, NOW, WINDOW)).code == "bad_signature"


def test_unsigned_is_refused_by_default_and_allowed_only_when_asked() -> None:
    assert rejected(verify(VALUE, {}, KEYS, NOW, WINDOW)).code == "unauthenticated"
    assert verify(VALUE, {}, KEYS, NOW, WINDOW, allow_unsigned=True) is UNSIGNED
    assert verify(VALUE, {"correlation-id": b"c"}, KEYS, NOW, WINDOW, allow_unsigned=True) is UNSIGNED
    assert not UNSIGNED.signed


def test_allow_unsigned_still_verifies_what_claims_to_be_signed() -> None:
    partial = {"client-id": CLIENT.encode()}
    assert rejected(verify(VALUE, partial, KEYS, NOW, WINDOW, allow_unsigned=True)).field == "signed-at"
    forged = {**signed(), "signature": b"0" * 64}
    assert rejected(verify(VALUE, forged, KEYS, NOW, WINDOW, allow_unsigned=True)).code == "bad_signature"


def test_sign_refuses_negative_time() -> None:
    with pytest.raises(ValueError):
        sign(VALUE, CLIENT, KEY, -1)


# --- client keys ----------------------------------------------------------------


def _secret_forms(key: bytes) -> list[str]:
    return [key.hex(), key.hex().upper(), base64.b64encode(key).decode(), repr(key), str(key)]


def test_keys_never_appear_in_repr_or_str() -> None:
    keys = ClientKeys({"pos-eu-1": KEY, "pos-us-2": OTHER_KEY})
    for text in (repr(keys), str(keys), f"{keys}", repr([keys])):
        assert "pos-eu-1" in text and "pos-us-2" in text
        for secret in _secret_forms(KEY) + _secret_forms(OTHER_KEY):
            assert secret not in text


def test_keys_file_hex_base64_and_forced_prefixes(tmp_path: Path) -> None:
    path = tmp_path / "keys.json"
    clients = {
        "hex": KEY.hex(),
        "b64": base64.b64encode(KEY).decode(),
        "b64url-unpadded": base64.urlsafe_b64encode(b"\xfb" * 20).decode().rstrip("="),
        "forced": "base64:" + base64.b64encode(bytes.fromhex("00" * 24)).decode(),
        "forced-hex": "hex:" + OTHER_KEY.hex(),
    }
    path.write_bytes(orjson.dumps({"clients": clients}))
    keys = ClientKeys.from_file(path)
    assert dict(keys) == {
        "hex": KEY,
        "b64": KEY,
        "b64url-unpadded": b"\xfb" * 20,
        "forced": b"\x00" * 24,
        "forced-hex": OTHER_KEY,
    }


def test_env_spec_and_load_together(tmp_path: Path) -> None:
    path = tmp_path / "keys.json"
    path.write_bytes(orjson.dumps({"clients": {"file-client": KEY.hex()}}))
    spec = f" env-a:{KEY.hex()} , env-b:{base64.b64encode(OTHER_KEY).decode()},"
    assert dict(ClientKeys.parse(spec)) == {"env-a": KEY, "env-b": OTHER_KEY}
    keys = ClientKeys.load(path, spec)
    assert sorted(keys) == ["env-a", "env-b", "file-client"]
    assert dict(ClientKeys.load(None, None)) == {}


@pytest.mark.parametrize(
    ("spec", "words"),
    [
        (f"a:{KEY.hex()},a:{KEY.hex()}", "listed twice"),
        (f"{KEY.hex()}", "entry 1"),
        ("exactly-16-bytes:" + "ab" * 16, None),
        ("short:abcd", "at least 16"),
        ("bad:" + "!" * 40, "not valid base64"),
        ("bad:hex:" + "zz" * 20, "not valid hex"),
        (f"unsigned:{KEY.hex()}", "reserved"),
    ],
)
def test_bad_key_specs_are_config_errors_that_show_no_key(spec: str, words: str | None) -> None:
    if words is None:  # exactly 16 bytes is enough
        assert len(ClientKeys.parse(spec)) == 1
        return
    with pytest.raises(ConfigError) as caught:
        ClientKeys.parse(spec)
    assert words in str(caught.value)
    secret = spec.rsplit(":", 1)[-1]
    assert secret not in str(caught.value)


def test_an_id_in_both_sources_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "keys.json"
    path.write_bytes(orjson.dumps({"clients": {"pos-eu-1": KEY.hex()}}))
    with pytest.raises(ConfigError, match="both"):
        ClientKeys.load(path, f"pos-eu-1:{KEY.hex()}")


@pytest.mark.parametrize(
    "content",
    [b'{"clients": {"a": "' + KEY.hex().encode() + b'"', b"[]", b'{"clients": ["a"]}', b'{"clients": {"a": 5}}'],
)
def test_bad_keys_file_is_a_config_error_that_shows_no_key(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "keys.json"
    path.write_bytes(content)
    with pytest.raises(ConfigError) as caught:
        ClientKeys.from_file(path)
    assert str(path) in str(caught.value)
    assert KEY.hex() not in str(caught.value)
    # NOTE: a JSON error holds the whole document: it must not ride along as the cause.
    assert caught.value.__cause__ is None
    assert caught.value.__context__ is None or caught.value.__suppress_context__


def test_missing_keys_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="keys file"):
        ClientKeys.from_file(tmp_path / "absent.json")


# --- replay -----------------------------------------------------------------------


class FakeClock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


SIG_A, SIG_B = "a" * 64, "b" * 64


def test_signature_key_byte_exact() -> None:
    assert signature_key(SIG_A) == "fp:sig:" + "a" * 64


def test_replay_ttl_covers_both_sides_of_the_window() -> None:
    assert replay_ttl_s(300) == 601
    assert replay_ttl_s(0.4) == 2


def test_replay_rule_in_memory() -> None:
    guard = InMemoryReplayGuard(clock=FakeClock())

    async def scenario() -> None:
        assert await guard.check([], 60) == []
        assert await guard.check([(SIG_A, "0:10")], 60) == [True]  # first sight
        assert await guard.check([(SIG_A, "0:10")], 60) == [True]  # the same record redelivered
        assert await guard.check([(SIG_A, "3:77")], 60) == [False]  # another record: a replay
        assert await guard.check([(SIG_A, "3:77")], 60) == [False]  # ...and stays one
        assert await guard.check([(SIG_B, "0:11")], 60) == [True]  # signatures are independent

    asyncio.run(scenario())


def test_a_copy_later_in_the_same_batch_is_a_replay() -> None:
    guard = InMemoryReplayGuard(clock=FakeClock())
    items = [(SIG_A, "0:1"), (SIG_A, "0:2"), (SIG_B, "0:3"), (SIG_A, "0:1")]
    assert asyncio.run(guard.check(items, 60)) == [True, False, True, True]


def test_signatures_are_forgotten_after_the_ttl() -> None:
    clock = FakeClock()
    guard = InMemoryReplayGuard(clock=clock)
    assert asyncio.run(guard.check([(SIG_A, "0:1")], 60)) == [True]
    clock.now += 60
    assert asyncio.run(guard.check([(SIG_A, "0:2")], 60)) == [False]
    clock.now += 1
    assert asyncio.run(guard.check([(SIG_A, "0:2")], 60)) == [True]
