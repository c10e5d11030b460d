"""The stack's state dir: where ``up`` keeps its PID files, logs and ``env``.

``down`` signals only the PIDs these files name, so reading and writing them is
one place's business.
"""

from __future__ import annotations

import os
import shlex
from pathlib import Path

__all__ = [
    "DEFAULT_SECURE_STATE_DIR",
    "DEFAULT_STATE_DIR",
    "pid_path",
    "read_env",
    "read_pid",
    "write_env",
    "write_private",
]

DEFAULT_STATE_DIR = Path(".stack")
#: The secure stack's: its broker's log dir holds SCRAM users, a plaintext one's none,
#: so neither can start on the other's (``make demo`` and ``make demo SECURE=0`` alternate).
DEFAULT_SECURE_STATE_DIR = DEFAULT_STATE_DIR / "secure"


def pid_path(state_dir: Path, name: str) -> Path:
    """Where ``up`` writes the PID of the service ``name``: the only processes ``down`` signals."""
    return state_dir / f"{name}.pid"


def read_pid(path: Path) -> int | None:
    """The PID in ``path``; None if there is no file or it holds no number."""
    try:
        return int(path.read_text().strip())
    except (FileNotFoundError, ValueError):
        return None


def write_env(path: Path, env: dict[str, str]) -> None:
    """``export KEY=value`` lines, quoted for ``eval`` in a shell."""
    path.write_text("".join(f"export {key}={shlex.quote(value)}\n" for key, value in env.items()))


def read_env(path: Path) -> dict[str, str]:
    """The settings :func:`write_env` wrote; empty if there is no file."""
    if not path.exists():
        return {}
    pairs = (
        shlex.split(line)[-1].partition("=")
        for line in path.read_text().splitlines()
        if line.strip()
    )
    return {key: value for key, _, value in pairs}


def write_private(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` readable by the owner only (it may hold passwords)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    path.chmod(0o600)

