"""Compiled trees against XGBoost: the served model's members as C (treelite +
tl2cgen, built with gcc) vs XGBoost's ``inplace_predict``, per batch size.

    python -m bench.compiled [REGISTRY_VERSION_DIR]

Per member and batch size 1/8/32/64: process CPU µs per call (the best of 3
passes over 50 batches; CPU time moves far less than wall time on a shared
machine), the largest margin difference on 4,096 random rows, and the compile
time. Results: ``bench/results/compiled.json`` and ``compiled.png``, with the
machine and its load average beside them. Serving does not use compiled trees
(docs/performance.md says why); this measures what they would buy.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.plan import REPO, RESULTS_DIR
from bench.procs import machine_info

__all__ = ["main", "measure_member"]

BATCHES = (1, 8, 32, 64)


def _cpu_us(fn: Any, inputs: list[np.ndarray]) -> float:
    for x in inputs[:5]:
        fn(x)
    best = float("inf")
    for _ in range(3):
        t0 = time.process_time()
        for x in inputs:
            fn(x)
        best = min(best, (time.process_time() - t0) / len(inputs) * 1e6)
    return round(best, 1)


def measure_member(path: Path, n_features: int, workdir: Path) -> dict[str, Any]:
    import tl2cgen
    import treelite
    import xgboost as xgb

    booster = xgb.Booster()
    booster.load_model(str(path))
    booster.set_param({"nthread": 1})  # as served: one thread per predict
    t0 = time.monotonic()
    lib = workdir / f"{path.stem}.so"
    tl2cgen.export_lib(treelite.frontend.from_xgboost(booster), toolchain="gcc", libpath=str(lib), nthread=1,
                       params={"parallel_comp": 8})  # fmt: skip
    compile_s = time.monotonic() - t0
    compiled = tl2cgen.Predictor(str(lib), nthread=1)
    rng = np.random.default_rng(0)

    def xgb_margin(x: np.ndarray) -> Any:
        return booster.inplace_predict(x, predict_type="margin", missing=np.nan)

    def c_margin(x: np.ndarray) -> Any:
        return compiled.predict(tl2cgen.DMatrix(x, dtype="float32"), pred_margin=True)

    sample = rng.random((4096, n_features), dtype=np.float32) * 100
    row: dict[str, Any] = {
        "compile_s": round(compile_s, 1),
        "max_abs_margin_diff": float(np.max(np.abs(xgb_margin(sample) - np.asarray(c_margin(sample)).reshape(-1)))),
    }
    for size in BATCHES:
        inputs = [rng.random((size, n_features), dtype=np.float32) * 100 for _ in range(50)]
        row[f"xgboost_us_b{size}"] = _cpu_us(xgb_margin, inputs)
        row[f"compiled_us_b{size}"] = _cpu_us(c_margin, inputs)
    return row


def plot(doc: dict[str, Any], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for kind, style in (("xgboost", "o-"), ("compiled", "s--")):
        total = [sum(m[f"{kind}_us_b{b}"] for m in doc["members"].values()) for b in BATCHES]
        ax.plot(BATCHES, total, style, label=f"{kind}: all members")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("rows per call")
    ax.set_ylabel("process CPU µs per batch (sum of members)")
    m = doc["machine"]
    ax.set_title(f"{m['cores']} cores, {m['cpu_model']}, load {m['load_avg_at_start'][0]:.1f}", fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.compiled", description=__doc__.splitlines()[0])
    parser.add_argument("version_dir", nargs="?", type=Path, help="a registry version (default: the one serving)")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    args = parser.parse_args(argv)
    folder = args.version_dir
    if folder is None:
        registry = REPO / "models" / "registry"
        folder = registry / (registry / "CURRENT").read_text().strip()
    manifest = json.loads((folder / "manifest.json").read_text())
    doc: dict[str, Any] = {"machine": machine_info(), "version": manifest["version"], "members": {}}
    with tempfile.TemporaryDirectory(prefix="bench-compiled-") as tmp:
        for member in manifest["members"]:
            row = measure_member(folder / member["file"], len(member["features"]), Path(tmp))
            doc["members"][member["name"]] = row
            print(member["name"], row, flush=True)
    for size in BATCHES:
        x = sum(m[f"xgboost_us_b{size}"] for m in doc["members"].values())
        c = sum(m[f"compiled_us_b{size}"] for m in doc["members"].values())
        print(f"batch {size:>2}: xgboost {x:,.0f} µs, compiled {c:,.0f} µs per batch (all members, CPU)")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "compiled.json").write_text(json.dumps(doc, indent=1) + "\n")
    plot(doc, args.out / "compiled.png")
    print(f"results: {(args.out / 'compiled.json')}; load average {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
