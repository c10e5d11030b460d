"""What a user's velocity events cost the batch's enrichment script and the
worker that reads its reply (``python -m bench.velocity``).

A user's velocity set holds up to ``VELOCITY_KEEP_EVENTS`` events and the
script returns the newest ``VELOCITY_MAX_EVENTS`` of the last 24 h for every
transaction, so its cost grows with how often a user pays: a few events for
most users of a real population, 25-32 for `make bench`'s 50,000 users after a
million transactions. On a real redis-server, for users of 2, 10 and 30
events each, batches of 128 transactions of distinct users run the script as
kept (ZRANGE's reply returned as it is, the amounts read by the worker:
``pipeline.feature_store.BATCH_ENRICH_FUNCTION``) and as it was (the amounts
cut out of each member in Lua, ``string.match``), alternating batch by batch.
Per transaction: Redis's time in the script (INFO commandstats) and the
worker's CPU to send the call and read its reply into velocity features
(``RedisFeatureStore.enrichments`` for the kept shape, the earlier parse for
the other).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import redis

from app.contract import Transaction
from app.redis_keys import velocity_key
from bench.procs import machine_info
from pipeline.feature_store import BATCH_ENRICH_SCRIPT, VELOCITY_RETENTION_S, RedisFeatureStore, velocity_args
from pipeline.features import velocity_batch
from tools.stack import start_redis

_KEPT_EVENTS = "  out[i] = redis.call('ZRANGE',"
#: The script as it was: each event's amount cut out of its member in Lua.
EARLIER_SCRIPT = BATCH_ENRICH_SCRIPT.replace(
    _KEPT_EVENTS,
    "  local events = redis.call('ZRANGE',",
).replace(
    "'WITHSCORES')\nend",
    """'WITHSCORES')
  local tv = {}
  for k = 1, #events, 2 do
    tv[k] = events[k + 1]
    tv[k + 1] = string.match(events[k], '[^|]*$')
  end
  out[i] = tv
end""",
)


def _earlier_read(replies: list[Any], txs: list[Transaction]) -> list[list[float]]:
    """The worker's read of the earlier reply: (time, amount) pairs, each a number."""
    n = len(txs)
    lengths = np.fromiter((len(r) for r in replies[:n]), dtype=np.int64, count=n)
    flat = np.array([v for r in replies[:n] for v in r], dtype=np.float64)
    rows: list[list[float]] = velocity_batch(
        flat[0::2], flat[1::2], lengths // 2, np.array([tx.timestamp for tx in txs])
    ).tolist()
    return rows


def run(events: list[int], users: int, batch: int, batches: int) -> list[dict[str, Any]]:
    if EARLIER_SCRIPT == BATCH_ENRICH_SCRIPT or "string.match" not in EARLIER_SCRIPT:
        raise SystemExit("the enrichment script changed: EARLIER_SCRIPT no longer rebuilds the earlier one")
    handle = start_redis(workdir=Path(tempfile.mkdtemp(prefix="bench-velocity-")))
    rows = []
    try:
        client = redis.Redis.from_url(handle.url)
        store = RedisFeatureStore(client)
        shas = {"kept": client.script_load(BATCH_ENRICH_SCRIPT), "earlier": client.script_load(EARLIER_SCRIPT)}
        rng = random.Random(7)
        seq = 0
        for per_user in events:
            client.flushall()
            now = time.time()
            pipe = client.pipeline(transaction=False)
            for u in range(users):
                pipe.zadd(velocity_key(f"u{u}"),
                          {f"seed-{u}-{e}|{rng.uniform(1, 300)!r}": now - rng.uniform(0, 80_000) for e in range(per_user)})  # fmt: skip
            pipe.execute()
            redis_us: dict[str, list[float]] = {name: [] for name in shas}
            worker_us: dict[str, list[float]] = {name: [] for name in shas}
            for i in range(batches):
                for name, sha in (shas.items() if i % 2 else reversed(shas.items())):
                    txs = []
                    for u in rng.sample(range(users), batch):
                        seq += 1
                        txs.append(Transaction(f"t{seq}", f"u{u}", rng.uniform(1, 300), "m1", now + seq * 1e-3))
                    keys = [velocity_key(tx.user_id) for tx in txs]
                    args: list[Any] = [len(txs), 0, int(VELOCITY_RETENTION_S)]
                    for tx in txs:
                        args += velocity_args(tx)
                    client.config_resetstat()
                    cpu0 = time.process_time()
                    replies = client.evalsha(sha, len(keys), *keys, *args)
                    if name == "kept":
                        store.enrichments(txs, replies, [], [], time.monotonic())
                    else:
                        _earlier_read(replies, txs)
                    worker_us[name].append((time.process_time() - cpu0) * 1e6 / batch)
                    redis_us[name].append(client.info("commandstats")["cmdstat_evalsha"]["usec"] / batch)
            for name in shas:
                row = {
                    "events_per_user": per_user, "script": name, "batch": batch, "batches": batches,
                    "redis_us_per_tx_p50": round(statistics.median(redis_us[name]), 1),
                    "worker_cpu_us_per_tx_p50": round(statistics.median(worker_us[name]), 1),
                }  # fmt: skip
                rows.append(row)
                print(json.dumps(row), flush=True)
    finally:
        handle.stop()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--events", type=int, nargs="+", default=[2, 10, 30])
    parser.add_argument("--users", type=int, default=5000)
    parser.add_argument("--batch", type=int, default=128)
    parser.add_argument("--batches", type=int, default=60)
    parser.add_argument("--out", type=Path, default=Path("bench/results/velocity.json"))
    args = parser.parse_args()
    doc = {"machine": machine_info(), "rows": run(args.events, args.users, args.batch, args.batches)}
    args.out.write_text(json.dumps(doc, indent=2) + "\n")
    from bench.plots import velocity_plot

    print(f"wrote {args.out} and {velocity_plot(doc, args.out.with_suffix('.png'))}")


if __name__ == "__main__":
    main()
