"""`fraud-pipeline`: every subcommand (and sub-subcommand) answers --help."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

import pytest

from tools.cli import build_parser

REPO = Path(__file__).resolve().parents[2]


def _commands(parser: argparse.ArgumentParser, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    out = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                out.append((*prefix, name))
                out += _commands(sub, (*prefix, name))
    return out


COMMANDS = _commands(build_parser())


def test_the_documented_commands_exist() -> None:
    names = {c[0] for c in COMMANDS}
    assert {"simulate", "materialize", "train", "worker", "loadgen", "topics", "keys", "stack", "scale"} <= names
    assert ("scale", "advise") in COMMANDS


@pytest.mark.parametrize("command", COMMANDS, ids=" ".join)
def test_help(command: tuple[str, ...]) -> None:
    """Each runs in a fresh process (as a user would), exits 0 and prints its usage."""
    done = subprocess.run(
        [sys.executable, "-m", "tools.cli", *command, "--help"], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"usage: fraud-pipeline {' '.join(command)}"), done.stdout[:200]
    assert "-h, --help" in done.stdout


def test_top_level_help_lists_every_command() -> None:
    done = subprocess.run([sys.executable, "-m", "tools.cli", "--help"], cwd=REPO, capture_output=True, text=True,
                          timeout=60)  # fmt: skip
    assert done.returncode == 0
    for name in {c[0] for c in COMMANDS}:
        assert name in done.stdout, name
