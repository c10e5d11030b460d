"""Reading a transactions file for training: Parquet or CSV, checked column by column.

Real exports differ from the simulator's Parquet in small ways that would
otherwise train a wrong model without a word: epoch seconds read as nanoseconds
(every transaction in January 1970), local times without a zone read as UTC,
labels spelled ``fraud``/``legit``, a currency without a rate converted at 1.0.
:func:`read_transactions` reads each column the one way it can be meant, says
what it detected (``notes``, one line each) and refuses anything else with
:class:`DataFileError`: one line naming the column and the fix.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

import numpy as np
import pandas as pd

from app.contract import CURRENCY_TO_USD
from app.errors import FraudPipelineError

__all__ = [
    "DataFile",
    "DataFileError",
    "check_currencies",
    "parse_labels",
    "parse_timestamps",
    "read_transactions",
    "zone",
]

REQUIRED = ("transaction_id", "user_id", "merchant_id", "amount", "timestamp")
ID_COLUMNS = ("transaction_id", "user_id", "merchant_id", "device_id")
LABEL_WORDS = {"0": 0, "1": 1, "false": 0, "true": 1, "legit": 0, "fraud": 1}

#: Epoch magnitudes: a value below 1e11 is seconds (up to the year 5138), below
#: 1e14 milliseconds, below 1e17 microseconds, else nanoseconds. No two units
#: overlap for dates between 1973 and 5138.
EPOCH_UNITS = ((1e11, "s", "epoch seconds"), (1e14, "ms", "epoch milliseconds"), (1e17, "us", "epoch microseconds"),
               (float("inf"), "ns", "epoch nanoseconds"))  # fmt: skip
#: A time of day followed by Z or an offset (a date alone, 2026-07-01, ends in "-01" and is no offset).
ZONE_SUFFIX = re.compile(r"\d\d:\d\d(?::\d\d(?:\.\d+)?)?\s*(?:Z|[+-]\d\d(?::?\d\d)?)$", re.IGNORECASE)


class DataFileError(FraudPipelineError, ValueError):
    """A transactions file that cannot be read as meant; the message names the column and the fix."""


@dataclass
class DataFile:
    frame: pd.DataFrame
    """``timestamp`` as UTC date-times, ``label`` 0/1 (int8), ``currency`` a known code."""
    notes: list[str] = field(default_factory=list)


def zone(name: str) -> ZoneInfo:
    try:
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError):
        raise DataFileError(
            f"--timezone {name!r}: not a time zone name; use an IANA name such as UTC or Europe/Brussels"
        ) from None


def read_transactions(path: Path, *, timezone: str | None = None, require_label: bool = True) -> DataFile:
    """Read ``path`` (Parquet or CSV), check it and normalise the columns the features read."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such file")
    name = path.name.lower()
    if name.endswith((".parquet", ".pq")):
        frame = pd.read_parquet(path)
        kind = "Parquet"
    elif name.endswith((".csv", ".csv.gz")):
        present = pd.read_csv(path, nrows=0).columns
        frame = pd.read_csv(path, dtype={c: str for c in ID_COLUMNS if c in present}, low_memory=False)
        kind = "CSV"
    else:
        raise DataFileError(f"{path}: {path.suffix or 'no extension'} is not read; give Parquet (.parquet) or CSV "
                            "(.csv, .csv.gz)")  # fmt: skip
    required = (*REQUIRED, "label") if require_label else REQUIRED
    for column in required:
        if column not in frame.columns:
            raise DataFileError(
                f"{path}: no {column!r} column (needed: {', '.join(required)}; optional: currency, "
                f"merchant_category, device_id, lat, lon, country); rename the column that holds it"
            )
    if frame.empty:
        raise DataFileError(f"{path}: no rows")
    out = frame.copy()
    notes = [f"read {len(out):,} rows from {path} ({kind})"]
    for column in ("transaction_id", "user_id", "merchant_id"):
        missing = int(out[column].isna().sum())
        if missing:
            raise DataFileError(f"{column}: {missing:,} rows have none; drop those rows or fill them")
    amount = pd.to_numeric(out["amount"], errors="coerce")
    bad = int(amount.isna().sum() + (amount < 0).sum())
    if bad:
        raise DataFileError(f"amount: {bad:,} rows are not a number >= 0 (e.g. {_examples(out['amount'][amount.isna() | (amount < 0)])}); "
                            "fix or drop them")  # fmt: skip
    out["amount"] = amount.astype(np.float64)
    out["timestamp"], note = parse_timestamps(out["timestamp"], timezone)
    notes.append(note)
    if "label" in out:
        out["label"] = parse_labels(out["label"])
        notes.append(f"labels: {int(out['label'].sum()):,} fraud, {int((out['label'] == 0).sum()):,} legit")
    if "currency" in out:
        out["currency"] = check_currencies(out["currency"])
    else:
        notes.append("currency: no column; every amount is read as USD")
    absent = [c for c in ("device_id", "lat", "lon") if c not in out or out[c].isna().all()]
    if absent:
        notes.append(f"optional columns absent: {', '.join(absent)} (the features that need them are left out)")
    return DataFile(out, notes)


def parse_timestamps(values: pd.Series, timezone: str | None = None) -> tuple[pd.Series, str]:
    """UTC date-times from epoch numbers (unit detected from the magnitude),
    ISO-8601 strings or date-times; naive ones need ``timezone``. Returns the
    series and a line saying what was read."""
    if values.isna().any():
        raise DataFileError(f"timestamp: {int(values.isna().sum()):,} rows have none; drop them or fill them")
    tz = zone(timezone) if timezone else None
    if pd.api.types.is_bool_dtype(values):
        raise DataFileError("timestamp: booleans; give epoch seconds or milliseconds, or ISO-8601 date-times")
    if pd.api.types.is_numeric_dtype(values):
        return _from_epoch(values.astype(np.float64))
    if isinstance(values.dtype, pd.DatetimeTZDtype):
        return values.dt.tz_convert("UTC"), "timestamps: date-times with a time zone, converted to UTC" + _range(
            values.dt.tz_convert("UTC")
        )
    if pd.api.types.is_datetime64_dtype(values):
        return _localize(values, tz, "date-times without a time zone")
    text = values.astype(str).str.strip()
    if text.str.fullmatch(r"-?\d+(\.\d+)?").all():  # epoch numbers stored as text (a CSV column of quoted numbers)
        return _from_epoch(text.astype(np.float64))
    zoned = text.str.contains(ZONE_SUFFIX)
    if zoned.all():
        parsed = pd.to_datetime(text, format="ISO8601", utc=True, errors="coerce")
        _refuse_unparsed(text, parsed)
        return parsed, "timestamps: ISO-8601 with a UTC offset, converted to UTC" + _range(parsed)
    if zoned.any():
        raise DataFileError(
            f"timestamp: {int(zoned.sum()):,} rows carry a UTC offset and {int((~zoned).sum()):,} do not "
            f"(e.g. {_examples(text[~zoned])}); write every time with its offset, or none and give --timezone"
        )
    parsed = pd.to_datetime(text, format="ISO8601", errors="coerce")
    _refuse_unparsed(text, parsed)
    return _localize(parsed, tz, "ISO-8601 without a UTC offset")


def _from_epoch(numbers: pd.Series) -> tuple[pd.Series, str]:
    magnitude = float(np.nanmedian(np.abs(numbers.to_numpy())))
    unit, words = next((u, w) for limit, u, w in EPOCH_UNITS if magnitude < limit)
    scale = {"s": 1.0, "ms": 1e3, "us": 1e6, "ns": 1e9}[unit]
    seconds = numbers.to_numpy() / scale
    if seconds.min() < 0 or seconds.max() > 4102444800:  # 2100-01-01: a mixed column or another unit
        raise DataFileError(
            f"timestamp: read as {words} (values around {magnitude:.3g}), some fall outside 1970-2100 "
            f"(min {numbers.min():.6g}, max {numbers.max():.6g}); give one unit for the whole column"
        )
    parsed = pd.Series(pd.to_datetime(np.round(seconds * 1e6).astype("int64"), unit="us", utc=True), index=numbers.index)
    return parsed, f"timestamps: {words} (detected from values around {magnitude:.3g})" + _range(parsed)


def _localize(values: pd.Series, tz: ZoneInfo | None, what: str) -> tuple[pd.Series, str]:
    if tz is None:
        raise DataFileError(
            f"timestamp: {what} (e.g. {_examples(values.astype(str))}); give --timezone ZONE (e.g. UTC or "
            "Europe/Brussels) to say whose local time they are"
        )
    # Autumn's repeated hour is read as standard time, spring's missing hour moved
    # forward: a real file holds both, and refusing them would refuse every year.
    standard = np.zeros(len(values), dtype=bool)
    local = values.dt.tz_localize(tz, ambiguous=standard, nonexistent="shift_forward")
    parsed = local.dt.tz_convert("UTC")
    return parsed, f"timestamps: {what}, read as {tz.key} local time and converted to UTC" + _range(parsed)


def _refuse_unparsed(text: pd.Series, parsed: pd.Series) -> None:
    bad = parsed.isna()
    if bad.any():
        raise DataFileError(
            f"timestamp: {int(bad.sum()):,} rows are neither epoch seconds or milliseconds nor ISO-8601 "
            f"(e.g. {_examples(text[bad])}); write them as e.g. 2026-12-01T14:03:00Z"
        )


def _range(parsed: pd.Series) -> str:
    return f", {parsed.min():%Y-%m-%d %H:%M} to {parsed.max():%Y-%m-%d %H:%M} UTC"


def parse_labels(values: pd.Series) -> pd.Series:
    """0/1 from 0/1, booleans, or the words true/false and fraud/legit (any case)."""
    if values.isna().any():
        raise DataFileError(f"label: {int(values.isna().sum()):,} rows have none; drop them or label them")
    if pd.api.types.is_bool_dtype(values):
        return values.astype(np.int8)
    if pd.api.types.is_numeric_dtype(values):
        bad = ~values.isin([0, 1])
        if bad.any():
            raise DataFileError(f"label: {int(bad.sum()):,} rows are not 0 or 1 (e.g. {_examples(values[bad])}); "
                                "use 0/1, true/false or fraud/legit")  # fmt: skip
        return values.astype(np.int8)
    words = values.astype(str).str.strip().str.lower()
    words = words.str.replace(r"^(\d)\.0$", r"\1", regex=True)  # "1.0" from a float column written as text
    mapped = words.map(LABEL_WORDS)
    bad = mapped.isna()
    if bad.any():
        raise DataFileError(f"label: {int(bad.sum()):,} rows are not 0/1, true/false or fraud/legit "
                            f"(e.g. {_examples(values[bad])}); map them to one of those")  # fmt: skip
    return mapped.astype(np.int8)


def check_currencies(values: pd.Series) -> pd.Series:
    """Upper-cased codes; no code reads as USD; a code without a rate is refused
    (converting it at 1.0 would put its amounts on the wrong scale)."""
    codes = values.astype(object).where(values.notna(), "USD").astype(str).str.strip().str.upper()
    unknown = codes[~codes.isin(list(CURRENCY_TO_USD))]
    if len(unknown):
        counts = unknown.value_counts()
        listed = ", ".join(f"{code} ({n:,})" for code, n in counts.head(5).items())
        raise DataFileError(
            f"currency: {len(unknown):,} rows in codes without a rate: {listed}; known: "
            f"{', '.join(CURRENCY_TO_USD)}; convert those amounts or add the rate to CURRENCY_TO_USD (app/contract.py)"
        )
    return codes


def _examples(values: pd.Series, n: int = 3) -> str:
    return ", ".join(repr(v) for v in pd.unique(values.astype(str))[:n])
