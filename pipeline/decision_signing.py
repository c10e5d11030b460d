"""Decision signatures: Ed25519 over a decision record's exact value bytes.

Producers authenticate transactions to the workers (:mod:`pipeline.auth`,
HMAC); this is the other direction. Whoever can write to ``decisions`` could
otherwise forge an ``approve`` for a real transaction id. Each decision record
carries, in its Kafka headers:

=======================  ==========================================================
``decision-key-id``      the signing key's id: the first 16 hex digits of
                         SHA-256 over the raw 32-byte public key
``decision-signature``   standard base64 of the 64-byte Ed25519 signature of the
                         record's value, byte for byte as produced
=======================  ==========================================================

The signature covers the value alone: key, partition and timestamp are not
signed. A decision names its transaction id inside the value, so a genuine
decision copied to another key still decides only its own transaction.

Keys: a worker signs with one private key (:class:`DecisionSigner`, a PEM
PKCS#8 file or a raw 32-byte seed in hex or base64); consumers verify against a
*set* of public keys (:class:`DecisionVerifier`, the public keys file, the
gateway's ``GET /v1/keys``). Rotation: publish the new public key next to the
old one, move the workers to the new private key, and retire the old public
key once no decision it signed is still read (the topic's retention).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import os
import re
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import orjson
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from app.errors import ConfigError
from app.settings import Settings
from pipeline.auth import key_bytes, read_key_file

__all__ = [
    "KEY_ID",
    "SIGNATURE",
    "DecisionSigner",
    "DecisionVerifier",
    "Unverified",
    "headers_of",
    "signer_from_settings",
    "verifier_from_settings",
    "key_id_of",
    "public_key_text",
    "write_private_key",
    "write_public_keys",
]

KEY_ID = "decision-key-id"
SIGNATURE = "decision-signature"

_KEY_ID_RE = re.compile(r"[0-9a-f]{16}")


def _raw_public(public: Ed25519PublicKey) -> bytes:
    return public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def key_id_of(public: Ed25519PublicKey) -> str:
    """A public key's id: 16 hex digits of SHA-256 over its raw bytes."""
    return hashlib.sha256(_raw_public(public)).hexdigest()[:16]


def public_key_text(public: Ed25519PublicKey) -> str:
    """The raw 32-byte public key, standard base64 (the public keys file's form)."""
    return base64.b64encode(_raw_public(public)).decode()


class DecisionSigner:
    """Signs decision values with one Ed25519 private key. Its repr shows the key id only."""

    __slots__ = ("_key", "_public", "key_id", "_key_id_bytes")

    def __init__(self, key: Ed25519PrivateKey) -> None:
        self._key = key
        self._public = key.public_key()
        self.key_id = key_id_of(self._public)
        self._key_id_bytes = self.key_id.encode()

    @classmethod
    def generate(cls) -> DecisionSigner:
        return cls(Ed25519PrivateKey.generate())

    @classmethod
    def from_bytes(cls, data: bytes, source: str) -> DecisionSigner:
        """A PEM (PKCS#8) private key, or a raw 32-byte seed in hex or base64."""
        text = data.strip()
        if text.startswith(b"-----BEGIN"):
            try:
                key = serialization.load_pem_private_key(text, password=None)
            except (ValueError, TypeError):
                raise ConfigError(f"{source}: not a readable unencrypted PEM private key") from None
            if not isinstance(key, Ed25519PrivateKey):
                raise ConfigError(f"{source}: the PEM key is not an Ed25519 key")
            return cls(key)
        seed = _decode(text.decode("ascii", "replace"), source, "private key")
        if len(seed) != 32:
            raise ConfigError(f"{source}: a raw Ed25519 private key is 32 bytes, got {len(seed)}")
        return cls(Ed25519PrivateKey.from_private_bytes(seed))

    @classmethod
    def from_file(cls, path: Path) -> DecisionSigner:
        try:
            data = Path(path).read_bytes()
        except OSError as exc:
            raise ConfigError(f"decision signing key {path}: {exc.strerror}") from None
        return cls.from_bytes(data, f"decision signing key {path}")

    @property
    def public_key(self) -> Ed25519PublicKey:
        return self._public

    def sign(self, value: bytes) -> bytes:
        """The raw 64-byte signature of ``value``."""
        return self._key.sign(value)

    def headers(self, value: bytes) -> list[tuple[str, bytes]]:
        """The headers that sign ``value`` (one Ed25519 signature)."""
        return [(KEY_ID, self._key_id_bytes), (SIGNATURE, base64.b64encode(self._key.sign(value)))]

    def __repr__(self) -> str:
        return f"DecisionSigner(key_id={self.key_id!r})"

    __str__ = __repr__


@dataclass(frozen=True, slots=True)
class Unverified:
    """Why a decision record was refused: ``code`` is ``unsigned``, ``unknown_key`` or ``bad_signature``."""

    code: str
    detail: str


class DecisionVerifier(Mapping[str, Ed25519PublicKey]):
    """Key id -> public key: every key whose decisions are accepted (two during a rotation)."""

    __slots__ = ("_keys",)

    def __init__(self, keys: Iterable[Ed25519PublicKey] = ()) -> None:
        self._keys = {key_id_of(k): k for k in keys}

    @classmethod
    def from_file(cls, path: Path) -> DecisionVerifier:
        """Read ``{"keys": [{"key_id": "...", "public_key": "<base64 raw 32 bytes>"}, ...]}``."""
        doc = read_key_file(path, "decision public keys file")
        entries = doc.get("keys") if isinstance(doc, dict) else None
        if not isinstance(entries, list):
            raise ConfigError(f'decision public keys file {path}: expected {{"keys": [{{"key_id": ..., "public_key": ...}}]}}')
        keys = []
        for i, entry in enumerate(entries, 1):
            source = f"decision public keys file {path}, key {i}"
            if not isinstance(entry, dict) or not isinstance(entry.get("public_key"), str):
                raise ConfigError(f"{source}: expected an object with a 'public_key' string")
            raw = _decode(entry["public_key"], source, "public key")
            if len(raw) != 32:
                raise ConfigError(f"{source}: a raw Ed25519 public key is 32 bytes, got {len(raw)}")
            key = Ed25519PublicKey.from_public_bytes(raw)
            stated = entry.get("key_id")
            if stated is not None and stated != key_id_of(key):
                raise ConfigError(f"{source}: key_id {stated!r:.40} is not the id of its public key ({key_id_of(key)})")
            keys.append(key)
        return cls(keys)

    def published(self) -> list[dict[str, str]]:
        """The keys as ``GET /v1/keys`` and the public keys file list them."""
        return [{"key_id": kid, "public_key": public_key_text(k)} for kid, k in sorted(self._keys.items())]

    def verify(self, value: bytes, headers: Mapping[str, bytes]) -> str | Unverified:
        """The signing key's id when ``value`` carries a valid signature by a known key."""
        kid, sig = headers.get(KEY_ID), headers.get(SIGNATURE)
        if not kid or not sig:
            return Unverified("unsigned", f"the {KEY_ID!r} or {SIGNATURE!r} header is missing")
        key_id = kid.decode("ascii", "replace")
        key = self._keys.get(key_id) if _KEY_ID_RE.fullmatch(key_id) else None
        if key is None:
            return Unverified("unknown_key", f"no published key has id {key_id[:32]!r}")
        try:
            raw = base64.b64decode(sig, validate=True)
        except (ValueError, binascii.Error):
            return Unverified("bad_signature", f"{SIGNATURE!r} is not base64")
        try:
            key.verify(raw, value)
        except InvalidSignature:
            return Unverified("bad_signature", f"the signature does not match the value under key {key_id}")
        return key_id

    def __getitem__(self, key_id: str) -> Ed25519PublicKey:
        return self._keys[key_id]

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)

    def __repr__(self) -> str:
        return f"DecisionVerifier({sorted(self._keys)!r})"


def headers_of(record_headers: Iterable[tuple[str, bytes | None]] | None) -> dict[str, bytes]:
    """A Kafka record's header list as a dict (the last value of a repeated name wins)."""
    return {name: value for name, value in (record_headers or ()) if value is not None}


def _decode(text: str, source: str, what: str) -> bytes:
    try:
        return key_bytes(text)
    except ValueError as exc:
        raise ConfigError(f"{source}: the {what} is {exc}") from None


def signer_from_settings(settings: Settings) -> DecisionSigner | None:
    """The worker's signing key: ``decision_signing_key_file`` or ``decision_signing_key``; None when neither is set."""
    if settings.decision_signing_key_file is not None and settings.decision_signing_key is not None:
        raise ConfigError("set FRAUD_DECISION_SIGNING_KEY_FILE or FRAUD_DECISION_SIGNING_KEY, not both")
    if settings.decision_signing_key_file is not None:
        return DecisionSigner.from_file(settings.decision_signing_key_file)
    if settings.decision_signing_key is not None:
        secret = settings.decision_signing_key.get_secret_value().encode()
        return DecisionSigner.from_bytes(secret, "FRAUD_DECISION_SIGNING_KEY")
    return None


def verifier_from_settings(settings: Settings) -> DecisionVerifier:
    """The keys of ``decision_public_keys_file`` and ``decision_public_keys`` (empty when neither is set)."""
    keys = list(DecisionVerifier.from_file(settings.decision_public_keys_file).values()) if (
        settings.decision_public_keys_file is not None) else []  # fmt: skip
    for i, text in enumerate(filter(None, (t.strip() for t in (settings.decision_public_keys or "").split(","))), 1):
        raw = _decode(text, f"FRAUD_DECISION_PUBLIC_KEYS, key {i}", "public key")
        if len(raw) != 32:
            raise ConfigError(f"FRAUD_DECISION_PUBLIC_KEYS, key {i}: a raw Ed25519 public key is 32 bytes, got {len(raw)}")
        keys.append(Ed25519PublicKey.from_public_bytes(raw))
    return DecisionVerifier(keys)


# --- files (written by `fraud-pipeline decision-key`) -------------------------------------------


def write_private_key(signer: DecisionSigner, path: Path) -> None:
    """Write the signer's key as PKCS#8 PEM, created 0600."""
    pem = signer._key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(pem)


def write_public_keys(verifier: DecisionVerifier, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(orjson.dumps({"keys": verifier.published()}, option=orjson.OPT_INDENT_2) + b"\n")
