"""The scoring stage alone: ``Scorer.score_batch`` against a real Redis and the
registered model, no Kafka. Prints wall time per batch and CPU per transaction,
per stage, for batch sizes 1 / 8 / 32 (``python -m bench.scorer``), and what
Redis spent per transaction: its CPU, and each command's time (INFO commandstats).

Built as the worker builds it (agents/wiring.py): signed messages, admission
with the replay guard and the settings' rate limits, the local-first decision
cache. ``--lookup combined separate`` compares the batch's one Redis call
(pipeline/redis_batch.py) with the separate calls, batch by batch in turn.

Why: the end-to-end benchmark (bench/run.py) mixes faust, the broker and the
load generator on the same cores; this isolates what the pipeline's own code
costs per transaction, so a change to it can be measured on a busy machine
(CPU time moves far less with contention than wall time does).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import orjson

from app.redis_client import BATCH_TIMEOUT_S, async_client, sync_client
from app.settings import Settings
from models.registry import load_ensemble
from pipeline.admission import Admission
from pipeline.auth import ClientKeys, RedisReplayGuard, sign
from pipeline.cache import LocalFirstCache, RedisDecisionCache
from pipeline.feature_store import RedisFeatureStore
from pipeline.ratelimit import RedisRateLimiter
from pipeline.redis_batch import RedisBatchLookup
from pipeline.rules import load_rules
from pipeline.scorer import Inbound, Scorer
from tools import stack
from tools.loadgen import _population
from tools.materialize import materialize
from tools.simulator import LiveTransactions


def _settings(redis_url: str) -> Settings:
    # The bench's own redis-server, whatever the environment names.
    return Settings(redis_url=redis_url, redis_cluster=False)


BENCH_CLIENT = "bench-pos"
BENCH_KEY = bytes(range(32))


async def run(
    sizes: list[int], batches: int, data: Path, registry: Path, redis_url: str,
    paths: tuple[str, ...] = ("merged",), rounds: int = 1, lookups: tuple[str, ...] = ("combined",),
) -> list[dict[str, Any]]:
    """``paths``: how a stacked model predicts — "merged" (one booster, as served)
    or "members" (one predict call per member, as before merging); with several,
    each batch size runs them alternately, ``rounds`` times each (an A/B in one process).
    ``lookups``: "combined" (one Redis call for cache, admission and enrichment)
    and/or "separate" (three calls in turn); with both, each batch of a size runs
    once with each, in turn, so a busy machine slows both alike."""
    source = LiveTransactions(_population(data), seed=3, fraud_rate=0.01)
    settings = _settings(redis_url)
    # The worker's client, with a batch job's timeout: this measures the cost, not the budget.
    client = async_client(settings, timeout_s=BATCH_TIMEOUT_S, max_connections=8)
    admission = Admission(
        keys=ClientKeys({BENCH_CLIENT: BENCH_KEY}),
        window_s=settings.auth_window_s,
        replay=RedisReplayGuard(client),
        limiter=RedisRateLimiter(client, settings.rate_client_per_s, settings.rate_client_burst,
                                 settings.rate_user_per_s, settings.rate_user_burst),
    )  # fmt: skip
    store = RedisFeatureStore(client, local_cache_ttl_s=5.0)
    cache = LocalFirstCache(RedisDecisionCache(client, 3600), ttl_s=3600)
    lookup = RedisBatchLookup.build(client, cache, store, admission)
    assert lookup is not None, "a single Redis server takes the one-call lookup"
    model = load_ensemble(registry, None)
    rules = load_rules(Path("config/rules.json"))
    scorers = {
        name: Scorer(
            model=model, rules=rules, store=store, cache=cache, admission=admission,
            lookup=lookup if name == "combined" else None,
            model_budget_s=1.0,  # the cost, not the budget, is measured here
        )
        for name in lookups
    }  # fmt: skip
    for scorer in scorers.values():
        await scorer.warm_up()
    merged = getattr(model, "merged", None)
    results = []
    for size, path, rnd in ((z, p, r) for z in sizes for r in range(rounds) for p in paths):
        if model is not None and hasattr(model, "merged"):
            model.merged = merged if path == "merged" else None
        walls: defaultdict[str, list[float]] = defaultdict(list)
        cpus: defaultdict[str, list[float]] = defaultdict(list)
        stages: defaultdict[str, defaultdict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
        counts: defaultdict[str, Counter[str]] = defaultdict(Counter)
        await client.config_resetstat()
        redis_cpu0 = await _redis_cpu_s(client)
        for i in range(batches + 3):
            for name, scorer in scorers.items():
                batch = [_signed(orjson.dumps(source.next(time.time()))) for _ in range(size)]
                cpu0, wall0 = time.process_time(), time.perf_counter()
                out = await scorer.score_batch(batch)
                wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
                if out.to_cache:
                    await scorer.cache.put_many(out.to_cache)
                if i < 3:
                    continue  # warm-up batches
                walls[name].append(wall * 1000)
                cpus[name].append(cpu * 1000)
                counts[name].update({k: v for k, v in (out.monitoring or {}).get("counts", {}).items() if k != "batch"})
                for _, value, *_ in out.decisions[:1]:
                    for stage, ms in (orjson.loads(value).get("latency_ms") or {}).items():
                        stages[name][stage].append(ms)
        # Redis's own CPU (warm-up batches and cache writes included, as a worker
        # pays them): only one lookup's when one ran, else the mix of them.
        sent = size * (batches + 3) * len(scorers)
        redis_us = (await _redis_cpu_s(client) - redis_cpu0) * 1e6 / sent
        commands = {k.removeprefix("cmdstat_"): v["usec"] / sent for k, v in (await client.info("commandstats")).items()}
        for name in scorers:
            row = {
                "batch": size,
                "lookup": name,
                "model_path": path if merged is not None else "members (not stacked)",
                "round": rnd + 1,
                "wall_ms_p50": round(statistics.median(walls[name]), 2),
                "cpu_ms_per_batch_p50": round(statistics.median(cpus[name]), 2),
                "cpu_ms_per_tx": round(statistics.median(cpus[name]) / size, 3),
                "stage_ms_p50": {k: round(statistics.median(v), 2) for k, v in stages[name].items()},
                "counts": dict(counts[name]),
                # What Redis spent per transaction: in all, and in each command
                # (inside the script's, whose own figure counts the script whole).
                "redis_cpu_us_per_tx": round(redis_us, 1),
                "redis_command_us_per_tx": {k: round(v, 1) for k, v in sorted(commands.items(), key=lambda kv: -kv[1])
                                            if v >= 0.05 and not k.startswith(("config", "info"))},  # fmt: skip
            }
            results.append(row)
            print(json.dumps(row), flush=True)
    await client.aclose()
    return results


async def _redis_cpu_s(client: Any) -> float:
    info = await client.info("cpu")
    return float(info["used_cpu_sys"]) + float(info["used_cpu_user"])


def _signed(value: bytes) -> Inbound:
    """A message as a producing client sends it: signed now (so the replay guard runs)."""
    now = time.time()
    return Inbound(value=value, headers=sign(value, BENCH_CLIENT, BENCH_KEY, int(now * 1000)), timestamp=now)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--batches", type=int, default=60)
    parser.add_argument("--data", type=Path, default=Path("data/transactions.parquet"))
    parser.add_argument("--registry", type=Path, default=Path("models/registry"))
    parser.add_argument("--paths", nargs="+", choices=["merged", "members"], default=["merged"],
                        help="how a stacked model predicts; several: an A/B, alternating")
    parser.add_argument("--rounds", type=int, default=1, help="repeats of each path per batch size")
    parser.add_argument("--lookup", nargs="+", choices=["combined", "separate"], default=["combined"],
                        help="one Redis call per batch, or the three in turn; both: an A/B, batch by batch")
    parser.add_argument("--out", type=Path, help="also write the rows (JSON) here")
    args = parser.parse_args()
    import pandas as pd

    handle = stack.start_redis(workdir=Path(".stack/bench-scorer"))
    try:
        materialize(pd.read_parquet(args.data), sync_client(_settings(handle.url)), progress=False)
        rows = asyncio.run(run(args.sizes, args.batches, args.data, args.registry, handle.url,
                               tuple(args.paths), args.rounds, tuple(args.lookup)))  # fmt: skip
    finally:
        handle.stop()
    if args.out:
        from bench.plots import scorer_redis_plot
        from bench.procs import machine_info

        doc = {"machine": machine_info(), "rows": rows}
        args.out.write_text(json.dumps(doc, indent=2) + "\n")
        print(f"wrote {args.out} and {scorer_redis_plot(doc, args.out.with_suffix('.png'))}")


if __name__ == "__main__":
    main()
