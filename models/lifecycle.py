"""Promotion, rollback and shadow: which version serves, who said so, and when.

The control path is the registry folder itself, watched by every worker
(:mod:`agents.reload`):

    <registry>/CURRENT            the version that decides (atomic rename)
    <registry>/SHADOW             the version scored alongside it, never deciding (absent: none)
    <registry>/promotions.jsonl   one JSON line per change: at, action, kind,
                                  version, previous, by, reason (every line, every action)

Only :func:`promote` and :func:`rollback` change what decides; training
registers a version and serves nothing (:mod:`models.registry`). A change that
would change nothing is refused rather than logged, so the log never claims a
version replaced itself: promoting the served version, shadowing it.

Rules go the same way: ``rules promote FILE`` validates the file, replaces the
served rules file atomically and logs a line here; workers reload it between
batches. The pointer moves first, then the log line is appended: the pointer is
the truth and the log its history, so a crash between the two leaves a change
without its line, never a line for a change that did not happen.
"""

from __future__ import annotations

import getpass
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any

from app.errors import ModelError, ModelNotFound
from models.registry import current_version, list_versions, read_manifest, set_current, verify
from pipeline.rules import load_rules

__all__ = ["history", "promote", "promote_rules", "rollback", "set_shadow", "shadow_version"]

PROMOTIONS = "promotions.jsonl"
SHADOW = "SHADOW"


def _now_iso() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def who(by: str | None) -> str:
    """The operator a change is logged under: ``by`` (``--by``), else the OS user.

    NOTE: the OS user, not only ``$USER``: containers and ``make`` recipes run
    without it (the demo's promotion was logged as "unknown"). ``getpass`` reads
    ``LOGNAME``/``USER``/``LNAME``/``USERNAME``, then the password database; a uid
    without an entry there is logged as ``uid <n>``.
    """
    if by:
        return by
    try:
        return getpass.getuser()
    except (KeyError, OSError):  # no name for this uid (a container's arbitrary uid)
        return f"uid {os.getuid()}"


def _log(registry: Path, entry: dict[str, Any]) -> dict[str, Any]:
    entry = {"at": _now_iso(), **entry}
    with open(registry / PROMOTIONS, "a", encoding="utf-8") as fh:
        fh.write(json.dumps(entry, sort_keys=False) + "\n")
    return entry


def history(registry: Path) -> list[dict[str, Any]]:
    path = registry / PROMOTIONS
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _checked(registry: Path, version: str) -> None:
    """Refuse a version that a worker would refuse: missing, bad checksum, other feature set."""
    if version not in list_versions(registry):
        raise ModelNotFound(registry, version)
    verify(registry / version, read_manifest(registry, version))


def _entry(action: str, kind: str, version: str | None, previous: str | None, by: str | None,
           reason: str | None, **extra: Any) -> dict[str, Any]:
    """One log line's fields, always all of them (``None`` where there is nothing)."""
    return {"action": action, "kind": kind, "version": version, "previous": previous, "by": who(by),
            "reason": reason, **extra}


def promote(registry: Path, version: str, *, by: str | None = None, reason: str | None = None) -> dict[str, Any]:
    """Make ``version`` the deciding model; returns the log entry."""
    _checked(registry, version)
    previous = _current_or_none(registry)
    if previous == version:
        raise ModelError(f"{registry}: {version} already serves; nothing to promote")
    set_current(registry, version)
    if shadow_version(registry) == version:  # the shadow became the model: nothing left to compare
        (registry / SHADOW).unlink(missing_ok=True)
    return _log(registry, _entry("promote", "model", version, previous, by, reason))


def rollback(registry: Path, *, by: str | None = None, reason: str | None = None) -> dict[str, Any]:
    """Serve the version that the current one replaced (per the log)."""
    current = _current_or_none(registry)
    entries = [e for e in history(registry) if e.get("kind", "model") == "model" and e["action"] in ("promote", "rollback")]
    previous = next((e.get("previous") for e in reversed(entries) if e["version"] == current), None)
    if not previous or previous == current:
        raise ModelError(f"{registry}: no promotion of {current} replaced another version in {PROMOTIONS}, "
                         "so nothing to roll back to")  # fmt: skip
    _checked(registry, previous)
    set_current(registry, previous)
    # A rollback's "previous" is what the version it restored had replaced, so
    # two rollbacks walk further back instead of flipping between two versions.
    before = next((e.get("previous") for e in reversed(entries) if e["version"] == previous), None)
    return _log(registry, _entry("rollback", "model", previous, before, by, reason, replaced=current))


def shadow_version(registry: Path) -> str | None:
    pointer = registry / SHADOW
    if not pointer.is_file():
        return None
    return pointer.read_text().strip() or None


def set_shadow(
    registry: Path, version: str | None, *, by: str | None = None, reason: str | None = None
) -> dict[str, Any]:
    """Score ``version`` alongside the served model (None stops the shadow).

    ``previous`` in the log line is the shadow it replaced. Shadowing the served
    version is refused: a worker compares nothing with itself and would ignore it.
    """
    previous = shadow_version(registry)
    if version is None:
        if previous is None:
            raise ModelError(f"{registry}: no version is shadowed; nothing to stop")
        (registry / SHADOW).unlink(missing_ok=True)
    else:
        _checked(registry, version)
        if version == _current_or_none(registry):
            raise ModelError(f"{registry}: {version} is the served version; shadow another one "
                             "(`fraud-pipeline models list` shows them)")  # fmt: skip
        if version == previous:
            raise ModelError(f"{registry}: {version} is already the shadow")
        served = _current_or_none(registry)
        zones = {v: read_manifest(registry, v).get("timezone", "UTC") for v in (version, served) if v}
        if len(set(zones.values())) > 1:  # a shadow scores the served model's feature rows
            raise ModelError(f"{registry}: {version}'s night/weekend features read {zones[version]} time, the served "
                             f"{served}'s {zones[served or '']}; a shadow must share the served model's zone")  # fmt: skip
        tmp = registry / f".{SHADOW}.tmp"
        tmp.write_text(version + "\n")
        os.replace(tmp, registry / SHADOW)
    return _log(registry, _entry("shadow", "model", version, previous, by, reason))


def promote_rules(
    registry: Path, source: Path, served: Path, *, by: str | None = None, reason: str | None = None
) -> dict[str, Any]:
    """Validate ``source`` and make it the served rules file (atomic replace)."""
    new = load_rules(source)  # raises RulesError: the served file is left alone
    previous = load_rules(served).version if served.is_file() else None
    tmp = served.with_name(f".{served.name}.tmp")
    shutil.copyfile(source, tmp)
    os.replace(tmp, served)
    return _log(registry, _entry("promote", "rules", new.version, previous, by, reason, file=str(served)))


def _current_or_none(registry: Path) -> str | None:
    try:
        return current_version(registry)
    except ModelNotFound:
        return None


def serving_problem(registry: Path) -> tuple[str | None, str | None]:
    """(the serving version, why a worker would refuse it): (None, reason) when
    nothing serves, (V, None) when V serves and loads with this code."""
    version = _current_or_none(registry)
    if version is None:
        return None, f"no version serves in {registry}"
    try:
        _checked(registry, version)
    except ModelError as exc:
        return version, str(exc)
    return version, None

