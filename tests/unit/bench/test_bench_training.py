"""The training benchmark's pure parts: the stage meter and the plot (not timings)."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np

from bench.training import StageMeter, plot, rss_mb


def test_the_meter_records_each_stage_with_its_memory_peak(tmp_path: Path) -> None:
    meter = StageMeter(every_s=0.01)
    with meter("small"):
        pass
    with meter("allocate"):
        block = np.ones(64 * 1024 * 1024 // 8)  # 64 MiB, touched
        block += 1
        # Held long enough for the sampler (every 10 ms) to see it on a busy machine.
        time.sleep(0.3)
        del block
    meter.close()
    assert [s["stage"] for s in meter.stages] == ["small", "allocate"]
    small, big = meter.stages
    assert big["peak_rss_mb"] >= small["peak_rss_mb"] + 50  # the 64 MiB shows in the stage's peak
    assert rss_mb() > 0


def test_the_plot_is_written_from_the_results_document(tmp_path: Path) -> None:
    doc = {
        "rows": 1000, "search": "light", "total_wall_s": 3.0, "high_water_rss_mb": 900.0,
        "stages": [{"stage": "features", "wall_s": 2.0, "cpu_s": 1.9, "peak_rss_mb": 800.0},
                   {"stage": "fit broad", "wall_s": 1.0, "cpu_s": 1.8, "peak_rss_mb": 900.0}],
        "machine": {"cores": 2, "cpu_model": "test cpu", "load_avg_at_start": [0.5, 0.5, 0.5]},
    }  # fmt: skip
    path = plot(json.loads(json.dumps(doc)), tmp_path / "training.png")
    assert path.stat().st_size > 10_000
