"""Where a worker's CPU goes, by pipeline stage, from a py-spy profile
(``python -m bench.stages STACKS --rate R``; bench/profile.sh runs it).

Each sample (a collapsed stack, ``py-spy record --format raw``) is given to the
first stage below whose frame it holds, so a stage counts what it calls (the
signature under "sign", not under "emit"); samples in none of them are the
event loop, faust and the client libraries' own work. A sample whose innermost
frame is a wait (``WAITS``: epoll, a thread pool's queue, a condition) is a
thread waiting, whatever called it.
"""

from __future__ import annotations

import argparse
import collections
import json
from pathlib import Path
from typing import Any

__all__ = ["STAGES", "WAITS", "breakdown", "main"]

#: (stage, frames that mark it), tried in this order.
STAGES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("sign decisions (Ed25519)", ("DecisionSigner.headers",)),
    ("model (XGBoost)", ("Scorer._predict", "inplace_predict", "Booster.predict")),
    ("features (Redis script, velocity, rows)",
     ("SeparateCalls._enrich", "Scorer._evidence", "feature_matrix", "RedisFeatureStore")),
    ("admission (replay guard, rate limits)",
     ("SeparateCalls._admit", "RedisRateLimiter", "RedisReplayGuard", "Admission.")),
    ("authenticate + validate", ("Scorer._validate",)),
    ("resend cache", ("SeparateCalls._cached", "in_batch_copies", "put_many", "_write_cache", "LocalFirstCache",
                      "RedisDecisionCache")),
    ("rules + reasons", ("Scorer._decide",)),
    ("emit (decision, feedback, monitoring records)", ("_emit_decisions", "_emit_monitoring", "_emit_cached",
                                                       "BatchOutput.records", "records_by_partition")),
    ("shadow, metrics", ("Scorer.finish", "observe_batch")),
    ("consume (librdkafka)", ("ExactlyOnce._take",)),
    ("produce + commit (librdkafka transaction)", ("ExactlyOnce._send", "ExactlyOnce._commit", "_commit_open")),
    ("commit (aiokafka transaction)", ("TransactionCommits.commit", "TransactionalEmitter", "app/transactional.py")),
    ("admit + offsets bookkeeping", ("TransactionCommits.admit", "app/offsets.py", "app/commits.py")),
    ("faust stream (fetch, drain, dispatch)", ("faust/streams.py", "faust/transport", "Fetcher", "_drain_messages")),
    ("aiokafka client", ("aiokafka/",)),
    ("scoring loop, other (records in, Redis client, event loop hops)", ("agents/score.py", "Scorer.")),
    # NOTE: redis-py writes a command from a callback, whose stack holds no
    # pipeline frame: without this line its socket writes counted as faust's.
    ("Redis client (commands written, replies read)", ("redis/asyncio", "redis/_parsers")),
    ("web, timers, other agents", ("aiohttp", "faust/", "mode/")),
)

#: (stage, functions that mark it as a sample's innermost frame), tried before STAGES.
#: NOTE: py-spy's ``--nonblocking`` samples (bench/profile.sh) count threads
#: blocked in these waits too: at 500 TPS the scoring client thread had 778
#: samples in 20 s at 250 a second (15.6 % of a core's worth), 516 of them in
#: the pool's queue wait and a condition wait, against 3.9 % of a core of
#: CPU from /proc (bench/threads.sh). Counted as a stage, they read as
#: hand-off costs, which they are not.
WAITS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("event loop waiting (epoll)", ("EpollSelector.select",)),
    (
        "threads waiting (pool queue, condition)",
        ("_worker (concurrent/futures/thread.py:", "Condition.wait", "Event.wait"),
    ),
)


def breakdown(lines: list[str]) -> dict[str, Any]:
    """Samples per stage (and their share), with the top self and inclusive frames."""
    stages: collections.Counter[str] = collections.Counter()
    self_: collections.Counter[str] = collections.Counter()
    incl: collections.Counter[str] = collections.Counter()
    total = 0
    for line in lines:
        stack, _, count = line.rstrip().rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        total += n
        frames = stack.split(";")
        self_[frames[-1]] += n
        for frame in set(frames[1:]):
            incl[frame] += n
        leaf = frames[-1]
        stage = next((name for name, marks in WAITS if leaf.startswith(marks)), None) or next(
            (name for name, marks in STAGES if any(m in stack for m in marks)), "event loop, threads, other"
        )
        stages[stage] += n
    share = {name: round(100.0 * n / total, 1) for name, n in stages.most_common()} if total else {}
    return {
        "samples": total,
        "stage_pct": share,
        "top_self": [[f, round(100.0 * c / total, 1)] for f, c in self_.most_common(25)] if total else [],
        "top_inclusive": [[f, round(100.0 * c / total, 1)] for f, c in incl.most_common(40)] if total else [],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("stacks", type=Path, help="py-spy record --format raw output")
    parser.add_argument("--rate", type=float, required=True, help="the offered rate it was taken at (TPS)")
    parser.add_argument("--label", default="worker")
    parser.add_argument("--load", type=Path, help="the load generator's --json summary, to keep beside it")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    result = breakdown(args.stacks.read_text().splitlines())
    print(f"{result['samples']} samples")
    for name, pct in result["stage_pct"].items():
        print(f"{pct:5.1f}%  {name}")
    print("-- self")
    for frame, pct in result["top_self"][:15]:
        print(f"{pct:5.1f}%  {frame}", flush=True)
    if args.out:
        from bench.procs import machine_info

        doc: dict[str, Any] = {"label": args.label, "offered_tps": args.rate, "machine": machine_info(), **result}
        if args.load and args.load.exists():
            load = json.loads(args.load.read_text())
            doc["load"] = {k: load.get(k) for k in ("achieved_rate", "latency_ms", "decided", "lost", "degraded")}
        args.out.write_text(json.dumps(doc, indent=1) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
