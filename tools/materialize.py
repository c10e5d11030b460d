"""Write batch-computed features to the Redis online store.

Profiles and merchant risk are built by the same functions training uses
(:mod:`pipeline.features`) as of one time, and written as one hash per user and
per merchant, each carrying the feature-set version and ``as_of``, with a TTL.
The last 24 h of transactions seed each user's velocity sorted set, so the
first live transactions see the same velocity training saw. Everything is
written with overwrite semantics (HSET of a fixed field set, ZADD by
transaction id): re-running is idempotent.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import pandas as pd
import redis
from tqdm import tqdm

from app.redis_keys import MATERIALIZE_META_KEY, merchant_key, profile_key, velocity_key
from pipeline.feature_store import VELOCITY_RETENTION_S, velocity_member
from pipeline.features import (
    DAY_S,
    FEATURE_SET_VERSION,
    build_merchant_risk,
    build_user_profiles,
    history_transactions,
    prepare_history,
)

__all__ = ["MaterializeResult", "materialize"]

CHUNK = 1000
T = TypeVar("T")


@dataclass(frozen=True)
class MaterializeResult:
    as_of: float
    users: int
    merchants: int
    velocity_events: int


def materialize(
    df: pd.DataFrame,
    client: redis.Redis,
    *,
    as_of: float | None = None,
    ttl_s: int = 8 * 86400,
    progress: bool = True,
) -> MaterializeResult:
    """Compute features as of ``as_of`` (default: the day after the last
    transaction's day starts, i.e. the nightly run after the data) and write them."""
    history = prepare_history(df)
    if as_of is None:
        as_of = math.ceil(history["ts"].max() / DAY_S) * DAY_S
    profiles = build_user_profiles(history, as_of)
    merchants = build_merchant_risk(history, as_of)
    recent = history[(history["ts"] >= as_of - DAY_S) & (history["ts"] < as_of)]

    # Fields typed Any: redis-py's hset declares its fields as a union of types,
    # and a mapping's key type is invariant, so str fields alone would not fit.
    writes: list[tuple[str, Mapping[Any, str]]] = [
        (profile_key(user), profile.to_mapping()) for user, profile in profiles.items()
    ]
    writes += [(merchant_key(m), risk.to_mapping()) for m, risk in merchants.items()]
    bar = tqdm(total=len(writes) + len(recent), desc="materialize", unit="key", disable=not progress)
    for chunk in _chunks(writes, CHUNK):
        pipe = client.pipeline(transaction=False)
        for key, mapping in chunk:
            pipe.hset(key, mapping=mapping)
            pipe.expire(key, ttl_s)
        pipe.execute()
        bar.update(len(chunk))
    for txs in _chunks(history_transactions(recent), CHUNK):
        pipe = client.pipeline(transaction=False)
        for tx in txs:
            key = velocity_key(tx.user_id)
            # Same member format as the live path: live and seeded events dedupe.
            pipe.zadd(key, {velocity_member(tx): tx.timestamp})
            pipe.expire(key, int(VELOCITY_RETENTION_S))
        pipe.execute()
        bar.update(len(txs))
    bar.close()
    client.hset(
        MATERIALIZE_META_KEY,
        mapping={
            "feature_set": FEATURE_SET_VERSION,
            "as_of": repr(as_of),
            "users": str(len(profiles)),
            "merchants": str(len(merchants)),
        },
    )
    return MaterializeResult(as_of, len(profiles), len(merchants), len(recent))


def _chunks(items: Iterable[T], size: int) -> Iterator[list[T]]:
    chunk: list[Any] = []
    for item in items:
        chunk.append(item)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk
