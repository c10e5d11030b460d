"""A deterministic card-transaction simulator modelled on the Fraud Detection Handbook.

No real fraud data set can be installed offline, so training data comes from here. The
legitimate traffic and the first three fraud scenarios follow the simulator of
"Reproducible Machine Learning for Credit Card Fraud Detection - Practical Handbook"
(Le Borgne, Siblini, Lebichot, Bontempi), so a model trained with ``scenarios="handbook"``
can be compared with the Handbook's published numbers:

=========================  ============================================================
Handbook                   here
=========================  ============================================================
customer / terminal        user (``u-000042``) / merchant (``m-000123``) on a 100x100 grid;
                           a grid unit is 0.1 deg of latitude and 0.2 deg of longitude
                           (~11 x 16 km), so the box is lat 40..50, lon -5..15
mean ~U(5,100), std=mean/2 same, in USD; written in the user's home currency at the fixed
                           ``CURRENCY_TO_USD`` rates the features use
tx/day ~U(0,4), Poisson    same
terminals within radius 5  same (a user with none falls back to the 3 nearest)
time ~N(noon, 20,000 s)    same; draws outside the day are dropped, as in the Handbook
amount ~N(mean, std)       same; a negative draw becomes U(0, 2*mean), as in the Handbook
(1) amount > 220           ``amount_over_220``: USD amount > 220 is fraud
(2) 2 terminals/day, 28 d  ``compromised_terminal``: every transaction there is fraud
(3) 3 customers/day, 14 d  ``compromised_customer``: 1/3 of their transactions x5, fraud
=========================  ============================================================

The Handbook's counts in (2) and (3) hold for its 10,000 terminals and 5,000 customers;
here they scale with the population so a small test population has the same fraud rate.
Later scenarios overwrite earlier ones, as in the Handbook.

``scenarios="all"`` adds two patterns the Handbook lacks, which need the contract's
device and location fields to be caught:

(4) ``account_takeover``: a burst of 2-6 transactions within an hour, from a device the
    user has never used, at merchants more than 500 km from home, for 2-6x the user's
    mean amount, mostly at night.
(5) ``card_testing``: a burst of 5-20 payments of 0.5-3.0 within ten minutes at several
    merchants (mostly ``online``/``gaming``), usually from one fraudster device.

Everything is drawn from numpy Generators seeded from ``SimulationConfig.seed``; the two
extra scenarios use their own stream, so the Handbook part of an ``"all"`` run is the
same as a ``"handbook"`` run. ``LiveTransactions`` makes the same kind of traffic one
transaction at a time for the load generator.
"""

from __future__ import annotations

import uuid
from collections import deque
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
from tqdm import tqdm

from app.contract import CURRENCY_TO_USD, TRAINING_COLUMNS

__all__ = [
    "MERCHANT_CATEGORIES",
    "SCENARIOS",
    "LiveTransactions",
    "Population",
    "SimulationConfig",
    "build_population",
    "haversine_km",
    "simulate",
    "write_parquet",
]

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]

# --- geography -------------------------------------------------------------------------
GRID = 100.0
LAT0, LON0 = 40.0, -5.0
LAT_PER_UNIT, LON_PER_UNIT = 0.1, 0.2
TERMINAL_RADIUS = 5.0  # grid units, Handbook
EARTH_RADIUS_KM = 6371.0

# --- legitimate traffic (Handbook) -----------------------------------------------------
DAY_S = 86_400
DAY_MS = DAY_S * 1000
TIME_MEAN_S, TIME_STD_S = DAY_S / 2, 20_000.0

# --- handbook fraud ---------------------------------------------------------------------
LARGE_AMOUNT_USD = 220.0
TERMINALS_PER_DAY, TERMINAL_DAYS = 2 / 10_000, 28  # per terminal: 2 a day among 10,000
CUSTOMERS_PER_DAY, CUSTOMER_DAYS = 3 / 5_000, 14  # per user: 3 a day among 5,000
CUSTOMER_FRAUD_SHARE, CUSTOMER_FRAUD_FACTOR = 1 / 3, 5.0

# --- extra fraud --------------------------------------------------------------------------
# Tuned so that "all" lands at ~1.3 % fraud for 5,000 users: the Handbook part gives
# ~0.75 %, account takeovers ~0.2 % and card testing ~0.35 %.
ATO_PER_USER_DAY = 1 / 1_000
ATO_MIN_KM = 500.0
ATO_NIGHT_SHARE = 0.6
CARD_TESTING_PER_USER_DAY = 0.0006
CARD_TESTING_CATEGORIES = ("online", "gaming")

SCENARIOS: tuple[str, ...] = (
    "legit",
    "amount_over_220",
    "compromised_terminal",
    "compromised_customer",
    "account_takeover",
    "card_testing",
)
LEGIT, OVER_220, TERMINAL, CUSTOMER, ATO, CARD_TESTING = range(len(SCENARIOS))

MERCHANT_CATEGORIES: tuple[str, ...] = (
    "grocery",
    "restaurants",
    "fuel",
    "retail",
    "electronics",
    "travel",
    "online",
    "gaming",
    "pharmacy",
)
_CATEGORY_WEIGHTS = (0.24, 0.18, 0.10, 0.14, 0.06, 0.05, 0.15, 0.04, 0.04)

# "Mostly USD/EUR/GBP": cardholders in a European box, some with foreign cards.
_CURRENCIES = ("EUR", "USD", "GBP", "CHF", "SEK", "PLN")
_CURRENCY_WEIGHTS = (0.55, 0.22, 0.14, 0.05, 0.02, 0.02)

# Salts that split one seed into independent streams.
_POPULATION, _HANDBOOK, _EXTRA, _DEVICE_IDS, _TX_IDS = range(5)


@dataclass(frozen=True)
class SimulationConfig:
    """What to simulate. Same config (with an explicit ``end``) -> same data."""

    n_users: int = 5000
    n_merchants: int = 10000
    days: int = 60
    seed: int = 42
    #: Exclusive end of the simulated period (UTC); default today's UTC midnight.
    end: datetime | None = None
    #: "handbook" (scenarios 1-3 only) or "all" (1-5).
    scenarios: str = "all"

    def __post_init__(self) -> None:
        if self.scenarios not in ("handbook", "all"):
            raise ValueError(f"scenarios must be 'handbook' or 'all', not {self.scenarios!r}")
        if min(self.n_users, self.n_merchants, self.days) < 1:
            raise ValueError("n_users, n_merchants and days must be positive")


@dataclass(eq=False)  # numpy fields: == would be ambiguous
class Population:
    """Users and merchants. Amounts are USD; index i of every ``user_*`` array is user i.

    Ragged per-user lists (known devices, reachable merchants) are stored flat with
    offsets: user i owns ``device_ids[device_offsets[i]:device_offsets[i + 1]]``.
    """

    user_id: npt.NDArray[np.object_]
    user_x: FloatArray
    user_y: FloatArray
    user_lat: FloatArray
    user_lon: FloatArray
    user_country: npt.NDArray[np.object_]
    mean_amount: FloatArray
    std_amount: FloatArray
    tx_per_day: FloatArray
    currency: npt.NDArray[np.object_]
    #: Account age at the start of the simulation; see ``created_at``.
    account_age_days: FloatArray
    device_ids: npt.NDArray[np.object_]
    device_offsets: IntArray
    #: Merchant indices within ``TERMINAL_RADIUS`` of home.
    user_merchants: IntArray
    user_merchant_offsets: IntArray
    merchant_id: npt.NDArray[np.object_]
    merchant_x: FloatArray
    merchant_y: FloatArray
    merchant_lat: FloatArray
    merchant_lon: FloatArray
    merchant_category: npt.NDArray[np.object_]
    merchant_country: npt.NDArray[np.object_]

    @property
    def n_users(self) -> int:
        return len(self.user_id)

    @property
    def n_merchants(self) -> int:
        return len(self.merchant_id)

    def devices_of(self, user: int) -> npt.NDArray[np.object_]:
        return self.device_ids[self.device_offsets[user] : self.device_offsets[user + 1]]

    def created_at(self, start: datetime) -> npt.NDArray[np.datetime64]:
        """Account creation times for a simulation starting at ``start``.

        Stored as an age so the population does not depend on the simulated period.
        """
        start_ms = np.datetime64(int(start.timestamp() * 1000), "ms")
        return start_ms - (self.account_age_days * DAY_MS).astype("timedelta64[ms]")

    @property
    def usd_rate(self) -> FloatArray:
        """Each user's currency in USD."""
        return np.array([CURRENCY_TO_USD[c] for c in self.currency], dtype=np.float64)


# --- small helpers ---------------------------------------------------------------------
def _rng(seed: int, salt: int) -> np.random.Generator:
    return np.random.default_rng([seed, salt])


def _key(seed: int, salt: int) -> np.uint64:
    key: np.uint64 = np.random.SeedSequence([seed, salt]).generate_state(1, np.uint64)[0]
    return key


def _mix64(counter: npt.NDArray[np.uint64], key: np.uint64) -> npt.NDArray[np.uint64]:
    """SplitMix64's finalizer. It is a bijection, so distinct counters give distinct ids."""
    z = counter.astype(np.uint64) + key  # wraps mod 2**64, still one-to-one
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


_HEX_DIGITS = np.frombuffer(b"0123456789abcdef", dtype=np.uint8)
_NIBBLE_SHIFTS = np.arange(60, -4, -4, dtype=np.uint64)


def _hex_ids(prefix: str, values: npt.NDArray[np.uint64]) -> npt.NDArray[np.object_]:
    """``prefix`` + 16 lower-case hex digits per value, without a Python loop per digit."""
    head = np.frombuffer(prefix.encode(), dtype=np.uint8)
    width = len(head) + 16
    buf = np.empty((len(values), width), dtype=np.uint8)
    buf[:, : len(head)] = head
    buf[:, len(head) :] = _HEX_DIGITS[(values[:, None] >> _NIBBLE_SHIFTS) & np.uint64(0xF)]
    return buf.view(f"S{width}").ravel().astype(f"U{width}").astype(object)


def _device_ids(seed: int, counters: npt.ArrayLike) -> npt.NDArray[np.object_]:
    # NOTE: known and new devices share one counter space, so a device made for a
    # fraud burst can never collide with anyone's known device.
    return _hex_ids("d-", _mix64(np.asarray(counters, dtype=np.uint64), _key(seed, _DEVICE_IDS)))


def _stochastic_round(x: float, rng: np.random.Generator) -> int:
    """floor(x) plus one with probability frac(x): exact for whole x, right on average."""
    whole = int(np.floor(x))
    return whole + int(rng.random() < x - whole)


def haversine_km(
    lat1: npt.ArrayLike, lon1: npt.ArrayLike, lat2: npt.ArrayLike, lon2: npt.ArrayLike
) -> FloatArray:
    """Great-circle distance in km (vectorised)."""
    p1, l1, p2, l2 = (np.radians(np.asarray(v, dtype=np.float64)) for v in (lat1, lon1, lat2, lon2))
    a = np.sin((p2 - p1) / 2) ** 2 + np.cos(p1) * np.cos(p2) * np.sin((l2 - l1) / 2) ** 2
    return np.asarray(2 * EARTH_RADIUS_KM * np.arcsin(np.sqrt(a)), dtype=np.float64)


def _grid_to_latlon(x: FloatArray, y: FloatArray) -> tuple[FloatArray, FloatArray]:
    return LAT0 + y * LAT_PER_UNIT, LON0 + x * LON_PER_UNIT


def _country_of(lat: FloatArray, lon: FloatArray) -> npt.NDArray[np.object_]:
    """A coarse, fixed map of the box onto six countries (roughly where they really are)."""
    west = lon < 7.0
    country = np.where(
        west,
        np.where(lat < 42.5, "ES", "FR"),
        np.where(lat < 46.0, "IT", np.where(lat < 47.5, np.where(lon < 10.5, "CH", "AT"), "DE")),
    )
    return country.astype(object)


def _merchants_near(
    ux: FloatArray, uy: FloatArray, mx: FloatArray, my: FloatArray
) -> tuple[IntArray, IntArray]:
    """Merchants within TERMINAL_RADIUS of each user, as (flat indices, offsets)."""
    chunk = max(1, 2_000_000 // len(mx))  # keeps each distance block at ~16 MB
    fallback = min(3, len(mx))
    flat: list[IntArray] = []
    counts: list[IntArray] = []
    for lo in range(0, len(ux), chunk):
        d2 = (ux[lo : lo + chunk, None] - mx) ** 2 + (uy[lo : lo + chunk, None] - my) ** 2
        near = d2 <= TERMINAL_RADIUS**2
        # NOTE: the Handbook leaves a user with no terminal in reach without transactions;
        # with small test populations that is common, so use the nearest few instead.
        lonely = np.flatnonzero(~near.any(axis=1))
        if len(lonely):
            nearest = np.argpartition(d2[lonely], fallback - 1, axis=1)[:, :fallback]
            near[lonely[:, None], nearest] = True
        flat.append(np.nonzero(near)[1].astype(np.int64))  # row-major: grouped by user
        counts.append(near.sum(axis=1).astype(np.int64))
    offsets = np.concatenate([[0], np.cumsum(np.concatenate(counts))]).astype(np.int64)
    return np.concatenate(flat), offsets


# --- population ----------------------------------------------------------------------------
def build_population(cfg: SimulationConfig) -> Population:
    """Users and merchants, from ``cfg.seed``, ``n_users`` and ``n_merchants`` only."""
    rng = _rng(cfg.seed, _POPULATION)
    n, m = cfg.n_users, cfg.n_merchants
    # Handbook customer profile.
    ux, uy = rng.uniform(0, GRID, n), rng.uniform(0, GRID, n)
    mean = rng.uniform(5, 100, n)
    tx_per_day = rng.uniform(0, 4, n)
    # Additions: the contract's device and currency fields, and an account age
    # (15 % of accounts are new, under two months, where takeovers are hard to spot).
    currency = rng.choice(np.array(_CURRENCIES, dtype=object), n, p=_CURRENCY_WEIGHTS)
    new = rng.random(n) < 0.15
    age = np.where(new, rng.uniform(0.5, 60, n), rng.uniform(60, 3650, n))
    n_devices = rng.integers(1, 4, n)
    # Handbook terminal profile, plus a category.
    mx, my = rng.uniform(0, GRID, m), rng.uniform(0, GRID, m)
    category = rng.choice(np.array(MERCHANT_CATEGORIES, dtype=object), m, p=_CATEGORY_WEIGHTS)

    ulat, ulon = _grid_to_latlon(ux, uy)
    mlat, mlon = _grid_to_latlon(mx, my)
    user_merchants, user_merchant_offsets = _merchants_near(ux, uy, mx, my)
    device_offsets = np.concatenate([[0], np.cumsum(n_devices)]).astype(np.int64)
    return Population(
        user_id=np.array([f"u-{i:06d}" for i in range(n)], dtype=object),
        user_x=ux,
        user_y=uy,
        user_lat=ulat,
        user_lon=ulon,
        user_country=_country_of(ulat, ulon),
        mean_amount=mean,
        std_amount=mean / 2,
        tx_per_day=tx_per_day,
        currency=currency,
        account_age_days=age,
        device_ids=_device_ids(cfg.seed, np.arange(device_offsets[-1])),
        device_offsets=device_offsets,
        user_merchants=user_merchants,
        user_merchant_offsets=user_merchant_offsets,
        merchant_id=np.array([f"m-{i:06d}" for i in range(m)], dtype=object),
        merchant_x=mx,
        merchant_y=my,
        merchant_lat=mlat,
        merchant_lon=mlon,
        merchant_category=category,
        merchant_country=_country_of(mlat, mlon),
    )


# --- one day of transactions -----------------------------------------------------------------
@dataclass
class _Rows:
    """Transactions as parallel arrays; ``device`` is a device counter, amounts are USD."""

    user: IntArray
    merchant: IntArray
    device: IntArray
    time_ms: IntArray  # since the start of the simulation
    amount_usd: FloatArray
    scenario: npt.NDArray[np.int8]

    @classmethod
    def concat(cls, parts: list[_Rows]) -> _Rows:
        fields = cls.__dataclass_fields__
        return cls(*(np.concatenate([getattr(p, f) for p in parts]) for f in fields))


@dataclass
class _Compromised:
    """Until which day (exclusive) each terminal / user stays compromised."""

    terminal_until: IntArray
    customer_until: IntArray


def _pick(offsets: IntArray, owners: IntArray, rng: np.random.Generator) -> IntArray:
    """A uniformly random position in each owner's slice of a flat ragged list."""
    counts = offsets[owners + 1] - offsets[owners]
    return offsets[owners] + (rng.random(len(owners)) * counts).astype(np.int64)


def _legit_day(pop: Population, day: int, rng: np.random.Generator) -> _Rows:
    """The Handbook's daily draw for every user, vectorised over users."""
    users = np.repeat(np.arange(pop.n_users), rng.poisson(pop.tx_per_day))
    time_s = rng.normal(TIME_MEAN_S, TIME_STD_S, len(users))
    amount = rng.normal(pop.mean_amount[users], pop.std_amount[users])
    negative = rng.uniform(0, 2 * pop.mean_amount[users])
    merchant = pop.user_merchants[_pick(pop.user_merchant_offsets, users, rng)]
    device = _pick(pop.device_offsets, users, rng)
    keep = (time_s >= 0) & (time_s < DAY_S)  # the Handbook drops, not clips, these
    return _Rows(
        user=users[keep],
        merchant=merchant[keep],
        device=device[keep],
        time_ms=day * DAY_MS + (time_s[keep] * 1000).astype(np.int64),
        amount_usd=np.where(amount < 0, negative, amount)[keep],
        scenario=np.zeros(int(keep.sum()), dtype=np.int8),
    )


def _compromise_terminals(
    rows: _Rows, day: int, state: _Compromised, rng: np.random.Generator
) -> None:
    """Handbook scenario 2: today's picks stay compromised for 28 days, all their tx fraud."""
    k = _stochastic_round(TERMINALS_PER_DAY * len(state.terminal_until), rng)
    picked = rng.choice(len(state.terminal_until), size=k, replace=False)
    state.terminal_until[picked] = day + TERMINAL_DAYS
    rows.scenario[state.terminal_until[rows.merchant] > day] = TERMINAL


def _compromise_customers(
    rows: _Rows, day: int, state: _Compromised, rng: np.random.Generator
) -> None:
    """Handbook scenario 3: for 14 days, a third of the user's tx are fraud with amount x5."""
    k = _stochastic_round(CUSTOMERS_PER_DAY * len(state.customer_until), rng)
    picked = rng.choice(len(state.customer_until), size=k, replace=False)
    state.customer_until[picked] = day + CUSTOMER_DAYS
    share = rng.random(len(rows.user)) < CUSTOMER_FRAUD_SHARE
    hit = (state.customer_until[rows.user] > day) & share
    rows.amount_usd[hit] *= CUSTOMER_FRAUD_FACTOR
    rows.scenario[hit] = CUSTOMER


class _NewDevices:
    """Hands out device counters no user has ever held."""

    def __init__(self, first: int) -> None:
        self.next = first

    def take(self, n: int) -> IntArray:
        out = np.arange(self.next, self.next + n, dtype=np.int64)
        self.next += n
        return out


def _far_merchants(pop: Population, user: int, min_km: float) -> IntArray:
    """Merchants more than ``min_km`` from home (the farthest 5 % if none is that far)."""
    km = haversine_km(pop.user_lat[user], pop.user_lon[user], pop.merchant_lat, pop.merchant_lon)
    far = np.flatnonzero(km > min_km)
    return far if len(far) else np.argsort(km)[-max(1, len(km) // 20) :]


def _takeover_merchants(pop: Population, user: int, n: int, rng: np.random.Generator) -> IntArray:
    """``n`` merchants in one city more than ATO_MIN_KM from the user's home."""
    far = _far_merchants(pop, user, ATO_MIN_KM)
    # The fraudster stays in one place: merchants around one far-away anchor.
    anchor = far[rng.integers(len(far))]
    dx = pop.merchant_x[far] - pop.merchant_x[anchor]
    dy = pop.merchant_y[far] - pop.merchant_y[anchor]
    d2 = dx**2 + dy**2
    city = far[d2 <= TERMINAL_RADIUS**2]  # holds the anchor at least
    picked: IntArray = city[rng.integers(len(city), size=n)]
    return picked


def _account_takeovers(
    pop: Population, day: int, rng: np.random.Generator, devices: _NewDevices
) -> list[_Rows]:
    """Scenario 4: a stolen login used from a new device in another region, fast and big."""
    k = max(1, _stochastic_round(ATO_PER_USER_DAY * pop.n_users, rng))
    bursts = []
    for user in rng.choice(pop.n_users, size=min(k, pop.n_users), replace=False):
        n = int(rng.integers(2, 7))
        night = rng.random() < ATO_NIGHT_SHARE
        start_s = rng.uniform(0, 5 * 3600) if night else rng.uniform(7 * 3600, DAY_S - 3600)
        time_s = start_s + np.sort(rng.uniform(0, 3600, n))
        bursts.append(
            _Rows(
                user=np.full(n, user, dtype=np.int64),
                merchant=_takeover_merchants(pop, user, n, rng),
                device=np.repeat(devices.take(1), n),
                time_ms=day * DAY_MS + (time_s * 1000).astype(np.int64),
                amount_usd=pop.mean_amount[user] * rng.uniform(2, 6, n),
                scenario=np.full(n, ATO, dtype=np.int8),
            )
        )
    return bursts


def _card_testing_pool(pop: Population) -> IntArray:
    pool = np.flatnonzero(np.isin(pop.merchant_category, CARD_TESTING_CATEGORIES))
    return pool if len(pool) else np.arange(pop.n_merchants)


def _card_testing_merchants(
    pop: Population, pool: IntArray, n: int, rng: np.random.Generator
) -> IntArray:
    """``n`` payments spread over 2-6 merchants, mostly online ones that check cards cheaply."""
    source = pool if rng.random() < 0.8 else np.arange(pop.n_merchants)
    merchants = rng.choice(source, size=min(int(rng.integers(2, 7)), len(source)), replace=False)
    return merchants[rng.integers(len(merchants), size=n)]


def _card_testing(
    pop: Population, day: int, rng: np.random.Generator, devices: _NewDevices, pool: IntArray
) -> list[_Rows]:
    """Scenario 5: a stolen card number checked with many tiny payments by a bot."""
    k = _stochastic_round(CARD_TESTING_PER_USER_DAY * pop.n_users, rng)
    bursts = []
    for user in rng.choice(pop.n_users, size=min(k, pop.n_users), replace=False):
        n = int(rng.integers(5, 21))
        merchants = _card_testing_merchants(pop, pool, n, rng)
        # Usually one bot device for the whole burst; sometimes a fresh one per attempt.
        device = np.repeat(devices.take(1), n) if rng.random() < 0.85 else devices.take(n)
        time_s = rng.uniform(0, DAY_S - 600) + np.sort(rng.uniform(0, 600, n))
        bursts.append(
            _Rows(
                user=np.full(n, user, dtype=np.int64),
                merchant=merchants,
                device=device,
                time_ms=day * DAY_MS + (time_s * 1000).astype(np.int64),
                amount_usd=rng.uniform(0.5, 3.0, n),
                scenario=np.full(n, CARD_TESTING, dtype=np.int8),
            )
        )
    return bursts


# --- the whole simulation ---------------------------------------------------------------------
def _resolve_end(end: datetime | None) -> datetime:
    if end is None:
        return datetime.now(UTC).replace(hour=0, minute=0, second=0, microsecond=0)
    return end.replace(tzinfo=UTC) if end.tzinfo is None else end.astimezone(UTC)


def simulate(cfg: SimulationConfig, progress: bool = True) -> pd.DataFrame:
    """Labelled transactions in ``[end - days, end)``: TRAINING_COLUMNS + ``scenario``."""
    pop = build_population(cfg)
    base, extra = _rng(cfg.seed, _HANDBOOK), _rng(cfg.seed, _EXTRA)
    state = _Compromised(
        terminal_until=np.zeros(pop.n_merchants, dtype=np.int64),
        customer_until=np.zeros(pop.n_users, dtype=np.int64),
    )
    devices = _NewDevices(first=len(pop.device_ids))
    pool = _card_testing_pool(pop)
    parts: list[_Rows] = []
    for day in tqdm(range(cfg.days), desc="simulating", unit="day", disable=not progress):
        rows = _legit_day(pop, day, base)
        _compromise_terminals(rows, day, state, base)
        _compromise_customers(rows, day, state, base)
        parts.append(rows)
        if cfg.scenarios == "all":
            parts += _account_takeovers(pop, day, extra, devices)
            parts += _card_testing(pop, day, extra, devices, pool)
    return _to_frame(cfg, pop, _Rows.concat(parts), _resolve_end(cfg.end))


def _to_frame(cfg: SimulationConfig, pop: Population, rows: _Rows, end: datetime) -> pd.DataFrame:
    order = np.argsort(rows.time_ms, kind="stable")
    user, merchant = rows.user[order], rows.merchant[order]
    scenario = rows.scenario[order]
    rate = pop.usd_rate[user]
    amount = np.maximum(np.round(rows.amount_usd[order] / rate, 2), 0.01)
    # Handbook scenario 1, applied last to the amount as written so that the rule
    # "USD amount > 220 is fraud" holds exactly for the features; it ranks below 2 and 3.
    scenario[(scenario == LEGIT) & (amount * rate > LARGE_AMOUNT_USD)] = OVER_220

    end_ms = int(end.timestamp() * 1000)
    start_ms = end_ms - cfg.days * DAY_MS
    stamps = (start_ms + rows.time_ms[order]).astype("datetime64[ms]")
    # A different id key per mode: the two modes never share a transaction_id.
    key = _key(cfg.seed, _TX_IDS * 10 + (cfg.scenarios == "all"))
    df = pd.DataFrame(
        {
            "transaction_id": _hex_ids("t-", _mix64(np.arange(len(order), dtype=np.uint64), key)),
            "user_id": pop.user_id[user],
            "amount": amount,
            "currency": pop.currency[user],
            "merchant_id": pop.merchant_id[merchant],
            "merchant_category": pop.merchant_category[merchant],
            "device_id": _device_ids(cfg.seed, rows.device[order]),
            "lat": pop.merchant_lat[merchant],
            "lon": pop.merchant_lon[merchant],
            "country": pop.merchant_country[merchant],
            "timestamp": pd.Series(stamps).dt.tz_localize(UTC),
            "label": (scenario != LEGIT).astype(np.int8),
            "scenario": np.array(SCENARIOS, dtype=object)[scenario],
        }
    )
    return df[[*TRAINING_COLUMNS, "scenario"]]


def write_parquet(df: pd.DataFrame, path: Path) -> None:
    """Write ``df`` as Parquet (``timestamp`` stays ``timestamp[ms, UTC]``)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pandas(df, preserve_index=False), path)


# --- live traffic for the load generator ------------------------------------------------------
@dataclass
class _Pending:
    user: int
    merchant: int
    device: str
    amount_usd: float
    scenario: str


class LiveTransactions:
    """Realistic live transactions, one per ``next(now)``, for users of ``population``.

    Users appear in proportion to their ``tx_per_day``. A fraud event (large amount,
    account takeover or card testing, equally likely) starts with a probability chosen
    so that about ``fraud_rate`` of the transactions are fraud; the rest of a burst is
    interleaved with normal traffic over the next calls. ``last_scenario`` tells what the
    latest transaction was (ground truth for the load generator's own reports).
    """

    # Mean transactions per event: large amount 1, takeover 4, card testing 12.5.
    _MEAN_EVENT_LEN = (1 + 4 + 12.5) / 3

    def __init__(self, population: Population, seed: int = 7, fraud_rate: float = 0.01) -> None:
        self._pop = population
        self._rng = np.random.default_rng(seed)
        self._start_p = min(1.0, max(0.0, fraud_rate) / self._MEAN_EVENT_LEN)
        self._cum_weight = np.cumsum(population.tx_per_day) / population.tx_per_day.sum()
        self._rate = population.usd_rate
        self._pool = _card_testing_pool(population)
        self._pending: deque[_Pending] = deque()
        self.last_scenario = "legit"

    def next(self, now: float) -> dict[str, Any]:
        """One transaction at epoch seconds ``now`` as a JSON-ready contract dict."""
        rng = self._rng
        if self._pending and rng.random() < 0.5:
            tx = self._pending.popleft()
        elif rng.random() < self._start_p:
            burst = self._fraud_event()
            tx = burst.popleft()
            self._pending.extend(burst)
        else:
            tx = self._legit()
        self.last_scenario = tx.scenario
        return self._to_dict(tx, now)

    def _user(self) -> int:
        user = int(np.searchsorted(self._cum_weight, self._rng.random(), side="right"))
        return min(user, self._pop.n_users - 1)  # guards against cumsum rounding below 1

    def _legit(self) -> _Pending:
        pop, rng, user = self._pop, self._rng, self._user()
        lo, hi = pop.user_merchant_offsets[user], pop.user_merchant_offsets[user + 1]
        devices = pop.devices_of(user)
        amount = rng.normal(pop.mean_amount[user], pop.std_amount[user])
        if amount < 0:  # as in the Handbook
            amount = rng.uniform(0, 2 * pop.mean_amount[user])
        merchant = int(pop.user_merchants[rng.integers(lo, hi)])
        return _Pending(user, merchant, str(devices[rng.integers(len(devices))]), amount, "legit")

    def _fraud_event(self) -> deque[_Pending]:
        pop, rng = self._pop, self._rng
        kind = rng.integers(3)
        if kind == 0:  # a stolen card used at the user's usual places, for a lot
            tx = self._legit()
            tx.amount_usd, tx.scenario = float(rng.uniform(225, 1500)), "amount_over_220"
            return deque([tx])
        user, device = self._user(), f"d-{uuid.uuid4().hex[:16]}"
        if kind == 1:  # account takeover: far away, 2-6x the usual amount
            n = int(rng.integers(2, 7))
            merchants = _takeover_merchants(pop, user, n, rng)
            amounts = pop.mean_amount[user] * rng.uniform(2, 6, n)
            scenario = "account_takeover"
        else:  # card testing: many tiny payments
            n = int(rng.integers(5, 21))
            merchants = _card_testing_merchants(pop, self._pool, n, rng)
            amounts = rng.uniform(0.5, 3.0, n)
            scenario = "card_testing"
        return deque(
            _Pending(user, int(m), device, float(a), scenario) for m, a in zip(merchants, amounts)
        )

    def _to_dict(self, tx: _Pending, now: float) -> dict[str, Any]:
        pop, m = self._pop, tx.merchant
        stamp = datetime.fromtimestamp(now, tz=UTC).isoformat(timespec="milliseconds")
        return {
            "transaction_id": f"t-{uuid.uuid4().hex[:16]}",
            "user_id": str(pop.user_id[tx.user]),
            "amount": max(round(tx.amount_usd / float(self._rate[tx.user]), 2), 0.01),
            "currency": str(pop.currency[tx.user]),
            "merchant_id": str(pop.merchant_id[m]),
            "merchant_category": str(pop.merchant_category[m]),
            "device_id": tx.device,
            "lat": float(pop.merchant_lat[m]),
            "lon": float(pop.merchant_lon[m]),
            "country": str(pop.merchant_country[m]),
            "timestamp": stamp.replace("+00:00", "Z"),
        }
