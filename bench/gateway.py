"""REST latency through a running gateway and worker: ``python -m bench.gateway``.

Sends ``--n`` live transactions (the simulated population, as ``loadgen``) to
``POST /v1/transactions`` from ``--concurrency`` closed-loop clients and prints
the latency percentiles as the caller sees them (request sent to response read,
the same clock), the status codes, and the actions. The gateway, a worker, the
broker and Redis must be running, e.g.::

    python -m bench.gateway --url http://127.0.0.1:8080 --key "$API_KEY" --n 200 --concurrency 4
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections import Counter
from pathlib import Path
from typing import Any

import aiohttp
import orjson

from tools.loadgen import _population, percentiles


async def bench(url: str, key: str, n: int, concurrency: int, data: Path, seed: int) -> dict[str, Any]:
    from tools.simulator import LiveTransactions

    source = LiveTransactions(_population(data), seed=seed, fraud_rate=0.02)
    latencies: list[float] = []
    statuses: Counter[int] = Counter()
    actions: Counter[str] = Counter()
    worker_total_ms: list[float] = []
    remaining = iter(range(n))

    async def client(session: aiohttp.ClientSession) -> None:
        for _ in remaining:  # shared iterator: n requests in all
            body = orjson.dumps(source.next(time.time()))
            start = time.perf_counter()
            async with session.post(f"{url}/v1/transactions", data=body, headers={"X-API-Key": key}) as response:
                doc = await response.json(content_type=None)
            latencies.append((time.perf_counter() - start) * 1000)
            statuses[response.status] += 1
            if response.status == 200:
                actions[doc["action"]] += 1
                worker_total_ms.append(doc["latency_ms"]["total"])

    started = time.perf_counter()
    async with aiohttp.ClientSession() as session:
        await asyncio.gather(*(client(session) for _ in range(concurrency)))
    elapsed = time.perf_counter() - started
    return {
        "requests": n,
        "concurrency": concurrency,
        "seconds": round(elapsed, 2),
        "rps": round(n / elapsed, 1),
        "latency_ms": percentiles(latencies),
        "worker_total_ms": percentiles(worker_total_ms),
        "statuses": dict(statuses),
        "actions": dict(actions),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="http://127.0.0.1:8080")
    parser.add_argument("--key", required=True, help="an API key of the gateway")
    parser.add_argument("--n", type=int, default=200)
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--data", type=Path, default=Path("data/transactions.parquet"))
    parser.add_argument("--seed", type=int, default=11)
    args = parser.parse_args()
    result = asyncio.run(bench(args.url.rstrip("/"), args.key, args.n, args.concurrency, args.data, args.seed))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
