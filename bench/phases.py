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
"""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

__all__ = ["histograms", "main", "report", "script_ms"]

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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("before", type=Path, help="the first /metrics scrape")
    parser.add_argument("after", type=Path, help="the second one")
    parser.add_argument("--wall", type=float, required=True, help="seconds between the two")
    parser.add_argument("--slowlog", type=Path, help="SLOWLOG GET over the window, as JSON (bench/phases.sh)")
    parser.add_argument("--extra", type=Path, help="a JSON object of figures to keep beside (CPU, rate, machine)")
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
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    for key, row in sorted(result["histograms"].items(), key=lambda kv: -kv[1]["share_of_wall"]):
        print(f"{key:64s} {row['share_of_wall'] * 100:5.1f} % of wall  {row['per_s']:7.1f}/s  "
              f"mean {row['mean_ms']:7.2f} ms")  # fmt: skip
    if "redis_script_ms" in result:
        s = result["redis_script_ms"]
        print(f"the batch script inside Redis: {s['calls']} calls, mean {s['mean']} ms, p50 {s['p50']}, p90 {s['p90']}")
    for key in ("worker_cpu_pct", "redis_cpu_pct", "decided_per_s"):
        if key in result:
            print(f"{key}: {result[key]}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
