"""Features, defined once for training and serving.

Three kinds of input feed one function, :func:`feature_row`:

* a **user profile** (:class:`UserProfile`), precomputed in batch as of a day
  boundary by :func:`build_user_profiles`: counts and mean/std of amounts over
  1/7/30 days, home location, known devices, first-seen time;
* **merchant risk** (:class:`MerchantRisk`), the fraud rate of the merchant's
  transactions over 1/7/30 days *ending a label delay ago* (labels arrive late;
  the Handbook uses 7 days), by :func:`build_merchant_risk`;
* **velocity** (:func:`velocity_from_events`): count and sum of the user's
  transactions in the last 10 min / 1 h / 24 h, *including* the current one.

Serving reads profiles and merchant risk from Redis (written by
``fraud-pipeline materialize`` with the same builders) and velocity events from a
per-user sorted set. Training (:func:`training_matrix`) rebuilds the profile as of
the start of each transaction's day and velocity from the transactions before it,
so a feature at time t never sees data after t, and the served and trained
vectors come from the same code.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, fields
from datetime import UTC, datetime, tzinfo
from typing import Any

import numpy as np
import pandas as pd

from app.contract import CURRENCY_TO_USD, Transaction
from pipeline.datafile import check_currencies, parse_labels, parse_timestamps
from pipeline.feature_defs import (
    DAY_S,
    FEATURE_NAMES,
    FEATURE_SET_VERSION,
    HOME_WINDOW_DAYS,
    MAX_KNOWN_DEVICES,
    MERCHANT_LABEL_DELAY_DAYS,
    PROFILE_WINDOWS_DAYS,
    VELOCITY_MAX_EVENTS,
    VELOCITY_WINDOWS_S,
)

__all__ = [
    "DAY_S",
    "FEATURE_NAMES",
    "FEATURE_REQUIRES",
    "FEATURE_SET_VERSION",
    "MERCHANT_LABEL_DELAY_DAYS",
    "MERCHANT_FIELDS",
    "MerchantRisk",
    "PROFILE_FIELDS",
    "UserProfile",
    "available_features",
    "build_merchant_risk",
    "build_user_profiles",
    "feature_matrix",
    "feature_row",
    "haversine_km",
    "prepare_history",
    "rowwise_matrix",
    "training_matrix",
    "utc_offset_s",
    "velocity_batch",
    "velocity_from_events",
]

#: Features that need optional transaction columns. Training on a file without
#: them drops these features; serving then never asks the model for them.
FEATURE_REQUIRES: dict[str, tuple[str, ...]] = {
    "distance_from_home_km": ("lat", "lon"),
    "new_device": ("device_id",),
}

NAN = float("nan")


@dataclass(frozen=True, slots=True)
class UserProfile:
    """A user's behaviour before ``as_of`` (epoch seconds, a day boundary)."""

    count_1d: int
    count_7d: int
    count_30d: int
    mean_1d: float
    mean_7d: float
    mean_30d: float
    std_30d: float
    home_lat: float
    home_lon: float
    devices: frozenset[str]
    first_seen: float
    as_of: float

    def to_mapping(self) -> dict[str, str]:
        """Flat string mapping, the shape of a Redis hash."""
        out = {
            name: repr(getattr(self, name))
            for name in (
                "count_1d", "count_7d", "count_30d", "mean_1d", "mean_7d", "mean_30d",
                "std_30d", "home_lat", "home_lon", "first_seen", "as_of",
            )
        }
        out["devices"] = "\x1f".join(sorted(self.devices))
        out["feature_set"] = FEATURE_SET_VERSION
        return out

    @classmethod
    def from_values(cls, values: Sequence[bytes | str | None]) -> UserProfile:
        """A profile from its hash's values in :data:`PROFILE_FIELDS` order
        (HMGET), as ``to_mapping`` wrote them; ``int``/``float`` read bytes as they are."""
        devices = values[9] or ""
        if isinstance(devices, bytes):
            devices = devices.decode()
        return cls(
            int(values[0]), int(values[1]), int(values[2]),  # type: ignore[arg-type]
            float(values[3]), float(values[4]), float(values[5]), float(values[6]),  # type: ignore[arg-type]
            float(values[7]), float(values[8]),  # type: ignore[arg-type]
            frozenset(devices.split("\x1f")) if devices else frozenset(),
            float(values[10]), float(values[11]),  # type: ignore[arg-type]
        )


@dataclass(frozen=True, slots=True)
class MerchantRisk:
    """Merchant volume and fraud rate over windows ending ``delay`` days before ``as_of``."""

    count_1d: int
    count_7d: int
    count_30d: int
    risk_1d: float
    risk_7d: float
    risk_30d: float
    last_label: float
    """The label of the merchant's latest known transaction (1.0: fraud; ties: any
    fraud among those sharing its time). A terminal stays compromised for weeks,
    so "its last known transaction was a fraud" says more about today than a
    30-day rate diluted by the weeks before the compromise."""
    as_of: float

    def to_mapping(self) -> dict[str, str]:
        out = {name: repr(getattr(self, name)) for name in self.__slots__}
        out["feature_set"] = FEATURE_SET_VERSION
        return out

    @classmethod
    def from_values(cls, values: Sequence[bytes | str | None]) -> MerchantRisk:
        """Merchant risk from its hash's values in :data:`MERCHANT_FIELDS` order (HMGET)."""
        return cls(
            int(values[0]), int(values[1]), int(values[2]),  # type: ignore[arg-type]
            float(values[3]), float(values[4]), float(values[5]), float(values[6]), float(values[7]),  # type: ignore[arg-type]
        )


#: The fields a store reads of a profile's and a merchant's hash (HMGET), in
#: the order ``from_values`` takes them; a profile's end with the feature set
#: that wrote it (the store refuses another; a merchant's is not checked, so
#: not read). NOTE: HMGET, not HGETALL: the values alone, in a known order, so
#: a batch's ~250 hashes become profiles without a dict, a decode and a look-up
#: per field (about a fifth of the scorer's samples in a profile, docs/performance.md).
PROFILE_FIELDS: tuple[str, ...] = (*(f.name for f in fields(UserProfile)), "feature_set")
MERCHANT_FIELDS: tuple[str, ...] = tuple(f.name for f in fields(MerchantRisk))


# --- real-time features ------------------------------------------------------


def haversine_km(lat1: float, lon1: float, lat2: float, lon2: float) -> float:
    p1, p2 = math.radians(lat1), math.radians(lat2)
    dp, dl = p2 - p1, math.radians(lon2 - lon1)
    a = math.sin(dp / 2) ** 2 + math.cos(p1) * math.cos(p2) * math.sin(dl / 2) ** 2
    return 2 * 6371.0088 * math.asin(min(1.0, math.sqrt(a)))


def velocity_from_events(times: np.ndarray, amounts: np.ndarray, now: float) -> tuple[float, ...]:
    """Counts then sums of events with ``now - w < time <= now`` per velocity window,
    over the newest :data:`VELOCITY_MAX_EVENTS` events up to ``now``.

    ``times``/``amounts`` are the user's events of the last 24 h (any order),
    the current transaction included. One row of :func:`velocity_batch`.
    """
    times = np.asarray(times, dtype=np.float64)
    out = velocity_batch(times, np.asarray(amounts, dtype=np.float64), np.array([len(times)]), np.array([now]))
    return tuple(out[0].tolist())


def velocity_batch(times: np.ndarray, amounts: np.ndarray, lengths: np.ndarray, nows: np.ndarray) -> np.ndarray:
    """:func:`velocity_from_events` for a whole batch at once: row ``i`` has the
    next ``lengths[i]`` events of ``times``/``amounts`` and is scored at
    ``nows[i]``. Returns one row per transaction: counts, then sums, per window."""
    n = len(lengths)
    seg = np.repeat(np.arange(n), lengths)
    now_e = np.asarray(nows, dtype=np.float64)[seg]
    keep = times <= now_e
    if len(times) and np.bincount(seg, weights=keep, minlength=n).max() > VELOCITY_MAX_EVENTS:
        # Newest first within each row; an event's rank among its row's kept ones.
        order = np.lexsort((-np.where(keep, times, -np.inf), seg))
        starts = np.concatenate(([0], np.cumsum(lengths)[:-1]))
        rank = np.empty(len(times), dtype=np.int64)
        rank[order] = np.arange(len(times)) - starts[seg[order]]
        keep &= rank < VELOCITY_MAX_EVENTS
    out = np.empty((n, 2 * len(VELOCITY_WINDOWS_S)), dtype=np.float64)
    for i, window in enumerate(VELOCITY_WINDOWS_S):
        inside = keep & (times > now_e - window)
        out[:, i] = np.bincount(seg, weights=inside, minlength=n)
        out[:, len(VELOCITY_WINDOWS_S) + i] = np.bincount(seg, weights=np.where(inside, amounts, 0.0), minlength=n)
    return out


def utc_offset_s(timestamp: float, tz: tzinfo | None) -> float:
    """Seconds to add to an epoch time for the wall clock in ``tz`` (None: UTC)."""
    if tz is None:
        return 0.0
    offset = datetime.fromtimestamp(timestamp, UTC).astimezone(tz).utcoffset()
    return offset.total_seconds() if offset is not None else 0.0


def feature_row(
    tx: Transaction,
    profile: UserProfile | None,
    merchant: MerchantRisk | None,
    velocity: Sequence[float],
    tz: tzinfo | None = None,
) -> list[float]:
    """The model's input for one transaction, in :data:`FEATURE_NAMES` order.

    A missing profile (a new user) or missing optional field gives NaN where a
    value cannot be known; XGBoost routes NaN down each split's learned default.
    ``tz``: the zone whose wall clock ``is_night`` and ``is_weekend`` read (the
    model's, from its manifest; None: UTC). Training and serving pass the same.
    """
    amount = tx.amount * CURRENCY_TO_USD.get(tx.currency, 1.0)
    local = tx.timestamp + utc_offset_s(tx.timestamp, tz)
    seconds_of_day = local % DAY_S
    # 1970-01-01 was a Thursday: weekday 3 with Monday = 0.
    weekday = (int(local // DAY_S) + 3) % 7
    if profile is None:
        user = [0.0, 0.0, 0.0, NAN, NAN, NAN, NAN]
        ratio = zscore = age = distance = NAN
        new_device = 1.0 if tx.device_id is not None else NAN
    else:
        user = [
            float(profile.count_1d), float(profile.count_7d), float(profile.count_30d),
            profile.mean_1d, profile.mean_7d, profile.mean_30d, profile.std_30d,
        ]
        mean, std = profile.mean_30d, profile.std_30d
        ratio = amount / mean if mean > 0 else NAN
        zscore = (amount - mean) / std if std > 0 else NAN
        age = (tx.timestamp - profile.first_seen) / DAY_S
        distance = (
            haversine_km(tx.lat, tx.lon, profile.home_lat, profile.home_lon)
            if tx.lat is not None and tx.lon is not None and not math.isnan(profile.home_lat)
            else NAN
        )
        new_device = NAN if tx.device_id is None else float(tx.device_id not in profile.devices)
    if merchant is None:
        merchant_part = [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    else:
        merchant_part = [
            float(merchant.count_1d), float(merchant.count_7d), float(merchant.count_30d),
            merchant.risk_1d, merchant.risk_7d, merchant.risk_30d, merchant.last_label,
        ]
    return [
        amount,
        math.log1p(amount),
        1.0 if seconds_of_day < 6 * 3600 else 0.0,
        1.0 if weekday >= 5 else 0.0,
        *user,
        ratio,
        zscore,
        age,
        distance,
        new_device,
        *merchant_part,
        *velocity,
    ]


def feature_matrix(rows: Iterable[list[float]]) -> np.ndarray:
    """Stack rows into the float32 matrix the models take."""
    matrix = np.asarray(list(rows), dtype=np.float32)
    return matrix.reshape(-1, len(FEATURE_NAMES))


def available_features(columns: Iterable[str]) -> list[str]:
    """The features computable from a file with these columns."""
    have = set(columns)
    return [name for name in FEATURE_NAMES if all(col in have for col in FEATURE_REQUIRES.get(name, ()))]


# --- batch builders (materialization and training) ---------------------------


def prepare_history(df: pd.DataFrame) -> pd.DataFrame:
    """Normalise a transactions frame: epoch-seconds ``ts``, ``amount_usd``,
    optional columns present (null when the file lacks them), sorted by time."""
    out = pd.DataFrame(
        {
            "transaction_id": df["transaction_id"].astype(str),
            "user_id": df["user_id"].astype(str),
            "merchant_id": df["merchant_id"].astype(str),
            "amount": df["amount"].astype(np.float64),
        }
    )
    raw = df["timestamp"]
    if pd.api.types.is_numeric_dtype(raw) and not pd.api.types.is_bool_dtype(raw):
        # Epoch numbers: the unit from their magnitude (to_datetime would read seconds as nanoseconds).
        ts, _ = parse_timestamps(raw)
    else:
        ts = pd.to_datetime(raw, utc=True)  # date-times; naive ones are UTC here (the simulator writes UTC)
    out["ts"] = ts.astype("int64").to_numpy() / _ns_per_unit(ts)
    currency = df["currency"] if "currency" in df else pd.Series("USD", index=df.index)
    out["currency"] = check_currencies(currency)  # a code without a rate is refused, never converted at 1.0
    out["amount_usd"] = out["amount"] * out["currency"].map(CURRENCY_TO_USD)
    for col in ("merchant_category", "device_id", "country"):
        out[col] = df[col].astype(object).where(df[col].notna(), None) if col in df else None
    for col in ("lat", "lon"):
        out[col] = df[col].astype(np.float64) if col in df else np.nan
    if "label" in df:
        out["label"] = parse_labels(df["label"])
    return out.sort_values("ts", kind="stable").reset_index(drop=True)


def _ns_per_unit(ts: pd.Series) -> float:
    # int64 view of a datetime64 column counts in its unit (ns, us or ms).
    unit = np.datetime_data(ts.dtype.base if hasattr(ts.dtype, "base") else ts.dtype)[0]
    return {"ns": 1e9, "us": 1e6, "ms": 1e3, "s": 1.0}[unit]


def build_user_profiles(history: pd.DataFrame, as_of: float) -> dict[str, UserProfile]:
    """Profiles of every user seen before ``as_of``, from :func:`prepare_history` rows."""
    past = history[history["ts"] < as_of]
    if past.empty:
        return {}
    by_user = past.groupby("user_id", sort=False)
    first_seen = by_user["ts"].min()
    stats: dict[str, pd.Series] = {}
    for days in PROFILE_WINDOWS_DAYS:
        recent = past[past["ts"] >= as_of - days * DAY_S].groupby("user_id", sort=False)["amount_usd"]
        stats[f"count_{days}d"] = recent.count()
        stats[f"mean_{days}d"] = recent.mean()
        if days == 30:
            stats["std_30d"] = recent.std(ddof=0)
    home_rows = past[(past["ts"] >= as_of - HOME_WINDOW_DAYS * DAY_S) & past["lat"].notna()]
    home = home_rows.groupby("user_id", sort=False)[["lat", "lon"]].median()
    with_device = past[past["device_id"].notna()]
    # Keep the most recently used devices: a profile must stay bounded in size.
    devices = (
        with_device.drop_duplicates(["user_id", "device_id"], keep="last")
        .groupby("user_id", sort=False)["device_id"]
        .agg(lambda s: frozenset(s.iloc[-MAX_KNOWN_DEVICES:]))
    )
    frame = pd.DataFrame(stats).reindex(first_seen.index)
    frame = frame.join(home, how="left").join(devices.rename("devices"), how="left")
    profiles: dict[str, UserProfile] = {}
    for user, row in zip(frame.index, frame.itertuples(index=False)):
        profiles[user] = UserProfile(
            count_1d=_count(row.count_1d),
            count_7d=_count(row.count_7d),
            count_30d=_count(row.count_30d),
            mean_1d=_float(row.mean_1d),
            mean_7d=_float(row.mean_7d),
            mean_30d=_float(row.mean_30d),
            std_30d=_float(row.std_30d),
            home_lat=_float(row.lat),
            home_lon=_float(row.lon),
            devices=row.devices if isinstance(row.devices, frozenset) else frozenset(),
            first_seen=float(first_seen[user]),
            as_of=float(as_of),
        )
    return profiles


def build_merchant_risk(
    history: pd.DataFrame, as_of: float, delay_days: int = MERCHANT_LABEL_DELAY_DAYS
) -> dict[str, MerchantRisk]:
    """Merchant risk as known at ``as_of``: labels of the last ``delay_days`` are
    not known yet, so each window ends ``delay_days`` before ``as_of``."""
    if "label" not in history:
        return {}
    end = as_of - delay_days * DAY_S
    window = history[(history["ts"] < end) & (history["ts"] >= end - max(PROFILE_WINDOWS_DAYS) * DAY_S)]
    if window.empty:
        return {}
    columns: dict[str, pd.Series] = {}
    for days in PROFILE_WINDOWS_DAYS:
        grouped = window[window["ts"] >= end - days * DAY_S].groupby("merchant_id", sort=False)["label"]
        columns[f"count_{days}d"] = grouped.count()
        columns[f"risk_{days}d"] = grouped.mean()
    latest = window["ts"].to_numpy() == window.groupby("merchant_id", sort=False)["ts"].transform("max").to_numpy()
    columns["last_label"] = window[latest].groupby("merchant_id", sort=False)["label"].max()
    frame = pd.DataFrame(columns).fillna(0.0)
    return {
        merchant: MerchantRisk(
            count_1d=int(row.count_1d), count_7d=int(row.count_7d), count_30d=int(row.count_30d),
            risk_1d=float(row.risk_1d), risk_7d=float(row.risk_7d), risk_30d=float(row.risk_30d),
            last_label=float(row.last_label), as_of=float(as_of),
        )
        for merchant, row in zip(frame.index, frame.itertuples(index=False))
    }


def _count(value: Any) -> int:
    return 0 if value is None or (isinstance(value, float) and math.isnan(value)) else int(value)


def _float(value: Any) -> float:
    return NAN if value is None else float(value)


def history_transactions(history: pd.DataFrame) -> Iterator[Transaction]:
    """Rows of :func:`prepare_history` as contract transactions."""
    for row in history.itertuples(index=False):
        yield Transaction(
            transaction_id=row.transaction_id,
            user_id=row.user_id,
            amount=row.amount,
            merchant_id=row.merchant_id,
            timestamp=row.ts,
            currency=row.currency,
            merchant_category=row.merchant_category,
            device_id=row.device_id,
            lat=None if math.isnan(row.lat) else row.lat,
            lon=None if math.isnan(row.lon) else row.lon,
            country=row.country,
        )


def training_matrix(
    history: pd.DataFrame, start: float, end: float, progress: bool = False, tz: tzinfo | None = None
) -> tuple[np.ndarray, np.ndarray, pd.DataFrame]:
    """Point-in-time features for the transactions with ``start <= ts < end``.

    Each day's rows see the profile and merchant risk as of that day's start
    (what ``materialize`` would have written that night) and velocity over the
    user's own transactions up to and including the row; night and weekend on
    ``tz``'s wall clock (None: UTC), as the model will be served. Returns the matrix in
    :data:`FEATURE_NAMES` order, the labels and the rows (for evaluation).

    Computed vectorised (:func:`pipeline.batch_features.batch_features`); it
    equals :func:`rowwise_matrix`, the serving code applied row by row, on the
    same data (``tests/unit/pipeline/test_batch_features.py``). ``progress`` is kept for
    callers; the vectorised path has no per-day loop to report.
    """
    from pipeline.batch_features import batch_features

    del progress
    return batch_features(history, start, end, tz)


def rowwise_matrix(
    history: pd.DataFrame, start: float, end: float, tz: tzinfo | None = None
) -> tuple[np.ndarray, np.ndarray, pd.DataFrame]:
    """:func:`training_matrix` computed the way a worker serves: per day the
    batch profile and merchant builders, then :func:`feature_row` on each
    transaction with its velocity. Slow (~25k rows/s); the reference the
    vectorised path is held equal to."""
    rows = history[(history["ts"] >= start) & (history["ts"] < end)]
    user_times, user_amounts = _user_series(history[history["ts"] < end])
    day_starts = np.arange(math.floor(start / DAY_S) * DAY_S, end, DAY_S)
    features: list[list[float]] = []
    for day in day_starts:
        day_rows = rows[(rows["ts"] >= day) & (rows["ts"] < day + DAY_S)]
        if day_rows.empty:
            continue
        profiles = build_user_profiles(history, day)
        merchants = build_merchant_risk(history, day)
        for tx in history_transactions(day_rows):
            times, amounts = user_times[tx.user_id], user_amounts[tx.user_id]
            hi = int(np.searchsorted(times, tx.timestamp, side="right"))
            lo = int(np.searchsorted(times, tx.timestamp - DAY_S, side="right"))
            velocity = velocity_from_events(times[lo:hi], amounts[lo:hi], tx.timestamp)
            features.append(feature_row(tx, profiles.get(tx.user_id), merchants.get(tx.merchant_id), velocity, tz))
    labels = rows["label"].to_numpy(dtype=np.int8) if "label" in rows else np.zeros(len(rows), np.int8)
    return feature_matrix(features), labels, rows.reset_index(drop=True)


def _user_series(history: pd.DataFrame) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    times: dict[str, np.ndarray] = {}
    amounts: dict[str, np.ndarray] = {}
    for user, group in history.groupby("user_id", sort=False):
        times[user] = group["ts"].to_numpy()
        amounts[user] = group["amount_usd"].to_numpy()
    return times, amounts
