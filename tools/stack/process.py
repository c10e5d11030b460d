"""The server processes: spawned in their own session, signalled by PID, reaped."""

from __future__ import annotations

import logging
import os
import shlex
import signal
import subprocess
import time
from collections.abc import Sequence
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path

from app.errors import StackError

__all__ = ["STOP_TIMEOUT_S", "ServiceHandle", "pid_alive", "runs", "spawn"]

logger = logging.getLogger(__name__)

#: Kafka's controlled shutdown on SIGTERM takes 1-5 s with clients connected.
STOP_TIMEOUT_S = 30.0

#: Servers this process started, by PID. Polling their Popen reaps them when they
#: exit (a zombie still passes ``kill(pid, 0)``), and holding them keeps Popen from
#: warning that a running child was dropped (``up`` leaves its servers running).
_children: dict[int, subprocess.Popen[bytes]] = {}


@dataclass
class ServiceHandle:
    """A service process started by this module (or named by one of its PID files)."""

    name: str
    pid: int
    url: str
    log_path: Path

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> None:
        """SIGTERM, wait up to ``timeout`` seconds, then SIGKILL. A no-op if it is gone."""
        if not pid_alive(self.pid):
            return
        _signal(self.pid, signal.SIGTERM)
        if _wait_exit(self.pid, timeout):
            return
        logger.warning(
            "%s (pid %d) ignored SIGTERM for %.0f s; killing it", self.name, self.pid, timeout
        )
        _signal(self.pid, signal.SIGKILL)
        if not _wait_exit(self.pid, 5.0):
            raise StackError(f"{self.name} (pid {self.pid}) is still running after SIGKILL")


def pid_alive(pid: int) -> bool:
    """Whether ``pid`` runs. A child of this process that exited is reaped and counts as gone."""
    child = _children.get(pid)
    if child is not None:
        return child.poll() is None
    try:
        reaped, _ = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        reaped = 0  # not our child: its own parent reaps it
    if reaped:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # it exists, owned by another user
    return not _zombie(pid)


def _zombie(pid: int) -> bool:
    """An exited process that its parent (another process) has not reaped yet: gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False  # no /proc (macOS), or it was just reaped
    return stat.rpartition(")")[2].split()[:1] == ["Z"]


def _wait_exit(pid: int, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while pid_alive(pid):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
    return True


def _signal(pid: int, sig: signal.Signals) -> None:
    with suppress(ProcessLookupError):  # it exited in the meantime
        os.kill(pid, sig)


def runs(pid: int, program: str) -> bool:
    """Whether ``pid`` is alive and runs ``program``.

    A PID file can outlive its process and the PID be reused by something else:
    we signal a PID from a file only if its command line still names our program.
    """
    if not pid_alive(pid):
        return False
    proc = Path(f"/proc/{pid}/cmdline")
    if Path("/proc/self").exists():
        try:
            cmdline = proc.read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            return False
    else:  # macOS: no /proc
        result = subprocess.run(
            ["ps", "-o", "command=", "-p", str(pid)], capture_output=True, text=True, check=False
        )
        cmdline = result.stdout
    return program in cmdline


def spawn(
    name: str, argv: Sequence[str], url: str, log_path: Path, env: dict[str, str] | None = None
) -> ServiceHandle:
    """Start ``argv`` with its output in ``log_path`` (cwd: the log's folder); returns at once."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("wb") as log:
        # start_new_session: Ctrl-C in a terminal goes to the foreground process
        # group, so it interrupts the test run or the CLI, not the servers they
        # started mid-test; those are stopped by PID.
        process = subprocess.Popen(
            list(argv),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            cwd=log_path.parent,
            env=env,
        )
    _children[process.pid] = process
    logger.debug("started %s (pid %d): %s", name, process.pid, shlex.join(argv))
    return ServiceHandle(name, process.pid, url, log_path)

