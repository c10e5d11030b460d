"""The processes a bench run drives: the broker and Redis, worker subprocesses, outside sessions, data preparation."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench import streams_peer
from bench.plan import DATA, POPULATION, POPULATION_ARGS, REPO, SIMULATE_ARGS, Variant
from bench.procs import proc_cpu_s, proc_rss_mb

__all__ = [
    "BENCH_CLIENT", "BENCH_RATE_LIMITS", "PROBE_TIMEOUT_S", "READY_TIMEOUT_S", "SAMPLE_EVERY_S", "STOP_TIMEOUT_S",
    "OutsideWorkers", "Services", "Worker", "WorkerError", "decision_key_env", "prepare", "services",
    "settings_from_env",
]  # fmt: skip

log = logging.getLogger("bench")

#: A worker that never prints "Ready" or never answers the probe is given up on.
READY_TIMEOUT_S = 90.0
PROBE_TIMEOUT_S = 45.0
STOP_TIMEOUT_S = 10.0
SAMPLE_EVERY_S = 0.5
#: The client id the load generator signs as (tools.loadgen prefers "loadgen").
BENCH_CLIENT = "loadgen"
#: NOTE: the simulated population is 2,000 users, so at 5,000 TPS every user
#: would be over the per-user limit (2/s), which traffic spread over a real
#: card base is not: answers would be "rate_limited" rejects, not scores. The
#: limiter still runs (its Redis round trip is part of the cost); it never bites.
BENCH_RATE_LIMITS = {
    "FRAUD_RATE_USER_PER_S": "1e9",
    "FRAUD_RATE_USER_BURST": "1e9",
    "FRAUD_RATE_CLIENT_PER_S": "1e9",
    "FRAUD_RATE_CLIENT_BURST": "1e9",
}


def _own_cpu_s() -> float:
    t = os.times()
    return t.user + t.system


def _sampler(worker_pids: Sequence[int], others: Mapping[str, int]) -> Callable[[], dict[str, float]]:
    """Readings for :class:`tools.loadgen.LoadConfig.sample`: CPU seconds (summed
    over a variant's worker processes) and RSS (the largest)."""

    def sample() -> dict[str, float]:
        cpu = [proc_cpu_s(pid) for pid in worker_pids]
        rss = [proc_rss_mb(pid) for pid in worker_pids]
        out: dict[str, Any] = {
            "cpu_s": None if None in cpu else sum(c for c in cpu if c is not None),
            "rss_mb": None if None in rss else max(r for r in rss if r is not None),
            # The generator shares the machine: its CPU is part of the picture.
            "loadgen_cpu_s": _own_cpu_s(),
        }
        for name, pid in others.items():
            out[f"{name}_cpu_s"] = proc_cpu_s(pid)
        return out

    return sample


class WorkerError(RuntimeError):
    """A worker did not start, did not answer the probe, or died."""


class Worker:
    """One worker subprocess on its own topics and consumer group, stopped by PID."""

    def __init__(
        self,
        variant: Variant,
        services: Services,
        workdir: Path,
        join: Worker | None = None,
        role: str = "score",
        extra_env: Mapping[str, str] | None = None,
    ) -> None:
        """``join``: a second process in that worker's group, on its topics.
        ``role``: FRAUD_WORKER_ROLE; ``feedback`` joins only the feedback loop's
        group (on ``join``'s topics), which answers no transactions.
        ``extra_env``: settings on top of the bench's (e.g. another registry)."""
        from tools import stack

        self.variant = variant
        self.role = role
        self.tag = f"{variant.name}-{uuid.uuid4().hex[:8]}"
        self.group_tag: str = join.group_tag if join else self.tag
        self.topics: dict[str, str] = join.topics if join else {
            name: f"bench-{short}-{self.tag}"
            for name, short in (
                ("transactions", "tx"), ("decisions", "dec"), ("dlq", "dlq"),
                ("feedback", "fb"), ("monitoring", "mon"), ("labels", "lab"),
            )
        }  # fmt: skip
        topics = self.topics
        port = stack.free_port()
        ours = {
            **services.env(),
            "FRAUD_APP_ID": f"bench-{self.group_tag}",
            "FRAUD_DATA_DIR": str(workdir / "faust" / self.tag),
            **{f"FRAUD_TOPIC_{name.upper()}": topic for name, topic in topics.items()},
            # The decision path as production deploys it: the feedback loop's
            # agents run in their own workers (--role feedback), not here.
            "FRAUD_WORKER_ROLE": role,
            **variant.env(),
            **(extra_env or {}),
        }
        env = {**os.environ, **ours, "PYTHONUNBUFFERED": "1"}
        # The load generator sees the settings the worker does (same environment),
        # with a payment client's credentials on a secure broker.
        self.settings = settings_from_env({**ours, **services.client_env()})
        if join is None:
            services.provision(settings_from_env(ours))
        if variant.kind == "bare":
            argv = [sys.executable, "-m", "bench.bare"]
        elif variant.kind == "faust":
            argv = [sys.executable, "-m", "bench.passthrough"]
        elif variant.kind == "streams":
            argv = streams_peer.launcher_argv(variant.commit_interval_s)
        elif variant.checkout:
            argv = [sys.executable, "-m", "tools.cli", "worker"]  # run from that checkout: its packages first
            known = _known_settings(variant.checkout)
            # A checkout from before ``decisions`` was the resend index's changelog: an index topic of its own.
            env["FRAUD_TOPIC_DECISION_INDEX"] = f"bench-idx-{self.tag}"
            env = {k: v for k, v in env.items() if not k.startswith("FRAUD_") or k[6:].lower() in known}
            # The same model and rules as every other variant (relative paths would resolve in that checkout).
            env.setdefault("FRAUD_REGISTRY_DIR", str((REPO / self.settings.registry_dir).resolve()))
            env.setdefault("FRAUD_RULES_PATH", str((REPO / self.settings.rules_path).resolve()))
        else:
            script = Path(sys.executable).parent / "fraud-pipeline"
            argv = [str(script)] if script.exists() else [sys.executable, "-m", "tools.cli"]
            argv.append("worker")
        argv += ["--web-port", str(port), "--loglevel", "info"]
        self.peers: list[Worker] = []
        """Further processes in this worker's group (``variant.workers`` > 1), stopped with it."""
        self.log_path = workdir / f"worker-{self.tag}.log"
        (workdir / "faust").mkdir(parents=True, exist_ok=True)  # faust makes only the last level
        self.started_at = time.monotonic()
        with self.log_path.open("wb") as out:
            self.proc = subprocess.Popen(
                argv, cwd=variant.checkout or REPO, env=env, stdin=subprocess.DEVNULL, stdout=out,
                stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip
        log.debug("worker %s pid %d: %s", self.tag, self.proc.pid, " ".join(argv))

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def pids(self) -> list[int]:
        return [self.pid, *(p.pid for p in self.peers)]

    def alive(self) -> bool:
        return self.proc.poll() is None and all(p.alive() for p in self.peers)

    def tail(self, lines: int = 12) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def wait_ready(self, timeout_s: float = READY_TIMEOUT_S) -> float:
        """Block until "Ready" is logged and a probe transaction got its decision;
        return the seconds since start."""
        deadline = time.monotonic() + timeout_s
        while b"Ready" not in self.log_path.read_bytes():
            if not self.alive():
                raise WorkerError(f"worker {self.tag} exited ({self.proc.returncode}):\n{self.tail()}")
            if time.monotonic() > deadline:
                raise WorkerError(f"worker {self.tag} not Ready after {timeout_s:.0f} s:\n{self.tail()}")
            time.sleep(0.1)
        if self.role != "feedback":  # a feedback worker decides nothing: no probe to answer
            self._probe()
        return time.monotonic() - self.started_at

    def _probe(self) -> None:
        from tools.loadgen import LoadConfig, run_load

        # A handful of transactions; run_load waits up to drain_s for their
        # decisions, which arrive once partitions are assigned and the model loaded.
        cfg = LoadConfig(
            rate=20.0, duration_s=0.25, data=POPULATION, seed=1, drain_s=PROBE_TIMEOUT_S, quiet=True,
            settings=self.settings, report_every_s=5.0,
        )  # fmt: skip
        summary = asyncio.run(run_load(cfg))
        if summary["decided"] == 0 or not self.alive():
            raise WorkerError(f"worker {self.tag} answered no probe in {PROBE_TIMEOUT_S:.0f} s:\n{self.tail()}")

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after STOP_TIMEOUT_S (its peers first)."""
        for peer in self.peers:
            peer.stop()
        if self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            log.warning("worker %s ignored SIGTERM for %.0f s; killing it", self.tag, STOP_TIMEOUT_S)
            self.proc.kill()
            self.proc.wait(timeout=5)


@dataclass
class Services:
    """The broker and Redis: ours (started and stopped here) or given by the environment."""

    bootstrap: str
    redis_url: str
    pids: dict[str, int] = field(default_factory=dict)
    """Processes we started, by name: their CPU is sampled too."""
    client_key: str = field(default_factory=lambda: secrets.token_hex(32))
    """This run's producer key: the load generator signs, pipeline workers verify."""
    decision_key: str = field(default_factory=lambda: secrets.token_hex(32))
    """This run's decision signing key (a raw Ed25519 seed): workers sign, the load generator verifies."""
    secure_dir: Path | None = None
    """Set when the broker runs SASL/SCRAM over TLS with ACLs and Redis has ACL users
    (``tools.stack``'s secure mode, material in this folder): every process then uses
    its role's credentials, as deployed."""

    def env(self) -> dict[str, str]:
        """The environment every bench worker (and the load generator's settings) gets."""
        return {
            **decision_key_env(self.decision_key),
            "KAFKA_BOOTSTRAP": self.bootstrap,
            "FRAUD_KAFKA_BOOTSTRAP": self.bootstrap,
            "REDIS_URL": self.redis_url,
            "FRAUD_REDIS_URL": self.redis_url,
            # Signed as a real producer would: verification is part of the cost.
            "FRAUD_CLIENT_KEYS": f"{BENCH_CLIENT}:{self.client_key}",
            **BENCH_RATE_LIMITS,
            **self.role_env("scoring", "worker"),
        }

    def role_env(self, kafka_user: str | None, redis_user: str | None = None) -> dict[str, str]:
        """A role's credentials on the secure stack (nothing on the plaintext one)."""
        from tools import kafka_secure, stack

        if self.secure_dir is None:
            return {}
        env = kafka_secure.client_env(self.secure_dir, kafka_user, self.bootstrap) if kafka_user else {}
        if redis_user:
            env["FRAUD_REDIS_USERNAME"] = redis_user
            env["FRAUD_REDIS_PASSWORD_FILE"] = str(stack.redis_password_path(self.secure_dir, redis_user))
        return env

    def client_env(self) -> dict[str, str]:
        """The load generator's: a payment client."""
        return self.role_env("payments")

    def admin_options(self) -> dict[str, Any]:
        """aiokafka connection options of the broker's super user (topic set-up and clean-up)."""
        from app.topics import kafka_auth
        from tools import kafka_secure

        if self.secure_dir is None:
            return {}
        return kafka_auth(kafka_secure.client_settings(self.secure_dir, kafka_secure.ADMIN, self.bootstrap))

    def provision(self, worker_settings: Any) -> None:
        """On the secure broker, as the super user: a worker's topics, and the ACL
        table's rows for their names and its app id (each bench worker has its own
        topics; roles may not create them). Nothing on the plaintext broker."""
        from tools import kafka_secure, stack

        if self.secure_dir is None:
            return
        admin = kafka_secure.client_settings(self.secure_dir, kafka_secure.ADMIN, self.bootstrap)
        connection = {name: getattr(admin, name) for name in type(admin).model_fields if name.startswith("kafka_")}
        asyncio.run(stack.provision_secure(worker_settings.model_copy(update=connection)))


def decision_key_env(seed_hex: str) -> dict[str, str]:
    """Workers sign decisions with ``seed_hex``; consumers verify with its public key (as deployed)."""
    from pipeline.decision_signing import DecisionSigner, public_key_text

    signer = DecisionSigner.from_bytes(seed_hex.encode(), "bench")
    return {"FRAUD_DECISION_SIGNING_KEY": seed_hex, "FRAUD_DECISION_PUBLIC_KEYS": public_key_text(signer.public_key)}


def settings_from_env(env: Mapping[str, str]) -> Any:
    """:class:`app.settings.Settings` with ``FRAUD_*`` values from ``env`` over the process's."""
    from app.settings import Settings

    fields = Settings.model_fields
    values = {key[len("FRAUD_") :].lower(): v for key, v in env.items() if key.startswith("FRAUD_")}
    # Any: strings from the environment, which Settings parses into each field's type.
    known: dict[str, Any] = {name: v for name, v in values.items() if name in fields}
    return Settings(**known)


@contextmanager
def services(workdir: Path, *, secure: bool = False) -> Iterator[Services]:
    """The broker and Redis: the environment's (KAFKA_BOOTSTRAP, REDIS_URL), else
    started here. ``secure``: always started here, in the stack's secure mode."""
    from tools import stack

    handles: list[Any] = []
    try:
        if secure:
            handles.append(stack.start_broker(workdir=workdir, secure=True))
            handles.append(stack.start_redis(workdir=workdir, secure=True))
            # The URL without the admin's credentials: each process brings its role's.
            redis_url = "redis://" + handles[-1].url.split("@", 1)[1]
            yield Services(handles[0].url, redis_url, {h.name: h.pid for h in handles}, secure_dir=workdir.resolve())
            return
        bootstrap = os.environ.get("FRAUD_KAFKA_BOOTSTRAP") or os.environ.get("KAFKA_BOOTSTRAP")
        if bootstrap:
            stack.wait_broker_ready(bootstrap)
        else:
            handles.append(stack.start_broker(workdir=workdir))
            bootstrap = handles[-1].url
        redis_url = os.environ.get("FRAUD_REDIS_URL") or os.environ.get("REDIS_URL")
        if redis_url:
            stack.wait_redis_ready(redis_url)
        else:
            handles.append(stack.start_redis(workdir=workdir))
            redis_url = handles[-1].url
        yield Services(bootstrap, redis_url, {h.name: h.pid for h in handles})
    finally:
        for handle in reversed(handles):
            handle.stop()


def _known_settings(checkout: str) -> set[str]:
    """The settings fields of the project at ``checkout`` (its own code, imported there)."""
    done = subprocess.run(
        [sys.executable, "-c", "from app.settings import Settings; print(' '.join(Settings.model_fields))"],
        cwd=checkout, capture_output=True, text=True, check=True, env={**os.environ, "PYTHONPATH": ""},
    )  # fmt: skip
    return set(done.stdout.split())


def _cli() -> list[str]:
    script = Path(sys.executable).parent / "fraud-pipeline"
    return [str(script)] if script.exists() else [sys.executable, "-m", "tools.cli"]


def prepare(svc: Services) -> dict[str, Any]:
    """Data, model and online features: simulate and train only if missing; always materialize."""
    from app.settings import Settings

    env = dict(os.environ, REDIS_URL=svc.redis_url, FRAUD_REDIS_URL=svc.redis_url, **svc.role_env(None, "materialize"))
    done: dict[str, Any] = {}

    def step(name: str, *args: str) -> None:
        t0 = time.monotonic()
        print(f"bench: {name} ...", flush=True)
        subprocess.run([*_cli(), name, *args], cwd=REPO, env=env, check=True, stdout=subprocess.DEVNULL)
        done[name] = round(time.monotonic() - t0, 1)

    if not DATA.exists():
        step("simulate", *SIMULATE_ARGS, "--out", str(DATA), "--quiet")
    registry = Settings().registry_dir
    registry = registry if registry.is_absolute() else REPO / registry
    from models.lifecycle import serving_problem

    if serving_problem(registry)[1]:  # nothing serves, or nothing this code can load
        step("train", "--data", str(DATA), "--quiet", "--serve-if-none")
    if not POPULATION.exists():
        step("simulate", *POPULATION_ARGS, "--out", str(POPULATION), "--quiet")
    step("materialize", "--data", str(POPULATION), "--quiet")
    done["model"] = (registry / "CURRENT").read_text().strip()
    settings = Settings()
    if settings.compiled_trees:
        # Built here, not by the first worker in the background, so that no
        # measured window holds a compile or a worker still on XGBoost.
        from models.compiled import load_or_compile
        from models.registry import load_ensemble

        t0 = time.monotonic()
        merged = load_ensemble(registry, warm_up=False).merged
        compiled = load_or_compile(merged, settings.compiled_trees_dir) if merged is not None else None
        done["compiled_trees"] = round(time.monotonic() - t0, 1) if compiled is not None else None
    return done


class OutsideWorkers:
    """An outside session (:class:`bench.outside.OutsideSession`) as the harness
    drives a worker: its variant, a tag, its topics (deleted when it stops)."""

    TOPICS = ("transactions", "decisions", "dlq", "feedback", "monitoring", "labels")

    def __init__(self, variant: Variant, tag: str, session: Any, topic_names: Sequence[str]) -> None:
        self.variant = variant
        self.tag = tag
        self.session = session
        self.topics = dict(zip(self.TOPICS, topic_names))

    def alive(self) -> bool:
        return bool(self.session.alive())

    def stop(self) -> None:
        self.session.stop()


async def _delete_topics(bootstrap: str, names: list[str], options: Mapping[str, Any] | None = None) -> None:
    """Best effort: a topic left behind costs memory, not correctness."""
    from aiokafka.admin import AIOKafkaAdminClient

    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, **(options or {}))
    try:
        await admin.start()
        await asyncio.wait_for(admin.delete_topics(names), 10.0)
    except Exception as exc:
        print(f"bench: could not delete topics {names}: {exc!r}", file=sys.stderr, flush=True)
    finally:
        with contextlib.suppress(Exception):
            await admin.close()
