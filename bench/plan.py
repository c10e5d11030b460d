"""The benchmark's plan: the variants, the phases, the legs and the full and quick plans."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

__all__ = [
    "BARE", "BATCHED", "BATCHED_X2", "CEILING", "DATA", "DEFAULT_BATCH", "FULL_PLAN", "MAIN_VARIANTS", "OUTSIDE",
    "OUTSIDE_POISSON", "OUTSIDE_X2", "POPULATION", "POPULATION_ARGS", "QUICK_PLAN", "REPO", "RESULTS_DIR", "SIMULATE_ARGS",
    "STREAMS", "STREAMS_25MS", "UNBATCHED", "Leg", "Phase", "Plan", "Variant", "sweep_variants",
]  # fmt: skip

REPO = Path(__file__).resolve().parents[1]
RESULTS_DIR = REPO / "bench" / "results"
DATA = REPO / "data" / "transactions.parquet"


#: The same small population ``make simulate`` builds.
SIMULATE_ARGS = ("--users", "2000", "--merchants", "4000", "--days", "45")
#: The population the load comes from, materialized into Redis (the model is
#: trained on DATA). NOTE: sized for the rates measured: with make simulate's
#: 2,000 users, 2,000 TPS is every user paying once a second, and each
#: decision's velocity window held the card's last hundreds of payments: the
#: bench measured a card-testing attack on every card, not traffic. With 50,000
#: users, 2,000 TPS is each paying every 25 s: still far above real cards, so
#: a busy card reaches the velocity cap (pipeline/feature_defs.py) in minutes.
POPULATION = REPO / "data" / "bench-population.parquet"
POPULATION_ARGS = ("--users", "50000", "--merchants", "20000", "--days", "20")


@dataclass(frozen=True)
class Variant:
    """One worker configuration."""

    name: str
    kind: str
    """``bare`` (bench/bare.py), ``faust`` (bench/passthrough.py), ``streams`` (the Kafka
    Streams peer, bench/streams_peer.py) or ``pipeline`` (the worker)."""
    batch_size: int
    batch_window_s: float
    commit_interval_s: float | None = None
    """The pipeline's FRAUD_COMMIT_INTERVAL_S, or Kafka Streams' commit.interval.ms
    for ``streams`` (None: the default, each its own)."""
    workers: int = 1
    """Processes in one consumer group on the variant's topics (scaling by partitions)."""
    shape: str = "inside"
    """How load reaches it: ``inside`` (:func:`tools.loadgen.run_load` in the
    harness, the worker on the bench's topics and settings) or ``outside``
    (:mod:`bench.outside`: generator and stamper processes, default topics,
    ``fraud-pipeline worker`` with default settings; only ``kind`` pipeline)."""
    arrivals: str = "poisson"
    """``poisson`` or ``constant`` (the outside shape's generator offers both)."""
    settings: tuple[tuple[str, str], ...] = ()
    """Worker settings on top of the variant's batching (``FRAUD_*`` name, value)."""
    checkout: str | None = None
    """Another checkout of this project whose worker runs instead (``kind``
    pipeline): code before a change against code after it, in one run. Settings
    that checkout does not know are left out of its environment."""

    @property
    def passthrough(self) -> bool:
        return self.kind != "pipeline"

    def env(self) -> dict[str, str]:
        env = {"FRAUD_BATCH_SIZE": str(self.batch_size), "FRAUD_BATCH_WINDOW_S": str(self.batch_window_s)}
        if self.commit_interval_s is not None and self.kind == "pipeline":
            env["FRAUD_COMMIT_INTERVAL_S"] = str(self.commit_interval_s)
        if self.passthrough:  # forwards transactions unsigned: nothing to verify
            env["FRAUD_DECISION_PUBLIC_KEYS"] = ""
        env.update(self.settings)
        return env


def _default(name: str) -> Any:
    from app.settings import Settings

    return Settings.model_fields[name].default


#: What a worker ships with: the batched variant measures the defaults.
DEFAULT_BATCH = (_default("batch_size"), _default("batch_window_s"))
# The pass-throughs take batches as ``batched`` does, so scoring (and, against
# ``bare``, faust's stream) is the only difference.
BARE = Variant("bare", kind="bare", batch_size=DEFAULT_BATCH[0], batch_window_s=DEFAULT_BATCH[1])
CEILING = Variant("ceiling", kind="faust", batch_size=DEFAULT_BATCH[0], batch_window_s=DEFAULT_BATCH[1])
# Unbatched: one record per batch and per transaction, as a worker without micro-batches would.
UNBATCHED = Variant("unbatched", kind="pipeline", batch_size=1, batch_window_s=DEFAULT_BATCH[1], commit_interval_s=0.0)
BATCHED = Variant("batched", kind="pipeline", batch_size=DEFAULT_BATCH[0], batch_window_s=DEFAULT_BATCH[1])
# The peer: Kafka Streams exactly_once_v2 at its default commit interval and at a short one
# (the batch fields are only recorded: Kafka Streams processes what each poll returns).
STREAMS = Variant("streams", kind="streams", batch_size=DEFAULT_BATCH[0], batch_window_s=DEFAULT_BATCH[1])
STREAMS_25MS = replace(STREAMS, name="streams-25ms", commit_interval_s=0.025)
MAIN_VARIANTS = (BARE, CEILING, STREAMS, STREAMS_25MS, UNBATCHED, BATCHED)
#: Two processes of the batched pipeline in one group: 8 partitions split 4 / 4.
BATCHED_X2 = replace(BATCHED, name="batched-x2", workers=2)
#: The batched pipeline as an independent client loads it (bench/outside.py):
#: a constant-rate generator process and a read_committed stamper process.
OUTSIDE = replace(BATCHED, name="outside", shape="outside", arrivals="constant")
OUTSIDE_POISSON = replace(OUTSIDE, name="outside-poisson", arrivals="poisson")
#: Two default workers in one group under the outside shape: the seed's
#: 5,000 TPS is asked of both load shapes, one worker or two.
OUTSIDE_X2 = replace(OUTSIDE, name="outside-x2", workers=2)


def sweep_variants(sizes: Sequence[int], windows_ms: Sequence[int]) -> tuple[Variant, ...]:
    return tuple(
        Variant(f"sweep-{size}-{ms}", kind="pipeline", batch_size=size, batch_window_s=ms / 1000)
        for size in sizes
        for ms in windows_ms
    )


@dataclass(frozen=True)
class Phase:
    """How long one measured run lasts."""

    warmup_s: float
    measure_s: float
    drain_s: float
    """After sending, how long to wait for outstanding decisions. Past it the
    rest count as lost and the worker (backlogged) is replaced."""

    @property
    def load_s(self) -> float:
        return self.warmup_s + self.measure_s


@dataclass(frozen=True)
class Leg:
    """A variant measured after the main ones, at its own rates and phases."""

    variant: Variant
    rates: tuple[float, ...]
    main: Phase
    search: Phase
    search_steps: tuple[int, ...]

    @property
    def min_s(self) -> float:
        """What its main rates take at least, one worker start included (a guess: 10 s)."""
        return 10.0 + len(self.rates) * (self.main.load_s + self.main.drain_s)


@dataclass(frozen=True)
class Plan:
    quick: bool
    rates: tuple[float, ...]
    main: Phase
    search: Phase
    search_steps: tuple[int, ...]
    """Probe runs per threshold of THRESHOLDS_MS, on top of the main rates."""
    search_floor_tps: float
    search_cap_tps: float
    sweep: tuple[Variant, ...]
    sweep_rate: float
    sweep_phase: Phase
    deadline_s: float
    """Searches stop probing when the rest of the plan would not fit before this."""
    variants: tuple[Variant, ...] = MAIN_VARIANTS
    """Measured at every rate and searched, in this order."""
    legs: tuple[Leg, ...] = ()
    """Measured after the main variants, before the first seconds and the sweep."""
    fresh_rate: float | None = None
    """A fresh worker's first ``fresh_s`` seconds after Ready under load at this rate (outside shape)."""
    fresh_s: float = 5.0
    broker_warmup: tuple[float, float] | None = None
    """(rate, seconds) of the batched pipeline's load on the new broker before
    anything is measured, decided and thrown away: see FULL_PLAN."""


FULL_PLAN = Plan(
    quick=False,
    rates=(100.0, 500.0, 1000.0, 2000.0, 4000.0),
    # NOTE: 4 s of warm-up: a worker is replaced after a run it could not keep
    # up with (see _spent), and a fresh one answered its first seconds late
    # (a pass-through's p99 229 ms at 250 TPS with 1 s of warm-up, p50 31 ms).
    main=Phase(warmup_s=4.0, measure_s=8.0, drain_s=5.0),
    search=Phase(warmup_s=4.0, measure_s=4.0, drain_s=2.0),
    search_steps=(3, 2),
    search_floor_tps=10.0,
    search_cap_tps=40000.0,
    sweep=sweep_variants((64, 256, 1024), (5, 20)),
    # NOTE: near the default's knee (32 / 10 ms sustains ~600-700 TPS here), not
    # at 2,500 where every cell saturated and only throughput told them apart
    # (bench-20261202T230320.json): here small batches still saturate, and the
    # cells that keep up show what size and window cost in latency.
    sweep_rate=1500.0,
    # NOTE: 4 s of warm-up, as above: with 1 s, a fresh worker's first seconds
    # at 1,500 TPS (commits slow, a backlog of up to 1,431 records worked off
    # within ~2.5 s) fell in the window of most cells: the defaults' p99 356
    # and 427 ms with 1 s against 83 and 82 ms with 4 s (knobs-start-1500*.json).
    sweep_phase=Phase(warmup_s=4.0, measure_s=4.0, drain_s=3.0),
    # NOTE: ~0.5 minutes warming the broker, ~10.5 for the main variants and
    # the sweep, ~5 for the Kafka Streams peer's two variants (five rates, a
    # JVM start, the searches), ~5.5 for a fresh worker, the outside shape and
    # two workers, ~2 for two workers under the outside shape; the sweep gets
    # what is left (its cells are cut first). At 1,200 s the two workers' knee
    # search was cut in the runs of 2026-12-07, which left their knee a
    # bracket (2,000-4,000).
    deadline_s=1380.0,
    legs=(
        # The outside shape warms up 5 s, as the independent client did; its
        # knee is searched in as many steps as the inside one's (two left it
        # 2,700 after a failed 4,000 where the inside one found 4,250).
        Leg(OUTSIDE, (500.0, 1000.0, 2000.0), Phase(5.0, 8.0, 5.0), Phase(5.0, 4.0, 2.0), (3, 0)),
        Leg(OUTSIDE_POISSON, (1000.0, 2000.0), Phase(5.0, 8.0, 5.0), Phase(5.0, 4.0, 2.0), (0, 0)),
        Leg(BATCHED_X2, (1000.0, 2000.0, 4000.0), Phase(4.0, 8.0, 5.0), Phase(4.0, 4.0, 2.0), (2, 0)),
        # Its knee only, from where one worker's is: two workers' low rates tell nothing new.
        Leg(OUTSIDE_X2, (4000.0,), Phase(5.0, 8.0, 5.0), Phase(5.0, 4.0, 2.0), (2, 0)),
    ),
    fresh_rate=1500.0,
    # NOTE: a broker just started compiles its hot paths meanwhile: 12-22 s
    # into its first load (2,000 TPS, the pipeline), its C2 compiler thread
    # took 35 % of a core, as much as the threads serving requests (40 %), and
    # the first cell of an A/B run on a new broker cost it ~100 % of a core
    # against 45-60 % for the same cell later (bench/knobs.py). Unwarmed, that
    # fell on `bare`'s first rates, measured first. The pipeline's load, so
    # that transactions, markers and read_committed fetches are compiled too.
    broker_warmup=(1000.0, 20.0),
)
QUICK_PLAN = Plan(
    quick=True,
    # One main rate and one search probe per variant: ~1.5 minutes, most of it
    # starting workers (6.4 s each, a fresh one after every run that fell behind).
    rates=(1000.0,),
    main=Phase(warmup_s=1.0, measure_s=4.0, drain_s=4.0),
    search=Phase(warmup_s=1.0, measure_s=3.0, drain_s=2.0),
    search_steps=(1, 0),
    search_floor_tps=10.0,
    search_cap_tps=40000.0,
    sweep=(),
    sweep_rate=2500.0,
    sweep_phase=Phase(warmup_s=1.0, measure_s=3.0, drain_s=2.0),
    deadline_s=230.0,
    # One Kafka Streams variant: the one at the pipeline's own commit interval.
    variants=(BARE, CEILING, STREAMS_25MS, UNBATCHED, BATCHED),
    # The outside shape at the main rate: whether the two shapes agree, roughly.
    legs=(Leg(OUTSIDE, (1000.0,), Phase(3.0, 4.0, 4.0), Phase(3.0, 3.0, 2.0), (0, 0)),),
)
