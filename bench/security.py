"""What security costs: the batched pipeline's max sustainable rate with security off and on, in one run.

    python -m bench.security            # about 8 minutes on 2 cores

Two stacks one after the other, each measured as :mod:`bench.run` measures the
``batched`` variant (the same rates, searches, pass criteria and worker
processes):

    off   plaintext broker, Redis without users: every process may do anything
    on    SASL/SCRAM-SHA-512 over TLS, the ACL table (``tools/kafka_acls.py``),
          Redis ACL users: the worker as ``scoring`` / ``worker``, the load
          generator as ``payments``, materialize as ``materialize``

Both sign transactions (HMAC) and decisions (Ed25519) and verify them: those
cost the same either way, and their own price per batch of 32 is measured here
too (``signature_ms_per_batch``). Results: ``bench/results/security.json`` and
``security.png``, the machine beside the numbers.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

from bench.criteria import THRESHOLDS_MS
from bench.plan import BATCHED, FULL_PLAN, REPO, RESULTS_DIR, Plan
from bench.procs import machine_info
from bench.runner import Bench
from bench.verdicts import cpu_per_decision_by_variant, threshold_key
from bench.workers import prepare, services

__all__ = ["PLAN", "QUICK_PLAN", "main", "signature_cost"]

#: Around the batched pipeline's knee on 2 cores (~280 TPS at p99 < 200 ms on the plaintext stack).
PLAN: Plan = replace(FULL_PLAN, rates=(150.0, 250.0, 350.0), search_steps=(3, 2), sweep=(), deadline_s=300.0)
#: A smoke run of the same code: one rate, one probe (about 2 minutes; its figures are not results).
QUICK_PLAN: Plan = replace(PLAN, rates=(150.0,), search_steps=(1, 0), deadline_s=90.0)
MODES = ("off", "on")


def signature_cost(batch: int = 32, rounds: int = 200) -> dict[str, float]:
    """Median ms to sign, and to verify, one batch of ``batch`` decision-sized values."""
    from pipeline.decision_signing import DecisionSigner, DecisionVerifier, headers_of

    signer = DecisionSigner.generate()
    verifier = DecisionVerifier([signer.public_key])
    rng = np.random.default_rng(0)
    values = [bytes(rng.integers(32, 127, 600, dtype=np.uint8)) for _ in range(batch)]
    sign_ms, verify_ms = [], []
    for _ in range(rounds):
        t0 = time.perf_counter()
        signed = [signer.headers(v) for v in values]
        t1 = time.perf_counter()
        for v, h in zip(values, signed):
            verifier.verify(v, headers_of(h))
        t2 = time.perf_counter()
        sign_ms.append((t1 - t0) * 1000)
        verify_ms.append((t2 - t1) * 1000)
    return {
        "batch": batch,
        "sign_p50_ms": round(float(np.median(sign_ms)), 3),
        "verify_p50_ms": round(float(np.median(verify_ms)), 3),
    }


def measure(mode: str, plan: Plan, workdir: Path) -> dict[str, Any]:
    started = time.monotonic()
    with services(workdir, secure=mode == "on") as svc:
        prepared = prepare(svc)
        bench = Bench(plan, svc, workdir, started)
        bench.main_variant(BATCHED)
    return {
        "duration_s": round(time.monotonic() - started, 1),
        "prepared": prepared,
        "runs": bench.runs,
        "max_sustainable": bench.max_sustainable.get(BATCHED.name, {}),
        "cpu_ms_per_decision": cpu_per_decision_by_variant(bench.runs).get(BATCHED.name),
        "errors": bench.errors,
        "truncated": bench.truncated,
    }


def format_report(doc: Mapping[str, Any]) -> str:
    m = doc["machine"]
    lines = [f"security off vs on, batched pipeline, one run on {m['cores']} cores ({m['cpu_model']})"]
    lines.append(
        f"{'mode':<6}" + "".join(f"{threshold_key(t):>24}" for t in THRESHOLDS_MS) + f"{'worker cpu ms/dec':>20}"
    )
    for mode in MODES:
        entry = doc["modes"][mode]
        cells = []
        for t in THRESHOLDS_MS:
            lo, hi = entry["max_sustainable"].get(threshold_key(t), {}).get("bracket", (None, None))
            text = "not measured" if lo is None else (f">= {lo:,.0f}" if hi is None else f"{lo:,.0f} (fails {hi:,.0f})")
            cells.append(f"{text:>24}")
        cpu = (entry.get("cpu_ms_per_decision") or {}).get("worker")
        lines.append(f"{mode:<6}" + "".join(cells) + f"{'-' if cpu is None else cpu:>20}")
        for run in sorted(entry["runs"], key=lambda r: r["offered_tps"]):
            lines.append(
                f"        {run['phase']:<7}{run['offered_tps']:>7,.0f} TPS  achieved {run['achieved_tps'] or 0:>7,.1f}  "
                f"p50 {run['p50_ms']} ms  p99 {run['p99_ms']} ms  undecided {run['lost']}"
            )
    sig = doc["signature_ms_per_batch"]
    lines.append(
        f"decision signatures, batch of {sig['batch']}: sign {sig['sign_p50_ms']} ms, verify {sig['verify_p50_ms']} ms (p50)"
    )
    return "\n".join(lines)


def plot(doc: Mapping[str, Any], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    width = 0.35
    for i, mode in enumerate(MODES):
        entry = doc["modes"][mode]
        values = [
            (entry["max_sustainable"].get(threshold_key(t), {}).get("bracket") or [None])[0] or 0 for t in THRESHOLDS_MS
        ]
        xs = np.arange(len(THRESHOLDS_MS)) + (i - 0.5) * width
        bars = left.bar(xs, values, width, label=f"security {mode}")
        left.bar_label(bars, fmt="%.0f")
        runs = sorted((r for r in entry["runs"] if r["p99_ms"] is not None), key=lambda r: r["offered_tps"])
        right.plot([r["offered_tps"] for r in runs], [r["p99_ms"] for r in runs], "o-", label=f"p99, security {mode}")
        right.plot([r["offered_tps"] for r in runs], [r["p50_ms"] for r in runs], "x--", label=f"p50, security {mode}")
    left.set_xticks(np.arange(len(THRESHOLDS_MS)), [f"p99 < {t:g} ms" for t in THRESHOLDS_MS])
    left.set_ylabel("max sustainable TPS")
    left.set_title("batched pipeline: max sustainable rate")
    left.legend()
    right.set_yscale("log")
    right.set_xlabel("offered TPS")
    right.set_ylabel("latency, ms (send to decision read back)")
    right.set_title("latency against offered rate")
    right.legend(fontsize=8)
    m = doc["machine"]
    fig.suptitle(f"security off vs on, one run, {m['cores']} cores ({m['cpu_model']}), {doc['started_at']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.security", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=RESULTS_DIR, help="results folder")
    parser.add_argument("--quick", action="store_true", help="one rate and one probe per mode (a smoke run)")
    args = parser.parse_args(argv)
    plan = QUICK_PLAN if args.quick else PLAN

    def on_term(signum: int, frame: Any) -> None:  # unwind: every process is stopped by the finally blocks
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_term)
    started_at = datetime.now(UTC)
    stamp = started_at.strftime("%Y%m%dT%H%M%S")
    doc: dict[str, Any] = {
        "schema": "fraud-pipeline-bench-security/1",
        "started_at": started_at.isoformat(timespec="seconds"),
        "machine": machine_info(),
        "quick": args.quick,
        "plan": {
            "variant": BATCHED.name,
            "rates": list(plan.rates),
            "search_steps": list(plan.search_steps),
            "thresholds_ms": list(THRESHOLDS_MS),
        },  # fmt: skip
        "signature_ms_per_batch": signature_cost(),
        "modes": {},
    }
    for mode in MODES:
        print(f"bench.security: security {mode}", flush=True)
        doc["modes"][mode] = measure(mode, plan, REPO / ".stack" / "bench" / f"security-{mode}-{stamp}")
    args.out.mkdir(parents=True, exist_ok=True)
    out = args.out / "security.json"
    out.write_text(json.dumps(doc, indent=1) + "\n")
    png = plot(doc, args.out / "security.png")
    print()
    print(format_report(doc))
    print(f"\nresults: {out.relative_to(REPO) if out.is_relative_to(REPO) else out}\nplot:    {png.name}")
    return 1 if any(doc["modes"][m]["errors"] for m in MODES) else 0


if __name__ == "__main__":
    sys.exit(main())
