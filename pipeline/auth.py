"""Producer authentication: HMAC-SHA256 signed messages and replay protection.

Each producing client has an id and a secret key. A signed message carries:

=============  ==============================================================
``client-id``  the producing client's id
``signed-at``  when it was signed: epoch milliseconds as ASCII digits
``signature``  lowercase hex HMAC-SHA256, under the client's key, of
               ``signed-at + b"." + value``
=============  ==============================================================

:func:`sign` builds these headers; :func:`verify` is pure (keys and clock are
arguments) and returns an :class:`AuthResult` or a
:class:`~pipeline.validate.Rejection` with one of these codes:

=====================  ======================================================
``unauthenticated``    a header is missing or unreadable, or the client is
                       unknown; ``field`` names the header
``bad_signature``      the signature does not match the value and timestamp
``stale_signature``    authentic, but signed outside ``±window_s`` of now
``replayed``           decided by the caller with a :class:`ReplayGuard`
=====================  ======================================================

The signature is checked before the time window, so "your clock is off" is
only ever said about authentic messages. Auth rejections carry no
``transaction_id``: an unauthenticated message's ids are not to be trusted, and
a stale or replayed one belongs to a payment decided on its own; a ``reject``
decision keyed by that id would let whoever can write to the topic overwrite
a real payment's decision. The caller dead-letters them.

Replay rule
-----------
The signature binds the value, so one signature always means the same bytes:
a replay and a Kafka redelivery of one message carry the same transaction id
and content. What tells them apart is the *record*: a redelivery (a crash
before the offset commit, a rebalance) re-reads the same partition and offset;
a replay is a new record. :meth:`ReplayGuard.check` therefore takes
``(signature, delivery)`` pairs, ``delivery`` being the record's position
(``f"{partition}:{offset}"``), and stores ``fp:sig:<signature> = delivery`` the
first time it sees the signature (atomically, across workers). It answers True
for a new signature or for the same delivery again, False for the same
signature from another record. (Storing the transaction id instead could never
say False: the signed value holds the transaction id.)

The caller consults it only for messages the decision cache missed: a copy of
a decided message gets the cached decision again, which is harmless (nothing
is counted twice) and is what any resend gets. The guard covers what the cache
cannot: a copy arriving while the original is in flight, or while the cache is
down or has lost the entry. Entries need only outlive the acceptance window
(:func:`replay_ttl_s`); past it :func:`verify` says ``stale_signature``.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import math
import re
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import orjson

from app.errors import ConfigError
from app.redis_keys import signature_key
from pipeline.feature_store import TTLCache
from pipeline.validate import Rejection

__all__ = [
    "AUTH_CODES",
    "CLIENT_ID",
    "SIGNATURE",
    "SIGNED_AT",
    "REPLAY_CHECK_FUNCTION",
    "REPLAY_CHECK_SCRIPT",
    "UNSIGNED",
    "AuthResult",
    "ClientKeys",
    "InMemoryReplayGuard",
    "RedisReplayGuard",
    "ReplayGuard",
    "first_delivery",
    "replay_ttl_s",
    "sign",
    "verify",
]

CLIENT_ID = "client-id"
SIGNED_AT = "signed-at"
SIGNATURE = "signature"
AUTH_CODES: tuple[str, ...] = ("unauthenticated", "bad_signature", "stale_signature", "replayed")

#: HMAC keys shorter than this are refused when loaded (128 bits).
MIN_KEY_BYTES = 16
_UNSIGNED_ID = "unsigned"
_SIGNED_AT_RE = re.compile(rb"[0-9]{1,15}")  # 15 digits of ms reach the year 33658
_SIGNATURE_RE = re.compile(rb"[0-9a-f]{64}")
_HEX_RE = re.compile(r"(?:[0-9a-fA-F]{2})+")


@dataclass(frozen=True, slots=True)
class AuthResult:
    """Who sent an authentic message. ``signature`` is None only for unsigned traffic."""

    client_id: str
    signature: str | None
    signed_at_ms: int | None

    @property
    def signed(self) -> bool:
        return self.signature is not None


#: What :func:`verify` returns for a message without any auth header when
#: ``allow_unsigned`` is on (development only). Its id is reserved.
UNSIGNED = AuthResult(_UNSIGNED_ID, None, None)


def sign(value: bytes, client_id: str, key: bytes, now_ms: int) -> dict[str, bytes]:
    """The headers that authenticate ``value`` as sent by ``client_id`` at ``now_ms``."""
    if now_ms < 0:
        raise ValueError(f"now_ms must be epoch milliseconds, got {now_ms}")
    signed_at = str(now_ms).encode()
    return {CLIENT_ID: client_id.encode(), SIGNED_AT: signed_at, SIGNATURE: _mac(key, signed_at, value)}


def verify(
    value: bytes,
    headers: Mapping[str, bytes],
    keys: Mapping[str, bytes],
    now: float,
    window_s: float,
    *,
    allow_unsigned: bool = False,
) -> AuthResult | Rejection:
    """Check a message's auth headers. ``now`` is epoch seconds.

    With ``allow_unsigned`` a message with *no* auth header passes as
    :data:`UNSIGNED`; one that carries any of them must still verify.
    """
    present = [name for name in (CLIENT_ID, SIGNED_AT, SIGNATURE) if headers.get(name)]
    if allow_unsigned and not present:
        return UNSIGNED
    for name in (CLIENT_ID, SIGNED_AT, SIGNATURE):
        if name not in present:
            return Rejection("unauthenticated", name, f"the {name!r} header is missing or empty")
    client_id = headers[CLIENT_ID].decode("utf-8", "replace")
    key = keys.get(client_id)
    if key is None:
        return Rejection("unauthenticated", CLIENT_ID, f"unknown client {_shown(client_id)}")
    signed_at, signature = headers[SIGNED_AT], headers[SIGNATURE]
    if not _SIGNED_AT_RE.fullmatch(signed_at):
        return Rejection("unauthenticated", SIGNED_AT, f"{SIGNED_AT!r} must be epoch milliseconds in ASCII digits")
    if not _SIGNATURE_RE.fullmatch(signature):
        return Rejection("bad_signature", SIGNATURE, f"{SIGNATURE!r} must be 64 lowercase hex digits")
    # Constant time: a byte-by-byte compare would let a forger learn the MAC a prefix at a time.
    if not hmac.compare_digest(_mac(key, signed_at, value), signature):
        return Rejection(
            "bad_signature", SIGNATURE, f"signature does not match the value and {SIGNED_AT} for {_shown(client_id)}"
        )
    signed_at_ms = int(signed_at)
    age_s = now - signed_at_ms / 1000
    if abs(age_s) > window_s:
        when = f"{age_s:,.0f} s ago" if age_s > 0 else f"{-age_s:,.0f} s in the future"
        return Rejection("stale_signature", SIGNED_AT, f"signed {when}; the window is ±{window_s:,.0f} s")
    return AuthResult(client_id, signature.decode(), signed_at_ms)


def _mac(key: bytes, signed_at: bytes, value: bytes) -> bytes:
    mac = hmac.new(key, signed_at, hashlib.sha256)
    mac.update(b".")
    mac.update(value)  # update() rather than concatenation: no copy of a 64 KiB value
    return mac.hexdigest().encode()


def _shown(client_id: str) -> str:
    return repr(client_id[:64])


# --- keys ----------------------------------------------------------------------


class ClientKeys(Mapping[str, bytes]):
    """Client id -> HMAC key. Its repr lists the ids only, never a key.

    Keys are written as hex or base64 (standard or URL-safe, padding optional):
    text made only of hex digit pairs reads as hex, anything else as base64; a
    ``hex:`` or ``base64:`` prefix forces the reading.
    """

    __slots__ = ("_keys",)

    def __init__(self, keys: Mapping[str, bytes] | None = None) -> None:
        self._keys: dict[str, bytes] = {}
        for client_id, key in (keys or {}).items():
            _check_client(client_id, key)
            self._keys[client_id] = bytes(key)

    @classmethod
    def from_file(cls, path: Path) -> ClientKeys:
        """Read ``{"clients": {"<id>": "<hex or base64 key>", ...}}``."""
        doc = read_key_file(path, "client keys file")
        clients = doc.get("clients") if isinstance(doc, dict) else None
        if not isinstance(clients, dict):
            raise ConfigError(f'client keys file {path}: expected {{"clients": {{"<id>": "<key>", ...}}}}')
        return cls({client_id: _decode_key(client_id, text, str(path)) for client_id, text in clients.items()})

    @classmethod
    def parse(cls, spec: str, source: str = "FRAUD_CLIENT_KEYS") -> ClientKeys:
        """Read ``"id1:key1,id2:key2"`` (the form of an environment variable)."""
        keys: dict[str, bytes] = {}
        for entry in filter(None, (part.strip() for part in spec.split(","))):
            client_id, sep, text = entry.partition(":")
            client_id = client_id.strip()
            if not sep or not client_id:
                raise ConfigError(f"{source}: entry {len(keys) + 1} is not '<client id>:<key>'")
            if client_id in keys:
                raise ConfigError(f"{source}: client {_shown(client_id)} is listed twice")
            keys[client_id] = _decode_key(client_id, text, source)
        return cls(keys)

    @classmethod
    def load(cls, path: Path | None = None, spec: str | None = None) -> ClientKeys:
        """The keys of a keys file and of an env var spec together; an id may be in one only."""
        from_file = cls.from_file(path) if path is not None else cls()
        from_env = cls.parse(spec) if spec else cls()
        both = sorted(set(from_file) & set(from_env))
        if both:
            raise ConfigError(f"client {_shown(both[0])} has a key in both {path} and FRAUD_CLIENT_KEYS")
        return cls({**from_file, **from_env})

    def __getitem__(self, client_id: str) -> bytes:
        return self._keys[client_id]

    def __iter__(self) -> Iterator[str]:
        return iter(self._keys)

    def __len__(self) -> int:
        return len(self._keys)

    def __repr__(self) -> str:
        return f"ClientKeys({sorted(self._keys)!r})"

    __str__ = __repr__


def _check_client(client_id: object, key: object) -> None:
    if not isinstance(client_id, str) or not client_id or len(client_id) > 128 or not client_id.isprintable():
        raise ConfigError(f"client id {client_id!r:.70} must be 1-128 printable characters")
    if client_id == _UNSIGNED_ID:
        raise ConfigError(f"client id {_UNSIGNED_ID!r} is reserved for unsigned development traffic")
    if not isinstance(key, (bytes, bytearray)) or len(key) < MIN_KEY_BYTES:
        size = len(key) if isinstance(key, (bytes, bytearray)) else 0
        raise ConfigError(f"client {_shown(client_id)}: key is {size} bytes; at least {MIN_KEY_BYTES} are needed")


def _decode_key(client_id: object, text: object, source: str) -> bytes:
    # Error messages name the client and the source, never the key text.
    if not isinstance(text, str):
        raise ConfigError(f"{source}: the key of client {client_id!r:.70} must be a string")
    try:
        return key_bytes(text)
    except ValueError as exc:
        raise ConfigError(f"{source}: the key of client {client_id!r:.70} is {exc}") from None


def key_bytes(text: str) -> bytes:
    """Key text as bytes: hex when made only of hex digit pairs, else base64
    (standard or URL-safe, padding optional); a ``hex:`` or ``base64:`` prefix
    forces the reading. Raises ValueError naming the reading, never the text.
    Shared by producer keys and the decision-signing keys."""
    text = text.strip()
    kind, sep, rest = text.partition(":")
    if not sep or kind not in ("hex", "base64"):
        kind, rest = ("hex" if _HEX_RE.fullmatch(text) else "base64"), text
    try:
        if kind == "hex":
            return bytes.fromhex(rest)
        padded = rest.replace("-", "+").replace("_", "/") + "=" * (-len(rest) % 4)
        return base64.b64decode(padded, validate=True)
    except (ValueError, binascii.Error):
        raise ValueError(f"not valid {kind}") from None


def read_key_file(path: Path, what: str) -> Any:
    """A JSON document of keys; errors name ``what`` and the file, never its content."""
    try:
        return orjson.loads(Path(path).read_bytes())
    except OSError as exc:
        raise ConfigError(f"{what} {path}: {exc.strerror}") from None
    except orjson.JSONDecodeError as exc:
        # NOTE: `from None`: the exception holds the whole document, keys included.
        raise ConfigError(f"{what} {path}: not valid JSON (line {exc.lineno})") from None


# --- replay protection ------------------------------------------------------------


def replay_ttl_s(window_s: float) -> int:
    """How long to remember a signature: one signed at the window's future edge
    is accepted until it falls off the past edge, 2 x window later."""
    return math.ceil(2 * window_s) + 1


class ReplayGuard(Protocol):
    async def check(self, items: Sequence[tuple[str, str]], ttl_s: int) -> list[bool]:
        """For each ``(signature, delivery)``: True when the signature is new
        (it is then recorded with this delivery, for ``ttl_s``) or was first
        seen on this same delivery (a redelivery); False for a replay.
        Items are decided in order, so a copy later in the batch is a replay."""
        ...


#: The replay check of a whole batch in one command (one Redis server): for each
#: signature key, SET it to its delivery if new, else return the delivery it was
#: first seen on ('' when new: a nil would end a Lua array). On a Redis Cluster
#: the keys span slots, so the guard pipelines one SET per signature instead.
#: A Lua function of (KEYS, ARGV): the batch's one-call script
#: (pipeline/redis_batch.py) runs the same check on its signed transactions.
REPLAY_CHECK_FUNCTION = """
local function replay_check(KEYS, ARGV)
local out = {}
for i = 1, #KEYS do
  out[i] = redis.call('SET', KEYS[i], ARGV[i + 1], 'NX', 'GET', 'EX', ARGV[1]) or ''
end
return out
end
"""
REPLAY_CHECK_SCRIPT = REPLAY_CHECK_FUNCTION + "return replay_check(KEYS, ARGV)\n"


def first_delivery(first: bytes | str | None, delivery: str) -> bool:
    """The guard's answer from what ``SET NX GET`` returned for a signature: new
    (nothing, or '' from the script), or first seen on this same delivery."""
    return not first or _text(first) == delivery


class RedisReplayGuard:
    """Shared across workers; one pipelined round trip per batch.

    NOTE: uses ``SET NX GET``, which needs Redis >= 7.0.
    """

    def __init__(self, client: Any, *, cluster: bool = False) -> None:
        """``client`` is a ``redis.asyncio.Redis`` (the worker's shared pool), or
        a ``RedisCluster`` when ``cluster`` (decided once from settings by whoever
        builds the client: app.redis_client.is_cluster)."""
        self._client = client
        self._cluster = cluster
        self._check_many = client.register_script(REPLAY_CHECK_SCRIPT)

    @property
    def client(self) -> Any:
        """The Redis client it talks to (the batch's one call needs every part on one)."""
        return self._client

    async def check(self, items: Sequence[tuple[str, str]], ttl_s: int) -> list[bool]:
        if not items:
            return []
        if not self._cluster:
            firsts = await self._check_many(
                keys=[signature_key(signature) for signature, _ in items],
                args=[ttl_s, *(delivery for _, delivery in items)],
            )
            return [first_delivery(first, delivery) for first, (_, delivery) in zip(firsts, items, strict=True)]
        pipe = self._client.pipeline(transaction=False)
        for signature, delivery in items:
            # One atomic command: record the delivery if the signature is new,
            # else return the delivery it was first seen on.
            pipe.set(signature_key(signature), delivery, nx=True, ex=ttl_s, get=True)
        firsts = await pipe.execute()
        return [first_delivery(first, delivery) for first, (_, delivery) in zip(firsts, items, strict=True)]


class InMemoryReplayGuard:
    """The same rule in one process (tests, a single development worker).

    Bounded: past ``max_items`` the oldest signatures are forgotten early.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic, max_items: int = 100_000) -> None:
        self._clock = clock
        self._seen = TTLCache(ttl_s=0.0, max_items=max_items)

    async def check(self, items: Sequence[tuple[str, str]], ttl_s: int) -> list[bool]:
        now = self._clock()
        # TTLCache stamps an entry's expiry when it is put, so this ttl applies to this call's entries.
        self._seen.ttl_s = ttl_s
        out = []
        for signature, delivery in items:
            seen, first = self._seen.get(signature, now)
            if not seen:
                self._seen.put(signature, delivery, now)
            out.append(not seen or first == delivery)
        return out


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value
