"""The model registry: ``<registry>/<version>/`` with a manifest and checksums.

Layout of a version::

    member_<name>.ubj  one UBJSON booster per member
    manifest.json      feature names, members (file, weight, features, params),
                       combination (how margins become the score; absent in
                       versions before stacking: the weighted mean of
                       probabilities), thresholds, metrics, data window,
                       sha256 of every file
    report/            evaluation.json, curves.png (ROC and precision-recall),
                       daily_card_precision.png, reliability.png,
                       test_scores.parquet

``<registry>/CURRENT`` names the version served when none is asked for. Only
:func:`models.lifecycle.promote` (and rollback) moves it: registering a version
never serves it, and a registry without ``CURRENT`` serves nothing rather than
its newest version, so no training run changes what running workers decide.
Loading verifies every checksum and that the manifest's feature set is the one
this code computes, before any model file is parsed. Never pickle: unpickling
runs code and is not stable across versions.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import xgboost as xgb

from app.errors import ModelIntegrityError, ModelNotFound
from models.combination import Combination
from models.compiled import compile_in_background
from models.ensemble import Member, XGBoostEnsemble
from pipeline.features import FEATURE_NAMES, FEATURE_SET_VERSION

__all__ = [
    "MemberArtifact",
    "current_version",
    "list_versions",
    "load_ensemble",
    "new_version_name",
    "read_manifest",
    "save_version",
    "set_current",
    "sha256_file",
]

MANIFEST = "manifest.json"
CURRENT = "CURRENT"


@dataclass
class MemberArtifact:
    name: str
    booster: xgb.Booster
    weight: float
    feature_names: Sequence[str]
    params: dict[str, Any]


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def new_version_name() -> str:
    return time.strftime("v%Y%m%d-%H%M%S", time.gmtime())


def save_version(
    registry: Path,
    version: str,
    members: Sequence[MemberArtifact],
    *,
    thresholds: dict[str, float],
    metrics: dict[str, Any],
    data_window: dict[str, Any],
    extra_files: Sequence[Path] = (),
    timezone: str = "UTC",
    combination: Combination | None = None,
) -> Path:
    """Write a version (registered, not served); ``extra_files`` (already inside
    the version folder) are checksummed too."""
    folder = registry / version
    if (folder / MANIFEST).exists():
        raise FileExistsError(f"{folder} is already registered; versions are immutable")
    folder.mkdir(parents=True, exist_ok=True)
    entries = []
    for member in members:
        filename = f"member_{member.name}.ubj"
        member.booster.save_model(folder / filename)
        entries.append(
            {
                "name": member.name,
                "file": filename,
                "weight": member.weight,
                "features": list(member.feature_names),
                "params": member.params,
            }
        )
    files = [folder / str(e["file"]) for e in entries] + [Path(p) for p in extra_files]
    manifest = {
        "version": version,
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "feature_set": FEATURE_SET_VERSION,
        "feature_names": list(FEATURE_NAMES),
        "timezone": timezone,  # night/weekend features read this zone's wall clock
        "members": entries,
        # How the members' margins become the score (absent: the weighted mean of probabilities).
        **({"combination": combination.to_manifest([m.name for m in members])} if combination else {}),
        "thresholds": thresholds,
        "metrics": metrics,
        "data_window": data_window,
        "sha256": {str(p.relative_to(folder)): sha256_file(p) for p in files},
    }
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=False) + "\n")
    return folder


def set_current(registry: Path, version: str) -> None:
    if not (registry / version / MANIFEST).is_file():
        raise ModelNotFound(registry, version)
    tmp = registry / f".{CURRENT}.tmp"
    tmp.write_text(version + "\n")
    os.replace(tmp, registry / CURRENT)  # atomic: a reader sees old or new


def list_versions(registry: Path) -> list[str]:
    if not registry.is_dir():
        return []
    return sorted(p.name for p in registry.iterdir() if (p / MANIFEST).is_file())


def current_version(registry: Path) -> str:
    """The served version. Without ``CURRENT`` nothing serves, even if versions
    are registered: guessing (say, the newest) would serve a model nobody promoted."""
    pointer = registry / CURRENT
    if pointer.is_file():
        version = pointer.read_text().strip()
        if version:
            return version
    versions = list_versions(registry)
    if not versions:
        raise ModelNotFound(registry, None)
    raise ModelNotFound(
        registry, None,
        hint=f"no version serves yet ({len(versions)} registered); promote one: "
        f"`fraud-pipeline models promote {versions[-1]}`",
    )


def read_manifest(registry: Path, version: str | None = None) -> dict[str, Any]:
    version = version or current_version(registry)
    path = registry / version / MANIFEST
    if not path.is_file():
        raise ModelNotFound(registry, version)
    try:
        manifest: dict[str, Any] = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ModelIntegrityError(path, f"manifest is not valid JSON: {exc}") from None
    return manifest


def verify(folder: Path, manifest: dict[str, Any]) -> None:
    """Every file the manifest lists exists and matches its sha256."""
    if manifest.get("feature_set") != FEATURE_SET_VERSION:
        raise ModelIntegrityError(
            folder, f"feature set {manifest.get('feature_set')!r}, this code computes {FEATURE_SET_VERSION!r}"
        )
    unknown = [
        name for m in manifest["members"] for name in m["features"] if name not in FEATURE_NAMES
    ]
    if unknown:
        raise ModelIntegrityError(folder, f"features this code does not compute: {sorted(set(unknown))}")
    listed = manifest.get("sha256", {})
    for member in manifest["members"]:
        if member["file"] not in listed:
            raise ModelIntegrityError(folder / member["file"], "not listed in the manifest's sha256")
    for name, expected in listed.items():
        path = folder / name
        if not path.is_file():
            raise ModelIntegrityError(path, "file is missing")
        actual = sha256_file(path)
        if actual != expected:
            raise ModelIntegrityError(path, f"sha256 {actual[:12]}... != manifest {expected[:12]}...")


def load_ensemble(
    registry: Path,
    version: str | None = None,
    *,
    warm_up: bool = True,
    threads: int = 1,
    compiled_dir: Path | None = None,
) -> XGBoostEnsemble:
    """Verify, load and (by default) warm up a version; with ``compiled_dir``,
    its trees compiled to C are attached from there, or once built in the
    background (models/compiled.py)."""
    manifest = read_manifest(registry, version)
    folder = registry / manifest["version"]
    verify(folder, manifest)
    members = []
    for entry in manifest["members"]:
        booster = xgb.Booster()
        try:
            booster.load_model(folder / entry["file"])
        except xgb.core.XGBoostError as exc:
            raise ModelIntegrityError(folder / entry["file"], f"XGBoost cannot load it: {exc}") from None
        if booster.num_features() != len(entry["features"]):
            raise ModelIntegrityError(
                folder / entry["file"],
                f"model takes {booster.num_features()} features, manifest lists {len(entry['features'])}",
            )
        members.append(Member(entry["name"], booster, float(entry["weight"]), tuple(entry["features"])))
    ensemble = XGBoostEnsemble(
        manifest["version"], members, threads=threads, thresholds=manifest.get("thresholds"),
        timezone=manifest.get("timezone", "UTC"),  # versions from before the field: UTC, as they were trained
        combination=Combination.from_manifest(manifest.get("combination"), manifest["members"]),
    )
    if compiled_dir is not None and ensemble.merged is not None:
        compile_in_background(ensemble.merged, compiled_dir, ensemble.use_compiled)
    if warm_up:
        ensemble.warm_up()
    return ensemble
