"""`train --data FILE`: each input format read as meant, each refusal one line naming the column and the fix."""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from app.settings import get_settings
from models.registry import list_versions, read_manifest
from pipeline.datafile import DataFileError, read_transactions
from pipeline.features import prepare_history
from tools.cli import main

NOON = datetime(2026, 7, 1, 12, 0, tzinfo=UTC)


def _frame(n: int = 4, **columns: object) -> pd.DataFrame:
    base: dict[str, object] = {
        "transaction_id": [f"t{i}" for i in range(n)],
        "user_id": ["u1", "u2"] * (n // 2),
        "merchant_id": "m1",
        "amount": [10.0 + i for i in range(n)],
        "timestamp": [NOON.timestamp() + 60 * i for i in range(n)],
        "label": [0, 1] * (n // 2),
    }
    base.update(columns)
    return pd.DataFrame(base)


def _write(frame: pd.DataFrame, path: Path) -> Path:
    if path.suffix == ".parquet":
        frame.to_parquet(path)
    else:
        frame.to_csv(path, index=False)
    return path


def _refusal(path: Path, match: str, **kwargs: str) -> str:
    with pytest.raises(DataFileError, match=match) as info:
        read_transactions(path, **kwargs)  # type: ignore[arg-type]
    message = str(info.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize("suffix", [".csv", ".parquet"])
@pytest.mark.parametrize(
    ("stamps", "words"),
    [
        ([int(NOON.timestamp()) + 60 * i for i in range(4)], "epoch seconds"),
        ([int(NOON.timestamp() * 1000) + 60_000 * i for i in range(4)], "epoch milliseconds"),
        ([f"2026-07-01T12:0{i}:00Z" for i in range(4)], "ISO-8601 with a UTC offset"),
        ([f"2026-07-01T14:0{i}:00+02:00" for i in range(4)], "ISO-8601 with a UTC offset"),
    ],
)
def test_timestamps_are_read_in_their_unit_and_the_unit_is_stated(
    tmp_path: Path, suffix: str, stamps: list[object], words: str
) -> None:
    data = read_transactions(_write(_frame(timestamp=stamps), tmp_path / f"tx{suffix}"))
    assert data.frame["timestamp"].iloc[0] == pd.Timestamp(NOON)
    assert data.frame["timestamp"].iloc[1] == pd.Timestamp(NOON) + pd.Timedelta(minutes=1)
    assert any(words in note and "2026-07-01 12:00" in note for note in data.notes), data.notes


def test_naive_times_need_a_timezone_and_are_read_as_its_local_time(tmp_path: Path) -> None:
    path = _write(_frame(timestamp=[f"2026-07-01 14:0{i}:00" for i in range(4)]), tmp_path / "naive.csv")
    message = _refusal(path, "timestamp: ISO-8601 without a UTC offset")
    assert "--timezone" in message
    data = read_transactions(path, timezone="Europe/Brussels")  # CEST, UTC+2 in July
    assert data.frame["timestamp"].iloc[0] == pd.Timestamp(NOON)
    assert any("Europe/Brussels local time" in note for note in data.notes)
    _refusal(path, "--timezone 'Mars/Olympus'", timezone="Mars/Olympus")
    naive_parquet = _write(_frame(timestamp=pd.to_datetime([f"2026-07-01 14:0{i}" for i in range(4)])),
                           tmp_path / "naive.parquet")  # fmt: skip
    _refusal(naive_parquet, "date-times without a time zone.*--timezone")
    assert read_transactions(naive_parquet, timezone="Europe/Brussels").frame["timestamp"].iloc[0] == pd.Timestamp(NOON)


@pytest.mark.parametrize(
    "labels",
    [[0, 1, 0, 1], [False, True, False, True], ["legit", "fraud", "legit", "fraud"], ["Legit", "FRAUD", "0", "1"],
     ["false", "true", "False", "True"]],
)  # fmt: skip
@pytest.mark.parametrize("suffix", [".csv", ".parquet"])
def test_labels_as_01_booleans_or_words(tmp_path: Path, labels: list[object], suffix: str) -> None:
    data = read_transactions(_write(_frame(label=labels), tmp_path / f"labels{suffix}"))
    assert data.frame["label"].tolist() == [0, 1, 0, 1] and data.frame["label"].dtype == np.int8


@pytest.mark.parametrize(
    ("column", "value", "match"),
    [
        ("label", ["legit", "maybe", "fraud", "legit"], r"label: 1 rows are not 0/1, true/false or fraud/legit \(e.g. 'maybe'\)"),
        ("label", [0, 2, 1, 0], "label: 1 rows are not 0 or 1"),
        ("label", [0, None, 1, 0], "label: 1 rows have none"),
        ("timestamp", ["2026-07-01T12:00:00Z", "yesterday", "2026-07-01T12:02:00Z", "2026-07-01T12:03:00Z"],
         "timestamp: .*offset.*--timezone"),
        ("timestamp", ["2026-07-01T12:00:00Z", "2026-07-01T12:01:00Z", "2026-07-01 14:02", "2026-07-01T12:03:00Z"],
         "timestamp: 3 rows carry a UTC offset and 1 do not"),
        ("timestamp", [1.7e9, 1.7e9, 1.7e12, 1.7e9], "timestamp: read as epoch seconds .* outside 1970-2100"),
        ("amount", ["10", "ten", "12", "13"], "amount: 1 rows are not a number"),
        ("user_id", ["u1", None, "u1", "u2"], "user_id: 1 rows have none"),
    ],
)  # fmt: skip
def test_each_refusal_is_one_line_naming_the_column(tmp_path: Path, column: str, value: list[object], match: str) -> None:
    _refusal(_write(_frame(**{column: value}), tmp_path / "bad.csv"), match)


def test_unknown_currencies_are_refused_with_the_known_codes_and_the_row_count(tmp_path: Path) -> None:
    path = _write(_frame(currency=["EUR", "XYZ", "usd", "XYZ"]), tmp_path / "fx.csv")
    message = _refusal(path, r"currency: 2 rows in codes without a rate: XYZ \(2\)")
    assert "known: USD, EUR, GBP" in message and "CURRENCY_TO_USD" in message
    with pytest.raises(DataFileError, match="XYZ"):
        prepare_history(_frame(currency=["EUR", "XYZ", "USD", "USD"]))  # never converted at 1.0
    ok = read_transactions(_write(_frame(currency=["EUR", None, "usd", "GBP"]), tmp_path / "fx-ok.csv"))
    assert ok.frame["currency"].tolist() == ["EUR", "USD", "USD", "GBP"]


def test_missing_columns_required_refused_optional_noted(tmp_path: Path) -> None:
    message = _refusal(_write(_frame().drop(columns=["merchant_id"]), tmp_path / "no-merchant.csv"),
                       "no 'merchant_id' column")  # fmt: skip
    assert "rename" in message
    data = read_transactions(_write(_frame(), tmp_path / "bare.csv"))
    assert any("every amount is read as USD" in n for n in data.notes)
    assert any("optional columns absent: device_id, lat, lon" in n for n in data.notes)
    _refusal(_write(_frame(), tmp_path / "tx.xlsx"), r"\.xlsx is not read; give Parquet")


def test_prepare_history_reads_epoch_seconds_as_seconds() -> None:
    history = prepare_history(_frame(timestamp=[int(NOON.timestamp()) + i for i in range(4)]))
    assert history["ts"].tolist() == [NOON.timestamp() + i for i in range(4)]


@pytest.fixture()
def registry(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    monkeypatch.setenv("FRAUD_REGISTRY_DIR", str(tmp_path / "registry"))
    get_settings.cache_clear()
    yield tmp_path / "registry"
    get_settings.cache_clear()


def test_train_on_a_csv_with_epoch_seconds_words_and_a_train_start(
    sim_frame: pd.DataFrame, registry: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    csv = sim_frame.drop(columns=["scenario"]).assign(
        timestamp=sim_frame["timestamp"].map(lambda t: int(t.timestamp())),
        label=sim_frame["label"].map({0: "legit", 1: "fraud"}),
    )
    path = _write(csv, tmp_path / "export.csv")
    start = (sim_frame["timestamp"].min().normalize() + pd.Timedelta(days=15)).date().isoformat()
    rc = main(["train", "--data", str(path), "--quiet", "--train-start", start, "--rounds-scale", "0.2"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert "timestamps: epoch seconds" in out and "not serving" in out and "alert rate" in out
    [version] = list_versions(registry)
    manifest = read_manifest(registry, version)
    assert manifest["data_window"]["train"][0] == f"{start}T00:00:00+00:00"
    assert [m["params"]["rounds"] for m in manifest["members"]] == [30, 30, 1, 30]  # 150 x 0.2; the forest: one round
    rc = main(["train", "--data", str(path), "--quiet", "--train-start", "2020-01-01"])
    out, err = capsys.readouterr()
    assert rc == 2 and err.count("\n") == 1 and "--train-start" in err and list_versions(registry) == [version]
    bad = _write(csv.assign(currency="XYZ"), tmp_path / "bad.csv")
    rc = main(["train", "--data", str(bad), "--quiet"])
    _, err = capsys.readouterr()
    assert rc == 2 and err.count("\n") == 1 and "currency:" in err
    json.dumps(manifest)  # the manifest stays plain JSON
