"""The runner: a plan's main variants, legs, a fresh worker's first seconds and the sweep, on one broker and Redis."""

from __future__ import annotations

import asyncio
import sys
import time
import uuid
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from bench.criteria import THRESHOLDS_MS
from bench.outside import OutsideError
from bench.plan import OUTSIDE, POPULATION, Leg, Phase, Plan, Variant
from bench.report import _row
from bench.verdicts import (
    needs_repeat,
    next_probe,
    passes,
    run_record,
    saturated_tps,
    sustainable,
    threshold_key,
    verdicts,
)
from bench.workers import (
    SAMPLE_EVERY_S,
    OutsideWorkers,
    Services,
    Worker,
    WorkerError,
    _cli,
    _delete_topics,
    _sampler,
)

__all__ = ["VERIFY_SHARE", "Bench"]

#: Share of decisions whose Ed25519 signature the generator checks: each check
#: costs it about what the rest of a decision does, and the generator shares
#: the cores it measures (tools/loadgen.py).
VERIFY_SHARE = 0.02


class Bench:
    """Runs the plan against one broker and Redis; collects ``runs`` and ``max_sustainable``."""

    def __init__(self, plan: Plan, svc: Services, workdir: Path, started: float) -> None:
        self.plan = plan
        self.svc = svc
        self.workdir = workdir
        self.deadline = started + plan.deadline_s
        self.runs: list[dict[str, Any]] = []
        self.errors: list[dict[str, str]] = []
        self.max_sustainable: dict[str, dict[str, Any]] = {}
        self.truncated: list[str] = []
        #: (variant, threshold key) whose search the time budget stopped: its knee is only bracketed.
        self.cut_short: set[tuple[str, str]] = set()
        self._seed = 100
        # Running estimates for the deadline check (seconds); refined as we go.
        self._start_s = 10.0
        self._stop_s = 2.0
        self.reserve_s = 0.0
        """Seconds the main variants' searches leave for what comes after them."""

    # -- workers and single runs --

    def _start(self, variant: Variant) -> Worker | OutsideWorkers:
        if variant.shape == "outside":
            return self._start_outside(variant)
        worker = Worker(variant, self.svc, self.workdir)
        worker.peers = [Worker(variant, self.svc, self.workdir, join=worker) for _ in range(variant.workers - 1)]
        try:
            took = max(w.wait_ready() for w in (worker, *worker.peers))
        except BaseException:
            worker.stop()
            raise
        self._start_s = max(self._start_s, took)
        print(f"bench: {variant.name}: worker {worker.tag} (pids {worker.pids}) ready in {took:.1f} s", flush=True)
        return worker

    def _outside(self, variant: Variant) -> OutsideWorkers:
        """An outside session on topics of its own, created by ``fraud-pipeline topics``; no worker yet."""
        from bench.outside import OutsideSession

        tag = f"{variant.name}-{uuid.uuid4().hex[:8]}"
        # NOTE: names of its own (default partition counts and configs) so that
        # each session starts from empty topics and a new group, as a fresh
        # deployment does; every other setting is the worker's default.
        names = {f"FRAUD_TOPIC_{n.upper()}": f"{tag}-{n}" for n in OutsideWorkers.TOPICS} | {"FRAUD_APP_ID": tag}
        session = OutsideSession({**self.svc.env(), **names}, self.svc.pids, self.workdir, POPULATION, _cli(),
                                 workers=variant.workers)  # fmt: skip
        created = session.topics()
        print(f"bench: {variant.name}: fraud-pipeline topics: {'; '.join(created.splitlines())}", flush=True)
        return OutsideWorkers(variant, tag, session, list(names.values())[:-1])

    def _start_outside(self, variant: Variant) -> OutsideWorkers:
        t0 = time.monotonic()
        outside = self._outside(variant)
        try:
            outside.session.start()
        except BaseException:
            self._stop(outside)
            raise
        took = time.monotonic() - t0
        self._start_s = max(self._start_s, took)
        print(f"bench: {variant.name}: workers {outside.session.worker_pids} ready in {took:.1f} s", flush=True)
        return outside

    def _stop(self, worker: Worker | OutsideWorkers | None) -> None:
        if worker is not None:
            t0 = time.monotonic()
            worker.stop()
            # Drop what this worker's runs produced: later runs start from
            # empty topics and the broker's disk stays flat.
            asyncio.run(_delete_topics(self.svc.bootstrap, list(worker.topics.values()), self.svc.admin_options()))
            self._stop_s = max(self._stop_s, time.monotonic() - t0)

    def _measure(self, worker: Worker | OutsideWorkers, rate: float, phase: Phase, label: str) -> dict[str, Any]:
        from tools.loadgen import LoadConfig, run_load

        self._seed += 1
        if isinstance(worker, OutsideWorkers):
            summary, _, _ = worker.session.run(
                rate, arrivals=worker.variant.arrivals, warmup_s=phase.warmup_s, measure_s=phase.measure_s,
                drain_s=phase.drain_s, seed=self._seed,
            )  # fmt: skip
            others: tuple[str, ...] = ("stamper", *self.svc.pids)
        else:
            cfg = LoadConfig(
                rate=rate, duration_s=phase.load_s, warmup_s=phase.warmup_s, drain_s=phase.drain_s,
                data=POPULATION, seed=self._seed, report_every_s=SAMPLE_EVERY_S, quiet=True,
                verify_share=VERIFY_SHARE, settings=worker.settings, sample=_sampler(worker.pids, self.svc.pids),
                prebuild=True,
            )  # fmt: skip
            summary = asyncio.run(run_load(cfg))
            others = tuple(self.svc.pids)
        record = run_record(worker.variant, label, rate, summary, worker=worker.tag, other_pids=others)
        if not worker.alive():
            record["error"] = "a worker exited during the run"
        self.runs.append(record)
        print("bench:   " + _row(record), flush=True)
        return record

    def warm_broker(self, variant: Variant) -> None:
        """Load the new broker with ``variant`` at the plan's warm-up rate and
        length before anything is measured; nothing of it is kept (Plan.broker_warmup)."""
        from tools.loadgen import LoadConfig, run_load

        if self.plan.broker_warmup is None:
            return
        rate, seconds = self.plan.broker_warmup
        worker = self._start(variant)
        try:
            assert isinstance(worker, Worker), "the broker is warmed by the inside shape"
            cfg = LoadConfig(rate=rate, duration_s=seconds, drain_s=5.0, data=POPULATION, seed=self._seed,
                             quiet=True, verify_share=0.0, settings=worker.settings, prebuild=True)  # fmt: skip
            summary = asyncio.run(run_load(cfg))
            print(f"bench: broker warmed up: {seconds:.0f} s of {variant.name} at {rate:,.0f} TPS "
                  f"({summary.get('decided', 0):,} decided, not kept)", flush=True)  # fmt: skip
        finally:
            self._stop(worker)

    def _afford(self, seconds: float, reserve: float = 0.0) -> bool:
        return time.monotonic() + seconds + reserve <= self.deadline

    def _cell_s(self) -> float:
        """Estimated seconds for one sweep cell: start, load, drain, stop."""
        return self._start_s + self.plan.sweep_phase.load_s + 1.0 + self._stop_s

    def _sweep_reserve(self, done: int = 0) -> float:
        return (len(self.plan.sweep) - done) * self._cell_s()

    # -- the phases --

    def main_variant(self, variant: Variant, leg: Leg | None = None) -> None:
        """The main rates, then the searches, on one worker (replaced when backlogged).
        ``leg``: its rates, phases and search steps instead of the plan's."""
        plan, worker = self.plan, None
        rates, main, search = (leg.rates, leg.main, leg.search) if leg else (plan.rates, plan.main, plan.search)
        steps = leg.search_steps if leg else plan.search_steps
        mine: list[dict[str, Any]] = []
        try:
            for rate in rates:
                if any(r["achieved_tps"] < 0.8 * r["offered_tps"] for r in mine):
                    break  # saturated already: a higher rate only grows the backlog
                if leg and not self._afford(main.load_s + main.drain_s + (0 if worker else self._start_s)):
                    self.truncated.append(f"{variant.name}: {rate:,.0f} TPS")
                    break
                worker = worker or self._start(variant)
                record = self._measure(worker, rate, main, "rate")
                mine.append(record)
                if _spent(record):
                    self._stop(worker)
                    worker = None
                worker = self._repeat_if_spike(variant, worker, record, mine, main, max(THRESHOLDS_MS))
            for threshold, n in zip(THRESHOLDS_MS, steps):
                for _ in range(n):
                    outcomes = verdicts(mine, threshold)
                    probe = next_probe(
                        outcomes,
                        floor=plan.search_floor_tps,
                        cap=plan.search_cap_tps,
                        saturated_tps=saturated_tps(mine, threshold),
                    )
                    if probe is None:
                        break
                    rate = probe
                    cost = search.load_s + search.drain_s + (0 if worker else self._start_s)
                    # The searches give the acceptance figures (max sustainable
                    # rates, ratios): they go before the sweep, which gets the
                    # rest, and leave the legs still to come their main rates.
                    if not self._afford(cost, self.reserve_s):
                        self.truncated.append(f"{variant.name}: search for {threshold_key(threshold)}")
                        self.cut_short.add((variant.name, threshold_key(threshold)))
                        break
                    worker = worker or self._start(variant)
                    record = self._measure(worker, rate, search, "search")
                    mine.append(record)
                    if _spent(record):
                        self._stop(worker)
                        worker = None
                    worker = self._repeat_if_spike(variant, worker, record, mine, search, threshold)
        except (WorkerError, OutsideError) as exc:
            self.errors.append({"variant": variant.name, "error": str(exc)})
            print(f"bench: {variant.name}: {exc}", file=sys.stderr, flush=True)
        finally:
            self._stop(worker)
        self.max_sustainable[variant.name] = {
            threshold_key(t): {**sustainable(mine, t), "cut_short": (variant.name, threshold_key(t)) in self.cut_short}
            for t in THRESHOLDS_MS
        }

    def _repeat_if_spike(
        self, variant: Variant, worker: Worker | OutsideWorkers | None, record: Mapping[str, Any], mine: list[dict[str, Any]],
        phase: Phase, threshold: float,
    ) -> Worker | OutsideWorkers | None:  # fmt: skip
        """Measure a failing, unsaturated rate once more on a fresh worker (see :func:`needs_repeat`)."""
        if not needs_repeat(record, mine, threshold):
            return worker
        if not self._afford(phase.load_s + phase.drain_s + self._start_s + self._stop_s):
            self.truncated.append(f"{variant.name}: repeat of {record['offered_tps']:.0f} TPS")
            return worker
        self._stop(worker)
        fresh = self._start(variant)
        repeat = self._measure(fresh, record["offered_tps"], phase, "repeat")
        mine.append(repeat)
        if _spent(repeat):
            self._stop(fresh)
            return None
        return fresh

    def sweep(self) -> None:
        for variant in self.plan.sweep:
            if not self._afford(self._cell_s()):
                self.truncated.append(f"sweep from {variant.name}")
                break
            worker = None
            try:
                worker = self._start(variant)
                self._measure(worker, self.plan.sweep_rate, self.plan.sweep_phase, "sweep")
            except WorkerError as exc:
                self.errors.append({"variant": variant.name, "error": str(exc)})
                print(f"bench: {variant.name}: {exc}", file=sys.stderr, flush=True)
            finally:
                self._stop(worker)

    def fresh(self) -> None:
        """A fresh worker's first ``fresh_s`` seconds after Ready, under load at
        ``fresh_rate`` (outside shape): generator and stamper wait ready, the
        worker starts, and sending starts the moment it logs Ready."""
        from bench.outside import first_seconds

        plan = self.plan
        if plan.fresh_rate is None:
            return
        if not self._afford(self._start_s + plan.fresh_s + 10.0 + self._stop_s):
            self.truncated.append("a fresh worker's first seconds")
            return
        variant = replace(OUTSIDE, name="fresh")
        outside = None
        self._seed += 1
        try:
            outside = self._outside(variant)
            session = outside.session
            summary, sends, got = session.run(
                plan.fresh_rate, arrivals="constant", warmup_s=0.0, measure_s=plan.fresh_s, drain_s=10.0,
                seed=self._seed, before_go=session.start,
            )  # fmt: skip
            assert session.ready_at is not None  # set by session.start
            record = run_record(variant, "fresh", plan.fresh_rate, summary, worker=outside.tag,
                                other_pids=("stamper", *self.svc.pids))  # fmt: skip
            record["first_seconds"] = first_seconds(sends, got, session.ready_at, plan.fresh_s)
            self.runs.append(record)
            print("bench:   " + _row(record), flush=True)
        except OutsideError as exc:
            self.errors.append({"variant": variant.name, "error": str(exc)})
            print(f"bench: {variant.name}: {exc}", file=sys.stderr, flush=True)
        finally:
            self._stop(outside)


def _spent(record: Mapping[str, Any]) -> bool:
    """Whether the worker must be replaced before the next run: it lost or
    failed, or it fell behind its offered rate. NOTE: a worker (and its
    broker topics) that was just overrun answered the next, slower probe late
    (measured: a pass-through p99 of 339 ms at 500 TPS right after a 1,600 TPS
    run, 107 ms on a fresh one); each probe must measure the rate it offers."""
    return bool(record["lost"] or record.get("error") or not passes(record, max(THRESHOLDS_MS)))
