"""`fraud-pipeline`: every subcommand (and sub-subcommand) answers --help."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

from tools.cli import build_parser, main

REPO = Path(__file__).resolve().parents[3]


def _commands(parser: argparse.ArgumentParser, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    out = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                out.append((*prefix, name))
                out += _commands(sub, (*prefix, name))
    return out


COMMANDS = _commands(build_parser())


def _help(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """``main(argv)`` in this process: argparse prints the help and exits 0."""
    with pytest.raises(SystemExit) as exited:
        main(argv)
    out, err = capsys.readouterr()
    assert exited.value.code == 0, err
    return out


def test_the_documented_commands_exist() -> None:
    names = {c[0] for c in COMMANDS}
    assert {"simulate", "materialize", "train", "worker", "loadgen", "topics", "keys", "stack", "scale"} <= names
    assert ("scale", "advise") in COMMANDS


@pytest.mark.parametrize("command", COMMANDS, ids=" ".join)
def test_help(command: tuple[str, ...], capsys: pytest.CaptureFixture[str]) -> None:
    """Each exits 0 and prints its usage."""
    out = _help([*command, "--help"], capsys)
    assert out.startswith(f"usage: fraud-pipeline {' '.join(command)}"), out[:200]
    assert "-h, --help" in out


def test_top_level_help_lists_every_command(capsys: pytest.CaptureFixture[str]) -> None:
    out = _help(["--help"], capsys)
    for name in {c[0] for c in COMMANDS}:
        assert name in out, name


def test_the_module_runs_as_a_command() -> None:
    """One fresh process, as a user would run it: ``python -m tools.cli`` reaches ``main``."""
    done = subprocess.run([sys.executable, "-m", "tools.cli", "--help"], cwd=REPO, capture_output=True, text=True,
                          timeout=60)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: fraud-pipeline"), done.stdout[:200]
