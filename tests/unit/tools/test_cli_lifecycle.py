"""`models` and `rules` commands, in process: what they print, log and refuse.

The documented command lines (README, docs/operations.md, docs/feedback-loop.md)
are the ones run here, so the docs and the CLI cannot drift apart.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from app.settings import get_settings
from models import lifecycle
from models.registry import current_version, read_manifest
from tools.cli import main

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture()
def env(trained_registry: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, Any]]:
    """A registry with the trained (served) version and a second, registered one; a served rules file."""
    registry = tmp_path / "registry"
    shutil.copytree(trained_registry, registry)
    first = current_version(registry)
    second = "v29991231-000000"
    shutil.copytree(registry / first, registry / second)
    manifest = read_manifest(registry, second)
    manifest["version"] = second
    (registry / second / "manifest.json").write_text(json.dumps(manifest))
    rules = tmp_path / "rules.json"
    rules.write_text(json.dumps(_rules("r-1")))
    monkeypatch.setenv("FRAUD_REGISTRY_DIR", str(registry))
    monkeypatch.setenv("FRAUD_RULES_PATH", str(rules))
    monkeypatch.setenv("USER", "cli-test")
    get_settings.cache_clear()
    yield {"registry": registry, "first": first, "second": second, "rules": rules, "tmp": tmp_path}
    get_settings.cache_clear()


def _rules(version: str) -> dict[str, Any]:
    return {"version": version, "thresholds": {"review": 0.5, "decline": 0.9},
            "force_review_amount_usd": 10000, "degraded_review_amount_usd": 1000}  # fmt: skip


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def _line(out: str) -> dict[str, Any]:
    entry: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    assert set(entry) >= {"at", "action", "kind", "version", "previous", "by", "reason"}
    return entry


def test_models_commands_as_documented_log_every_field(env: dict[str, Any], capsys: pytest.CaptureFixture[str]) -> None:
    first, second = env["first"], env["second"]
    rc, out, _ = _run(capsys, "models", "shadow", second, "--reason", "compare live")
    assert rc == 0 and _line(out) | {"at": None} == {"at": None, "action": "shadow", "kind": "model",
                                                     "version": second, "previous": None, "by": "cli-test",
                                                     "reason": "compare live"}  # fmt: skip
    rc, out, _ = _run(capsys, "models", "list")
    assert re.search(rf"^{first}\s+serving", out, re.M) and re.search(rf"^{second}\s+shadow", out, re.M)
    rc, out, _ = _run(capsys, "models", "shadow", "off")
    assert rc == 0 and (_line(out)["version"], _line(out)["previous"]) == (None, second)
    rc, out, _ = _run(capsys, "models", "promote", second, "--reason", "better AP", "--by", "alice")
    assert rc == 0 and (_line(out)["previous"], _line(out)["by"], _line(out)["reason"]) == (first, "alice", "better AP")
    rc, out, _ = _run(capsys, "models", "rollback", "--reason", "alerts")
    assert rc == 0 and (_line(out)["version"], _line(out)["replaced"], _line(out)["reason"]) == (first, second, "alerts")
    assert current_version(env["registry"]) == first


def test_models_commands_refuse_what_would_change_nothing(env: dict[str, Any], capsys: pytest.CaptureFixture[str]) -> None:
    before = lifecycle.history(env["registry"])
    rc, _, err = _run(capsys, "models", "shadow", env["first"])
    assert rc == 2 and "is the served version" in err
    rc, _, err = _run(capsys, "models", "promote", env["first"])
    assert rc == 2 and "already serves" in err
    rc, _, err = _run(capsys, "models", "promote")
    assert rc == 2 and "give the version" in err
    with pytest.raises(SystemExit):
        main(["models", "off"])  # not a command: `models shadow off` is
    assert lifecycle.history(env["registry"]) == before


def test_a_serving_version_this_code_cannot_load_is_replaced_only_by_serve_if_none(
    env: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    """After a feature-set change the serving version would stop every worker:
    `models check` says so, and `train --serve-if-none` (make demo, make bench)
    promotes the new version with the reason logged; plain training still does not."""
    from tools.cli import _serve_or_say

    registry, first, second = env["registry"], env["first"], env["second"]
    rc, out, _ = _run(capsys, "models", "check")
    assert rc == 0 and f"{first} serves and loads with this code" in out
    manifest = read_manifest(registry, first)
    manifest["feature_set"] = "fs0"
    (registry / first / "manifest.json").write_text(json.dumps(manifest))
    rc, _, err = _run(capsys, "models", "check")
    assert rc == 1 and "feature set 'fs0'" in err
    _serve_or_say(registry, second, serve_if_none=False)
    assert current_version(registry) == first and "still serves" in capsys.readouterr().out
    _serve_or_say(registry, second, serve_if_none=True)
    assert current_version(registry) == second
    entry = lifecycle.history(registry)[-1]
    assert entry["action"] == "promote" and entry["previous"] == first
    assert "cannot be served by this code" in entry["reason"] and "fs0" in entry["reason"]
    assert _run(capsys, "models", "check")[0] == 0


def test_models_list_on_an_empty_registry_says_it_is_empty(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("FRAUD_REGISTRY_DIR", str(tmp_path / "empty"))
    get_settings.cache_clear()
    try:
        rc, out, _ = _run(capsys, "models", "list")
    finally:
        get_settings.cache_clear()
    assert rc == 0 and "holds no model version" in out and "train" in out


def test_rules_promote_validates_replaces_and_logs_like_models_promote(
    env: dict[str, Any], capsys: pytest.CaptureFixture[str]
) -> None:
    bad = env["tmp"] / "bad.json"
    bad.write_text(json.dumps({**_rules("r-bad"), "thresholds": {"review": 0.9, "decline": 0.5}}))
    before = lifecycle.history(env["registry"])
    rc, _, err = _run(capsys, "rules", "promote", str(bad))
    assert rc == 2 and err.count("\n") == 1 and json.loads(env["rules"].read_text())["version"] == "r-1"
    assert lifecycle.history(env["registry"]) == before
    good = env["tmp"] / "good.json"
    good.write_text(json.dumps(_rules("r-2")))
    rc, out, _ = _run(capsys, "rules", "promote", str(good), "--reason", "fewer false declines")
    entry = _line(out)
    assert rc == 0 and {k: entry[k] for k in ("action", "kind", "version", "previous", "by", "reason")} == {
        "action": "promote", "kind": "rules", "version": "r-2", "previous": "r-1", "by": "cli-test",
        "reason": "fewer false declines",
    }  # fmt: skip
    assert json.loads(env["rules"].read_text())["version"] == "r-2"
    assert lifecycle.history(env["registry"])[-1] == entry


def _documented_lifecycle_commands() -> list[str]:
    """`models ...` / `rules ...` command lines in README.md and docs/*.md, the
    README's `a\\|b V` alternatives spelled out one by one."""
    found: list[str] = []
    for doc in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        text = doc.read_text()
        for line in re.findall(r"^fraud-pipeline ((?:models|rules) [^#\n]*)", text, re.M):
            found.append(line.strip())
        for cell in re.findall(r"`(?:fraud-pipeline )?((?:models|rules) [^`]*\\\|[^`]*)`", text):
            command, _, rest = cell.partition(" ")
            rest = re.sub(r"\s*\[[^\]]*\]", "", rest)
            found += [f"{command} {alt.strip()}" for alt in rest.split("\\|")]
    return found


def test_every_documented_lifecycle_command_parses() -> None:
    import shlex

    from tools.cli import build_parser

    commands = _documented_lifecycle_commands()
    assert "models shadow off" in commands and "models rollback" in commands
    for line in commands:
        argv = [re.sub(r"^(V|VERSION|FILE)$", "x", a) for a in shlex.split(line)]
        if argv[:2] == ["rules", "backtest"] or argv[:2] == ["rules", "promote"]:
            argv += [] if len(argv) > 2 else ["rules.json"]
        args = build_parser().parse_args(argv)  # SystemExit (a test failure) if the CLI rejects it
        assert args.command in ("models", "rules"), line


@pytest.mark.parametrize("env_user", [None, "carol"])
def test_a_promotion_without_by_is_logged_under_the_os_user(
    monkeypatch: pytest.MonkeyPatch, env_user: str | None
) -> None:
    """`make demo` runs without $USER (a container, a recipe): the log said "unknown"."""
    import os
    import pwd

    for name in ("LOGNAME", "USER", "LNAME", "USERNAME"):
        monkeypatch.delenv(name, raising=False)
    if env_user:
        monkeypatch.setenv("LOGNAME", env_user)
    assert lifecycle.who(None) == (env_user or pwd.getpwuid(os.getuid()).pw_name)
    assert lifecycle.who("alice") == "alice"


def test_train_serve_if_none_logs_the_operator_of_by(env: dict[str, Any], capsys: pytest.CaptureFixture[str]) -> None:
    from tools.cli import _serve_or_say, build_parser

    registry, second = env["registry"], env["second"]
    (registry / "CURRENT").unlink()  # a fresh registry: nothing serves
    args = build_parser().parse_args(["train", "--serve-if-none", "--by", "alice"])
    _serve_or_say(registry, second, args.serve_if_none, by=args.by)
    entry = lifecycle.history(registry)[-1]
    assert (entry["action"], entry["version"], entry["by"]) == ("promote", second, "alice")
