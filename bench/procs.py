"""A process's CPU time and memory, and the machine's description, from ``/proc``: what every bench samples."""

from __future__ import annotations

import os
import platform
import time
from pathlib import Path
from typing import Any

__all__ = ["machine_info", "parse_stat_cpu_s", "parse_status_rss_mb", "proc_cpu_s", "proc_rss_mb"]


def parse_stat_cpu_s(stat: str, clk_tck: int) -> float:
    """User + system CPU seconds from a ``/proc/<pid>/stat`` line.

    The command name (field 2) may hold spaces and parentheses, so fields are
    counted from the last ``)``: utime and stime are fields 14 and 15.
    """
    rest = stat[stat.rindex(")") + 2 :].split()
    return (int(rest[11]) + int(rest[12])) / clk_tck


def parse_status_rss_mb(status: str) -> float | None:
    """Resident set size in MiB from ``/proc/<pid>/status`` (``VmRSS:  1234 kB``)."""
    for line in status.splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return None


_CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def proc_cpu_s(pid: int) -> float | None:
    try:
        return parse_stat_cpu_s(Path(f"/proc/{pid}/stat").read_text(), _CLK_TCK)
    except (OSError, ValueError, IndexError):
        return None


def proc_rss_mb(pid: int) -> float | None:
    try:
        return parse_status_rss_mb(Path(f"/proc/{pid}/status").read_text())
    except OSError:
        return None


def python_loop_ms(rounds: int = 3) -> float:
    """The best of ``rounds`` timings of a fixed pure-Python loop, in ms: this
    machine's speed for the worker's kind of work at that moment. Its speed
    moves by up to 2x over a day, so a run's figures are read beside it."""
    best = float("inf")
    for _ in range(rounds):
        started = time.perf_counter()
        total = 0
        for i in range(1_000_000):
            total += i * i % 7
        best = min(best, time.perf_counter() - started)
    return round(best * 1000, 1)


def machine_info() -> dict[str, Any]:
    model = None
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cores": os.cpu_count(),
        "cpu_model": model or platform.processor() or None,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "load_avg_at_start": list(os.getloadavg()) if hasattr(os, "getloadavg") else None,
        "python_loop_ms_at_start": python_loop_ms(),
    }
