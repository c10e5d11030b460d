"""Where the scoring loop's wall time goes under load, from the worker's own
metrics (``python -m bench.phases``; bench/phases.sh runs it).

A py-spy profile (bench/profile.sh) shows where the worker's CPU goes, not
where its loop waits: at saturation the worker used ~70 % of a core while it
fell behind, so most of what limits it is time the loop spends waiting. This
reads two scrapes of the worker's ``/metrics`` taken over a window in the
middle of the load and gives, per loop phase (``fraud_loop_seconds``: take,
score, send, commit), per scoring stage (``fraud_stage_seconds``) and per
Redis round trip (``fraud_redis_round_trip_seconds``), the share of the
window's wall time, the calls per second and the mean. Beside them, how long
Redis itself ran each batch script (``EVALSHA`` in its SLOWLOG), so that a
round trip splits into Redis's part and the worker's (building the call,
reading the reply, waiting for a core).

And the broker's side of the same window: its CPU by thread (``/proc``:
request handlers, network threads, the JIT compiler, the transaction marker
sender) and its requests by type, with the time its request handlers spent
on each (``RequestsPerSec`` and ``LocalTimeMs`` over JMX, read by Kafka's own
``JmxTool``); with ``PHASES_JFR=1``, where its Java threads run (a JDK Flight
Recorder profile of the window, its execution samples by thread and frame:
:func:`jfr_top`). The kernel's share of each thread (its ``stime``) is what
the Java profile cannot see.
"""

from __future__ import annotations

import argparse
import json
import os
import re
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import Any

__all__ = ["broker_requests", "histograms", "jfr_top", "main", "report", "script_ms", "thread_cpu"]

_SAMPLE = re.compile(r"^(fraud_[a-z_]+)_(sum|count)(\{[^}]*\})? ([0-9.eE+-]+)$")
#: The histograms reported, by metric name.
REPORTED = ("fraud_loop_seconds", "fraud_stage_seconds", "fraud_redis_round_trip_seconds", "fraud_kafka_commit_seconds")


def histograms(text: str) -> dict[str, tuple[float, float]]:
    """``{name{labels}: (sum, count)}`` of the reported histograms in a Prometheus scrape."""
    out: dict[str, list[float]] = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line.strip())
        if m is None or m.group(1) not in REPORTED:
            continue
        key = m.group(1) + (m.group(3) or "")
        out.setdefault(key, [0.0, 0.0])[0 if m.group(2) == "sum" else 1] = float(m.group(4))
    return {k: (v[0], v[1]) for k, v in out.items()}


def report(before: str, after: str, wall_s: float) -> dict[str, dict[str, float]]:
    """Per histogram, over the window between the two scrapes: the share of
    ``wall_s`` (a phase's share adds up with the others to the loop's time),
    calls per second and the mean in ms."""
    a, b = histograms(before), histograms(after)
    out: dict[str, dict[str, float]] = {}
    for key, (total, count) in b.items():
        spent, calls = total - a.get(key, (0.0, 0.0))[0], count - a.get(key, (0.0, 0.0))[1]
        if calls > 0:
            out[key] = {
                "share_of_wall": round(spent / wall_s, 4),
                "per_s": round(calls / wall_s, 2),
                "mean_ms": round(spent / calls * 1000, 3),
            }
    return out


def script_ms(slowlog: Iterable[dict[str, Any]]) -> list[float]:
    """The durations (ms) of the EVALSHA calls among SLOWLOG entries
    (``{"duration": µs, "command": "EVALSHA ..."}``, as bench/phases.sh writes them)."""
    return [e["duration"] / 1000.0 for e in slowlog if e["command"].split(" ", 1)[0].lower() == "evalsha"]


_JMX = re.compile(r"^kafka\.network:type=RequestMetrics,name=(RequestsPerSec|LocalTimeMs),request=(\w+)"
                  r"(?:,version=\d+)?:(Count|Mean)=([0-9.eE+-]+)$")


def _jmx(text: str) -> tuple[float | None, dict[str, dict[str, float]]]:
    """JmxTool's properties report: its time (ms) and per request type the
    request count and the local time's sum (ms), versions added up."""
    at: float | None = None
    out: dict[str, dict[str, float]] = {}
    means: dict[str, float] = {}
    counts: dict[str, float] = {}
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("time="):
            at = float(line.split("=", 1)[1])
            continue
        m = _JMX.match(line)
        if m is None:
            continue
        name, request, attribute, value = m.groups()
        if name == "RequestsPerSec" and attribute == "Count":
            row = out.setdefault(request, {"count": 0.0, "local_ms": 0.0})
            row["count"] += float(value)
        elif name == "LocalTimeMs":
            (means if attribute == "Mean" else counts)[request] = float(value)
    for request, mean in means.items():
        out.setdefault(request, {"count": 0.0, "local_ms": 0.0})["local_ms"] = mean * counts.get(request, 0.0)
    return at, out


def broker_requests(before: str, after: str) -> dict[str, dict[str, float]]:
    """Per request type between two JmxTool reports: requests per second, and
    the request handlers' local time (ms) per second and per request. Rates
    are over the reports' own times."""
    t0, a = _jmx(before)
    t1, b = _jmx(after)
    if t0 is None or t1 is None or t1 <= t0:
        return {}
    wall = (t1 - t0) / 1000.0
    out: dict[str, dict[str, float]] = {}
    for request, row in b.items():
        old = a.get(request, {"count": 0.0, "local_ms": 0.0})
        n, local = row["count"] - old["count"], row["local_ms"] - old["local_ms"]
        if n > 0:
            out[request] = {"per_s": round(n / wall, 1), "local_ms_per_s": round(local / wall, 2),
                            "local_us_each": round(local / n * 1000, 1)}  # fmt: skip
    return dict(sorted(out.items(), key=lambda kv: -kv[1]["per_s"]))


#: A thread's number in its name (``GC Thread#1``, ``...-handler-3``), not a
#: name's own digits (``C2 CompilerThread0``: the compiler, C2).
_NUMBERED = re.compile(r"(?<=[#-])[0-9]+|[0-9]+$")


def thread_cpu(before: str, after: str, wall_s: float, ticks_per_s: float, kernel: bool = False) -> dict[str, float]:
    """% of one core per thread name between two listings of a process's
    threads' ``/proc/<pid>/task/<tid>/stat`` lines (utime + stime, or stime
    alone with ``kernel``: the syscalls' share), threads of one name but for
    their numbers added up. The name (``comm``, at most 15 characters) is
    read between the first ``(`` and the last ``)``: it may hold spaces
    ("C2 CompilerThre"), which shift every field a split by spaces would read."""

    def totals(text: str) -> Counter[str]:
        out: Counter[str] = Counter()
        for line in text.splitlines():
            head, close, rest = line.rpartition(")")
            fields = rest.split()
            if not close or len(fields) < 13 or "(" not in head:
                continue
            # after the name: the state is field 3, utime and stime fields 14 and 15
            utime, stime = int(fields[11]), int(fields[12])
            out[_NUMBERED.sub("N", head.partition("(")[2])] += stime if kernel else utime + stime
        return out

    a, b = totals(before), totals(after)
    used = {name: (b[name] - a.get(name, 0)) / ticks_per_s / wall_s * 100 for name in b}
    return {name: round(pct, 1) for name, pct in sorted(used.items(), key=lambda kv: -kv[1]) if pct >= 0.1}


def jfr_top(recording: dict[str, Any], n: int = 15) -> dict[str, Any]:
    """A JDK Flight Recorder profile summed up (``jfr print --json --events
    jdk.ExecutionSample``'s document): the samples' count, their share by
    thread (names less their numbers), by the method they were in (self) and
    by every method on their stack (inclusive), the ``n`` largest of each."""
    events = recording.get("recording", {}).get("events", [])
    threads: Counter[str] = Counter()
    own: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    for event in events:
        values = event.get("values", {})
        thread = (values.get("sampledThread") or {}).get("javaName") or "?"
        threads[_NUMBERED.sub("N", thread)] += 1
        frames = [f["method"]["type"]["name"].replace("/", ".") + "." + f["method"]["name"]
                  for f in (values.get("stackTrace") or {}).get("frames", [])]  # fmt: skip
        if frames:
            own[frames[0]] += 1
            inclusive.update(set(frames))
    total = len(events)

    def shares(counts: Counter[str]) -> dict[str, float]:
        return {name: round(c / total * 100, 1) for name, c in counts.most_common(n)} if total else {}

    return {
        "samples": total,
        "threads_pct": shares(threads),
        "self_pct": shares(own),
        "inclusive_pct": shares(inclusive),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("before", type=Path, help="the first /metrics scrape")
    parser.add_argument("after", type=Path, help="the second one")
    parser.add_argument("--wall", type=float, required=True, help="seconds between the two")
    parser.add_argument("--slowlog", type=Path, help="SLOWLOG GET over the window, as JSON (bench/phases.sh)")
    parser.add_argument("--extra", type=Path, help="a JSON object of figures to keep beside (CPU, rate, machine)")
    parser.add_argument("--broker-threads", type=Path, nargs=2, metavar=("BEFORE", "AFTER"),
                        help="the broker's threads' /proc stat lines, at the window's ends")
    parser.add_argument("--broker-jmx", type=Path, nargs=2, metavar=("BEFORE", "AFTER"),
                        help="JmxTool's reports of the broker's request metrics, at the window's ends")
    parser.add_argument("--broker-jfr", type=Path,
                        help="the broker's JFR execution samples over the window (jfr print --json)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    result: dict[str, Any] = json.loads(args.extra.read_text()) if args.extra else {}
    result["wall_s"] = round(args.wall, 2)
    result["histograms"] = report(args.before.read_text(), args.after.read_text(), args.wall)
    if args.slowlog is not None:
        durations = sorted(script_ms(json.loads(args.slowlog.read_text())))
        if durations:
            n = len(durations)
            result["redis_script_ms"] = {"calls": n, "mean": round(sum(durations) / n, 2),
                                         "p50": durations[n // 2], "p90": durations[int(n * 0.9)]}  # fmt: skip
    if args.broker_threads is not None:
        before, after = (p.read_text() for p in args.broker_threads)
        ticks = os.sysconf("SC_CLK_TCK")
        result["broker_thread_cpu_pct"] = thread_cpu(before, after, args.wall, ticks)
        result["broker_thread_kernel_pct"] = thread_cpu(before, after, args.wall, ticks, kernel=True)
    if args.broker_jmx is not None:
        before, after = (p.read_text() for p in args.broker_jmx)
        result["broker_requests"] = broker_requests(before, after)
    if args.broker_jfr is not None and args.broker_jfr.exists():
        result["broker_jfr"] = jfr_top(json.loads(args.broker_jfr.read_text()))
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    for key, row in sorted(result["histograms"].items(), key=lambda kv: -kv[1]["share_of_wall"]):
        print(f"{key:64s} {row['share_of_wall'] * 100:5.1f} % of wall  {row['per_s']:7.1f}/s  "
              f"mean {row['mean_ms']:7.2f} ms")  # fmt: skip
    if "redis_script_ms" in result:
        s = result["redis_script_ms"]
        print(f"the batch script inside Redis: {s['calls']} calls, mean {s['mean']} ms, p50 {s['p50']}, p90 {s['p90']}")
    kernel = result.get("broker_thread_kernel_pct", {})
    for name, pct in result.get("broker_thread_cpu_pct", {}).items():
        if pct >= 1.0:
            print(f"broker thread {name:32s} {pct:5.1f} % of a core (in the kernel {kernel.get(name, 0.0):.1f})")
    for name, row in result.get("broker_requests", {}).items():
        print(f"broker {name:28s} {row['per_s']:8.1f}/s  handlers' local time {row['local_ms_per_s']:7.2f} ms/s "
              f"({row['local_us_each']:.1f} µs each)")  # fmt: skip
    if "broker_jfr" in result:
        jfr = result["broker_jfr"]
        print(f"broker JFR: {jfr['samples']} samples; by thread {jfr['threads_pct']}")
        for name, pct in list(jfr["inclusive_pct"].items())[:10]:
            print(f"broker JFR inclusive {pct:5.1f} % {name}")
    for key in ("worker_cpu_pct", "redis_cpu_pct", "decided_per_s"):
        if key in result:
            print(f"{key}: {result[key]}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
