"""The served booster's trees compiled to C (treelite + tl2cgen, built with the
machine's C compiler), for scores; XGBoost stays the reference and the fallback.

Why: an XGBoost ``inplace_predict`` costs ~0.15 ms however few rows it has
(about half of it in XGBoost's Python wrapper), while the compiled library
answers one row in ~0.025 ms and 32 rows in ~0.12 (the merged booster of 350
trees, 2-core Intel VM; ``python -m bench.compiled``). That is cheap enough to
score a batch on the event loop itself instead of handing it to the model
thread and back (``pipeline/scorer.py``).

Where the library comes from: the worker builds it from the booster it loaded
(checksums verified) in a background thread, serving with XGBoost meanwhile,
and keeps it in a cache directory keyed by the booster's bytes, the compiler
library's version and the machine, so a restart or a second worker loads it at
once. Loading a shared library runs its code, so the cache directory must be
the worker's own: it is created mode 0700, and one owned by another user or
writable by others is refused (XGBoost serves). A library is used only after
its scores matched XGBoost's on a probe batch within :data:`MAX_SCORE_DIFF`.

Nothing here is required: without tl2cgen, without a C compiler, or when the
library disagrees, the ensemble serves with XGBoost and the log says why.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import platform
import stat
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import xgboost as xgb

__all__ = ["MAX_SCORE_DIFF", "CompiledTrees", "compile_in_background", "library_key", "library_path", "load_or_compile"]

log = logging.getLogger(__name__)

#: The largest difference of a probability the compiled library may show
#: against XGBoost on the probe batch (both sum float32 leaves; measured ~1e-7).
MAX_SCORE_DIFF = 1e-5
_PROBE_ROWS = 512
#: A library no worker loaded for this long is deleted when another is built.
KEEP_UNUSED_S = 30 * 86400


class CompiledTrees:
    """A compiled booster's margins (log-odds) for a float32 feature matrix."""

    def __init__(self, path: Path) -> None:
        import tl2cgen

        self.path = path
        self._dmatrix = tl2cgen.DMatrix
        # One thread: a batch of 64 rows takes ~0.25 ms; threads would cost more.
        self._predictor = tl2cgen.Predictor(str(path), nthread=1)

    def margin(self, features: np.ndarray) -> np.ndarray:
        out = self._predictor.predict(self._dmatrix(features, dtype="float32"), pred_margin=True)
        return np.asarray(out, dtype=np.float64).reshape(-1)


def library_key(booster: xgb.Booster) -> str:
    """What the library depends on: the trees, the compiler library, the machine."""
    import tl2cgen

    digest = hashlib.sha256(bytes(booster.save_raw("ubj")))
    digest.update(f"tl2cgen {tl2cgen.__version__} {platform.machine()} {platform.libc_ver()}".encode())
    return digest.hexdigest()[:32]


def library_path(booster: xgb.Booster, cache_dir: Path) -> Path:
    return cache_dir / f"trees-{library_key(booster)}.so"


def _own_directory(path: Path) -> None:
    """Create ``path`` for this user only, or refuse one others could write to."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = path.stat()
    if info.st_uid != os.getuid():
        raise PermissionError(f"{path} belongs to uid {info.st_uid}, not this process's {os.getuid()}")
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise PermissionError(f"{path} is writable by others (mode {stat.S_IMODE(info.st_mode):o})")


def _compile(booster: xgb.Booster, target: Path) -> None:
    import tl2cgen
    import treelite

    model = treelite.frontend.from_xgboost(booster)
    # Written next to its final name and renamed: a worker that finds the file
    # finds a whole library, and two workers compiling at once both succeed.
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=".build-") as tmp:
        built = Path(tmp) / target.name
        tl2cgen.export_lib(model, toolchain="gcc", libpath=str(built), nthread=1, params={"parallel_comp": 2})
        os.replace(built, target)
    for old in target.parent.glob("trees-*.so"):
        with contextlib.suppress(OSError):  # another worker may prune it first
            if time.time() - old.stat().st_mtime > KEEP_UNUSED_S:
                old.unlink()


def _check(booster: xgb.Booster, compiled: CompiledTrees) -> float:
    """The largest probability difference against XGBoost on a probe batch
    (random values over several scales, a tenth missing)."""
    rng = np.random.default_rng(7)
    n_features = booster.num_features()
    probe = (rng.standard_normal((_PROBE_ROWS, n_features)) * rng.choice([1.0, 10.0, 1000.0], n_features)).astype(
        np.float32
    )
    probe[rng.random(probe.shape) < 0.1] = np.nan
    reference = booster.inplace_predict(probe, missing=np.nan, predict_type="margin")
    ours = compiled.margin(probe)

    def sigmoid(x: Any) -> np.ndarray:
        return 1.0 / (1.0 + np.exp(-np.asarray(x, dtype=np.float64)))

    return float(np.max(np.abs(sigmoid(reference) - sigmoid(ours))))


def load_or_compile(booster: xgb.Booster, cache_dir: Path) -> CompiledTrees | None:
    """The booster's compiled library from ``cache_dir``, compiled there first if
    missing, checked against XGBoost; None (logged) when that cannot be had."""
    try:
        _own_directory(cache_dir)
        target = library_path(booster, cache_dir)
        if not target.exists():
            started = time.monotonic()
            _compile(booster, target)
            log.info(
                "compiled %d trees to %s in %.1f s",
                booster.num_boosted_rounds(),
                target.name,
                time.monotonic() - started,
            )
        else:
            os.utime(target)  # in use: not pruned (KEEP_UNUSED_S)
        compiled = CompiledTrees(target)
        diff = _check(booster, compiled)
    except Exception as exc:  # ImportError, no compiler, a refused directory: XGBoost serves
        log.warning("compiled trees unavailable (%s: %s); scoring with XGBoost", type(exc).__name__, exc)
        return None
    if not diff <= MAX_SCORE_DIFF:
        log.error("compiled trees %s disagree with XGBoost by %.2g; scoring with XGBoost", target.name, diff)
        return None
    return compiled


def compile_in_background(
    booster: xgb.Booster, cache_dir: Path, use: Callable[[CompiledTrees], None]
) -> threading.Thread | None:
    """Hand ``use`` the compiled library: at once if the cache has it (returns
    None), else from a daemon thread once compiled (returns that thread).
    Either way the library is loaded and checked once, and a failure logged once."""
    try:
        cached = library_path(booster, cache_dir).exists()
    except Exception:  # e.g. tl2cgen missing: the thread's load_or_compile logs why
        cached = False
    if cached:
        ready = load_or_compile(booster, cache_dir)
        if ready is not None:
            use(ready)
        return None

    def build() -> None:
        compiled = load_or_compile(booster, cache_dir)
        if compiled is not None:
            use(compiled)

    thread = threading.Thread(target=build, name="compile-trees", daemon=True)
    thread.start()
    return thread
