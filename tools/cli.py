"""``fraud-pipeline``: one command, a subcommand per job.

    simulate      generate labelled transactions (Parquet)
    materialize   write profile and merchant features to Redis
    train         train, evaluate and register the ensemble (--from-feedback: from served vectors + labels)
    models        list | promote | rollback | shadow: which version decides, recorded with who/when
    rules         backtest a rules file on replayed feedback; promote it to the workers
    report        quality: live precision/recall per model version and rule
    worker        run a scoring worker (a faust worker)
    gateway       REST entry point (POST /v1/transactions) and the analyst review page
    loadgen       produce live transactions at a fixed rate and measure decisions
    topics        create the topics with their partition counts
    keys          create a producer client's signing key
    decision-key  create (or rotate) the workers' decision signing key and publish its public key
    stack         start/stop the local broker and Redis (up | down | status)
    scale         autoscaling: `scale advise` recommends a worker count from lag and throughput
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
from dataclasses import asdict
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

__all__ = ["main"]

DEFAULT_DATA = Path("data/transactions.parquet")


def _sim_sidecar(path: Path) -> Path:
    return path.with_suffix(".sim.json")


def cmd_simulate(args: argparse.Namespace) -> int:
    from tools.simulator import SimulationConfig, simulate, write_parquet

    end = datetime.fromisoformat(args.end) if args.end else None
    cfg = SimulationConfig(
        n_users=args.users, n_merchants=args.merchants, days=args.days, seed=args.seed, end=end,
        scenarios=args.scenarios,
    )
    df = simulate(cfg, progress=not args.quiet)
    write_parquet(df, args.out)
    # The load generator rebuilds the same population from this.
    meta = {k: (v.isoformat() if isinstance(v, datetime) else v) for k, v in asdict(cfg).items()}
    _sim_sidecar(args.out).write_text(json.dumps(meta, indent=2) + "\n")
    counts = df["scenario"].value_counts().to_dict()
    print(f"wrote {len(df):,} transactions ({df['label'].mean():.2%} fraud) to {args.out}")
    print("  " + ", ".join(f"{k}: {v:,}" for k, v in sorted(counts.items())))
    return 0


def cmd_materialize(args: argparse.Namespace) -> int:
    import pandas as pd

    from app.redis_client import sync_client
    from app.settings import get_settings
    from tools.materialize import materialize

    settings = get_settings()
    client = sync_client(settings)
    df = pd.read_parquet(args.data)
    as_of = datetime.fromisoformat(args.as_of).timestamp() if args.as_of else None
    result = materialize(df, client, as_of=as_of, ttl_s=settings.profile_ttl_s, progress=not args.quiet)
    print(
        f"materialized {result.users:,} user profiles, {result.merchants:,} merchants and "
        f"{result.velocity_events:,} velocity events as of "
        f"{datetime.fromtimestamp(result.as_of).astimezone().isoformat()} into {settings.redis_url}"
    )
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    if args.from_feedback:
        return _train_from_feedback(args)
    from app.settings import get_settings
    from models.evaluation import HANDBOOK_XGBOOST
    from models.training import TrainConfig, format_metrics, format_thresholds, train
    from pipeline.datafile import read_transactions

    settings = get_settings()
    data = read_transactions(args.data, timezone=args.timezone)
    for note in data.notes:
        print(note)
    cfg = TrainConfig(train_days=args.train_days, delay_days=args.delay_days, test_days=args.test_days,
                      rounds_scale=args.rounds_scale, train_start=_train_start(args.train_start),
                      timezone=args.timezone or "UTC", search=args.search, folds=args.folds)  # fmt: skip
    print(f"features: night and weekend on {cfg.timezone} time (recorded in the manifest; workers serving this "
          "version compute them the same way)")  # fmt: skip
    # Hand train the only reference to the raw frame: it frees it once prepared
    # (gigabytes at ten million rows; docs/model-evaluation.md has the numbers).
    raw = [data.frame]
    del data
    try:
        result = train(raw.pop(), settings.registry_dir, cfg, progress=not args.quiet)
    except ValueError as exc:  # the data does not cover the windows, or a window holds one class
        print(f"fraud-pipeline train: {exc}", file=sys.stderr)
        return 2
    print(f"registered {result.version} in {result.folder}")
    print(format_metrics(result.metrics, result.window))
    print(format_thresholds(result.threshold_table))
    _serve_or_say(settings.registry_dir, result.version, args.serve_if_none, by=args.by)
    lo, hi = HANDBOOK_XGBOOST["auc"], HANDBOOK_XGBOOST["ap"]
    cp = HANDBOOK_XGBOOST["cp_at_100"]
    print(
        f"the Handbook's own XGBoost on its simulator's test week (other data; the baseline above is the "
        f"comparison on this data): AUC {lo[0]}-{lo[1]}, AP {hi[0]}-{hi[1]}, CP@100 {cp[0]}-{cp[1]}"
    )
    print(f"report: {result.folder / 'report' / 'curves.png'}; every test row's scores: "
          f"{result.folder / 'report' / 'test_scores.parquet'}")  # fmt: skip
    return 0


def _train_start(value: str | None) -> float | None:
    """--train-start: an ISO date or date-time; without an offset, UTC (the features' days are UTC days)."""
    if value is None:
        return None
    try:
        when = datetime.fromisoformat(value)
    except ValueError:
        from pipeline.datafile import DataFileError

        raise DataFileError(f"--train-start {value!r}: not an ISO date; write it as e.g. 2026-11-01") from None
    return (when if when.tzinfo else when.replace(tzinfo=UTC)).timestamp()


def _serve_or_say(registry: Path, version: str, serve_if_none: bool, by: str | None = None) -> None:
    """Training never changes what serves; a fresh registry's first model is
    promoted only when asked (``--serve-if-none``), and logged like any promotion
    (under ``by``, else the OS user: :func:`models.lifecycle.who`)."""
    from app.errors import ModelNotFound
    from models import lifecycle
    from models.registry import current_version

    try:
        serving: str | None = current_version(registry)
    except ModelNotFound:
        serving = None
    unservable = lifecycle.serving_problem(registry)[1] if serving is not None else None
    if serve_if_none and (serving is None or unservable):
        # A version this code refuses (another feature set, a bad checksum) serves
        # nothing: every worker would refuse to start on it.
        reason = ("first model in this registry" if serving is None
                  else f"the serving {serving} cannot be served by this code: {unservable}")  # fmt: skip
        entry = lifecycle.promote(registry, version, by=by, reason=f"{reason} (train --serve-if-none)")
        print(f"promoted {version}: {reason} (logged: {json.dumps(entry)})")
    elif serving is None:
        print(f"not serving: nothing serves yet; `fraud-pipeline models promote {version}` makes it serve")
    else:
        print(f"not serving: {serving} still serves; `fraud-pipeline models shadow {version}` compares them "
              f"live, `fraud-pipeline models promote {version}` switches")  # fmt: skip


def _train_from_feedback(args: argparse.Namespace) -> int:
    from app.settings import get_settings
    from models.from_feedback import feedback_training_set, train_from_feedback
    from models.training import TrainConfig, format_metrics
    from tools.replay import latest_labels, read_feedback, read_labels

    settings = get_settings()
    feedback = read_feedback(settings)
    labels = latest_labels(read_labels(settings))
    data = feedback_training_set(feedback, labels)
    print(f"read {len(feedback):,} feedback records and {len(labels):,} labelled transactions; "
          f"{len(data.labels):,} training rows ({int(data.labels.sum()):,} fraud); skipped {data.skipped}")  # fmt: skip
    try:
        result = train_from_feedback(
            data, settings.registry_dir, TrainConfig(rounds_scale=args.rounds_scale), test_share=args.test_share,
            min_rows=args.min_rows,
        )
    except ValueError as exc:
        print(f"fraud-pipeline train --from-feedback: {exc}", file=sys.stderr)
        return 2
    print(f"registered {result.version} in {result.folder} (not serving: "
          f"`fraud-pipeline models shadow {result.version}` or `models promote {result.version}`)")  # fmt: skip
    print(format_metrics(result.metrics, result.window))
    return 0


def cmd_models(args: argparse.Namespace) -> int:
    from app.errors import ModelNotFound
    from app.settings import get_settings
    from models import lifecycle
    from models.registry import current_version, list_versions, read_manifest

    registry = get_settings().registry_dir
    if args.action in ("promote", "shadow") and not args.version:
        what = "VERSION" if args.action == "promote" else "VERSION|off"
        print(f"fraud-pipeline models {args.action}: give the version: `fraud-pipeline models {args.action} {what}` "
              "(`fraud-pipeline models list` shows them)", file=sys.stderr)  # fmt: skip
        return 2
    if args.action == "check":
        # What a worker does at start: the serving version, its checksums and feature set.
        version, problem = lifecycle.serving_problem(registry)
        if problem:
            print(f"fraud-pipeline models check: {problem}", file=sys.stderr)
            return 1
        print(f"{version} serves and loads with this code")
        return 0
    if args.action == "promote":
        entry = lifecycle.promote(registry, args.version, by=args.by, reason=args.reason)
    elif args.action == "rollback":
        entry = lifecycle.rollback(registry, by=args.by, reason=args.reason)
    elif args.action == "shadow":
        version = None if args.version == "off" else args.version
        entry = lifecycle.set_shadow(registry, version, by=args.by, reason=args.reason)
    else:
        versions = list_versions(registry)
        if not versions:
            print(f"{registry} holds no model version; `fraud-pipeline train` registers one")
            return 0
        try:
            current: str | None = current_version(registry)
        except ModelNotFound:
            current = None
            print(f"no version serves yet; `fraud-pipeline models promote {versions[-1]}` makes it serve")
        shadow = lifecycle.shadow_version(registry)
        for version in versions:
            manifest = read_manifest(registry, version)
            ens = manifest.get("metrics", {}).get("ensemble", {})
            role = "serving" if version == current else "shadow" if version == shadow else ""
            source = manifest.get("data_window", {}).get("source", "history")
            print(f"{version:<20} {role:<8} AUC {ens.get('auc', float('nan')):.3f}  AP {ens.get('ap', float('nan')):.3f}"
                  f"  trained from {source}")  # fmt: skip
        for entry in lifecycle.history(registry)[-args.last:]:
            print("  " + json.dumps(entry))
        return 0
    print(json.dumps(entry))
    return 0


def cmd_rules(args: argparse.Namespace) -> int:
    from app.settings import get_settings
    from pipeline.backtest import backtest, format_backtest
    from pipeline.rules import load_rules

    settings = get_settings()
    if args.action == "promote":
        from models.lifecycle import promote_rules

        entry = promote_rules(settings.registry_dir, args.rules_file, settings.rules_path, by=args.by, reason=args.reason)
        print(json.dumps(entry))
        return 0
    from tools.replay import latest_labels, read_feedback, read_labels

    rules = load_rules(args.rules_file)
    since = None
    if args.since:
        when = datetime.fromisoformat(args.since)
        since = (when if when.tzinfo else when.replace(tzinfo=UTC)).timestamp()
    result = backtest(read_feedback(settings), rules, latest_labels(read_labels(settings)), since)
    print(json.dumps(result.to_dict()) if args.json else format_backtest(result))
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from app.redis_keys import quality_prefix
    from app.settings import get_settings
    from pipeline.quality import JoinLedger, RedisQualityStore, format_quality, quality_report, served_from_feedback

    settings = get_settings()
    if args.replay:
        from tools.replay import read_feedback, read_labels

        ledger = JoinLedger(window_s=float("inf"))
        for doc in read_feedback(settings):
            served = served_from_feedback(doc)
            if served is not None:
                ledger.add_served(served)
        for label in sorted(read_labels(settings), key=lambda lb: lb.labeled_at):
            ledger.add_label(label)
        report = quality_report(ledger.joined.values(), ledger.decided)
    else:
        from app.redis_client import BATCH_TIMEOUT_S, async_client, is_cluster

        async def snapshot() -> Any:
            # One server or a Redis Cluster, as the workers' (one-off: a batch job's timeout).
            client = async_client(settings, timeout_s=BATCH_TIMEOUT_S)
            try:
                store = RedisQualityStore(client, prefix=quality_prefix(settings.app_id), cluster=is_cluster(settings))
                return await store.snapshot()
            finally:
                await client.aclose()

        joined, decided = asyncio.run(snapshot())
        report = quality_report(joined, decided)
    print(json.dumps(report, indent=2) if args.json else format_quality(report))
    return 0


def cmd_topics(args: argparse.Namespace) -> int:
    from app.settings import get_settings
    from app.topics import ensure_topics

    topics = asyncio.run(ensure_topics(get_settings()))
    for name, partitions in topics.items():
        print(f"{name}: {partitions} partitions")
    return 0


def cmd_worker(args: argparse.Namespace) -> int:
    import faust

    from agents.wiring import create_app
    from app.settings import Settings
    from app.topics import ensure_topics

    overrides: dict[str, Any] = {}
    if args.web_port:
        overrides["web_port"] = args.web_port
    if args.role:
        overrides["worker_role"] = args.role
    settings = Settings(**overrides)
    try:
        asyncio.run(ensure_topics(settings, wait_s=args.broker_wait))
    except Exception as exc:  # still unreachable after the retries: say so, no traceback
        print(
            f"fraud-pipeline worker: broker {settings.kafka_bootstrap} unreachable for "
            f"{args.broker_wait:.0f} s ({exc}); check KAFKA_BOOTSTRAP and that the broker runs",
            file=sys.stderr,
        )
        return 3
    # faust keeps its table state under data_dir (default .stack/faust): a fresh
    # clone has no .stack yet.
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    if settings.worker_role == "feedback":
        from agents.feedback import create_feedback_app

        app = create_feedback_app(settings)
    else:
        app = create_app(settings)
    # Which identity this process presents: on a secured deployment each role has its own.
    logging.getLogger(__name__).info(
        "worker role %s: Kafka %s, Redis user %s", settings.worker_role,
        f"user {settings.kafka_sasl_username} ({settings.kafka_sasl_mechanism}{' over TLS' if settings.kafka_ssl else ''})"
        if settings.kafka_sasl_mechanism else "without authentication",
        settings.redis_username or "default",
    )  # fmt: skip
    worker = faust.Worker(app, loglevel=args.loglevel, quiet=True)
    worker.execute_from_commandline()
    return 0


def cmd_gateway(args: argparse.Namespace) -> int:
    from app.settings import Settings
    from app.topics import ensure_topics
    from gateway.serve import run

    settings = Settings()
    try:
        asyncio.run(ensure_topics(settings, wait_s=args.broker_wait))
    except Exception as exc:  # as the worker: one line, no traceback
        print(
            f"fraud-pipeline gateway: broker {settings.kafka_bootstrap} unreachable for "
            f"{args.broker_wait:.0f} s ({exc}); check KAFKA_BOOTSTRAP and that the broker runs",
            file=sys.stderr,
        )
        return 3
    grpc_port = settings.gateway_grpc_port if args.grpc_port is None else args.grpc_port
    run(settings, args.host or settings.gateway_host, args.port or settings.gateway_port, grpc_port)
    return 0


def cmd_loadgen(args: argparse.Namespace) -> int:
    from tools.loadgen import LoadConfig, run_load

    cfg = LoadConfig(
        rate=args.rate, duration_s=args.duration, data=args.data, fraud_rate=args.fraud_rate,
        seed=args.seed, report_every_s=args.every, label_share=args.labels, verify_share=args.verify_share,
    )
    summary = asyncio.run(run_load(cfg))
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2) + "\n")
    return 0 if summary["lost"] == 0 else 1


def cmd_keys(args: argparse.Namespace) -> int:
    """Add a producer client with a fresh random key to a keys file (created 0600)."""
    import os
    import secrets

    path: Path = args.file
    doc = json.loads(path.read_text()) if path.is_file() else {"clients": {}}
    if args.client in doc["clients"] and not args.rotate:
        print(f"client {args.client!r} already has a key in {path} (use --rotate to replace it)")
        return 0
    doc["clients"][args.client] = secrets.token_hex(32)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(json.dumps(doc, indent=2) + "\n")
    print(f"client {args.client!r}: key written to {path} (give the worker FRAUD_CLIENT_KEYS_FILE={path})")
    return 0


def cmd_decision_key(args: argparse.Namespace) -> int:
    """The workers' Ed25519 key (PEM, 0600) and the public keys file consumers verify with.

    An existing key is kept (its public key is published if missing) unless
    ``--rotate``: then a new key replaces it and the old public key stays
    published next to the new one until ``--retire <key id>``.
    """
    from pipeline.decision_signing import (
        DecisionSigner,
        DecisionVerifier,
        write_private_key,
        write_public_keys,
    )

    key_path: Path = args.key
    public_path: Path = args.public
    published = DecisionVerifier.from_file(public_path) if public_path.is_file() else DecisionVerifier()
    keys = dict(published)
    if args.retire:
        if args.retire not in keys:
            print(f"no key {args.retire!r} in {public_path}")
            return 1
        if key_path.is_file() and DecisionSigner.from_file(key_path).key_id == args.retire:
            print(f"key {args.retire} is the one in {key_path}, which workers sign with: rotate first")
            return 1
        del keys[args.retire]
        write_public_keys(DecisionVerifier(keys.values()), public_path)
        print(f"key {args.retire} retired from {public_path}; decisions it signed no longer verify")
        return 0
    if key_path.is_file() and not args.rotate:
        signer = DecisionSigner.from_file(key_path)
        note = "kept"
    else:
        note = "rotated" if key_path.is_file() else "created"
        signer = DecisionSigner.generate()
        write_private_key(signer, key_path)
    keys[signer.key_id] = signer.public_key
    write_public_keys(DecisionVerifier(keys.values()), public_path)
    print(
        f"decision key {signer.key_id} {note} in {key_path} (workers: FRAUD_DECISION_SIGNING_KEY_FILE={key_path}); "
        f"published keys {sorted(keys)} in {public_path} (gateway, consumers: FRAUD_DECISION_PUBLIC_KEYS_FILE)"
    )
    return 0


def cmd_stack(args: argparse.Namespace) -> int:
    from tools import cluster, stack

    argv = [args.action, *(["--secure"] if args.secure else []), "--brokers", str(args.brokers)]
    return stack.main(argv, cluster_cli=cluster.cli)


def cmd_scale(args: argparse.Namespace) -> int:
    from app.settings import get_settings
    from tools.autoscale import advise, measure, measure_broker

    if args.from_broker:
        current = args.current_workers if args.current_workers is not None else 1
        m = asyncio.run(measure_broker(get_settings(), args.interval, current))
        partitions = args.partitions or m.partitions_seen
    else:
        m = asyncio.run(measure(args.worker or ["http://127.0.0.1:6066"], args.interval))
        partitions = args.partitions or get_settings().partitions
        current = args.current_workers if args.current_workers is not None else m.workers
    capacity = args.capacity_tps or m.capacity_per_worker_tps
    advice = advise(
        lag=m.lag, arrival_tps=m.arrival_tps, capacity_per_worker_tps=capacity, partitions=partitions,
        current_workers=current, drain_s=args.drain_s, target_utilization=args.target_utilization,
    )  # fmt: skip
    if args.json:
        print(json.dumps({"measurement": asdict(m), "advice": advice.to_dict()}, indent=2))
    else:
        print(f"recommended workers: {advice.workers}")
        for line in [*m.reasons, *advice.reasons]:
            print(f"  - {line}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fraud-pipeline", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    _add_data_commands(sub)
    _add_lifecycle_commands(sub)
    _add_service_commands(sub)
    _add_setup_commands(sub)
    _add_scale_commands(sub)
    return parser


def _add_data_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """simulate, materialize, train: data in, features to Redis, a model out."""
    p = sub.add_parser("simulate", help="generate labelled transactions")
    p.add_argument("--users", type=int, default=5000)
    p.add_argument("--merchants", type=int, default=10000)
    p.add_argument("--days", type=int, default=60)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--end", help="UTC end (exclusive), ISO date; default today's midnight")
    p.add_argument("--scenarios", choices=["all", "handbook"], default="all")
    p.add_argument("--out", type=Path, default=DEFAULT_DATA)
    p.add_argument("--quiet", action="store_true")
    p.set_defaults(func=cmd_simulate)

    p = sub.add_parser("materialize", help="write profile features to Redis")
    p.add_argument("--data", type=Path, default=DEFAULT_DATA)
    p.add_argument("--as-of", help="ISO time; default the midnight after the data")
    p.add_argument("--quiet", action="store_true")
    p.set_defaults(func=cmd_materialize)

    p = sub.add_parser("train", help="train, evaluate and register the ensemble")
    p.add_argument("--data", type=Path, default=DEFAULT_DATA,
                   help="transactions, Parquet or CSV: transaction_id, user_id, merchant_id, amount, timestamp "
                        "(epoch s or ms, or ISO-8601), label (0/1, true/false, fraud/legit); optional currency, "
                        "merchant_category, device_id, lat, lon, country")
    p.add_argument("--timezone", help="IANA zone (e.g. Europe/Brussels): whose local time naive timestamps are, and "
                                      "the wall clock the model's night/weekend features read (default UTC)")
    p.add_argument("--train-start", help="ISO date the training window starts (UTC unless an offset is given); "
                                         "default: the test window ends at the end of the data")
    p.add_argument("--train-days", type=int, default=7)
    p.add_argument("--delay-days", type=int, default=7)
    p.add_argument("--test-days", type=int, default=7)
    p.add_argument("--quiet", action="store_true")
    p.add_argument("--from-feedback", action="store_true",
                   help="train on the served feature vectors in `feedback` joined with `labels` (registered, not served)")
    p.add_argument("--test-share", type=float, default=0.25, help="--from-feedback: newest share held out for evaluation")
    p.add_argument("--min-rows", type=int, default=200, help="--from-feedback: refuse to train on fewer labelled rows")
    p.add_argument("--rounds-scale", type=float, default=1.0, help="multiply each member's boosting rounds")
    p.add_argument("--search", choices=("light", "full"), default="light",
                   help="prequential validation: light = each member's default parameters, one fold (fast); "
                        "full = every grid entry over --folds folds")
    p.add_argument("--folds", type=int, default=3, help="--search full: validation folds, each a week further back")
    p.add_argument("--serve-if-none", action="store_true",
                   help="if no version serves yet (a fresh registry), or the serving one cannot be "
                        "served by this code (`models check`), promote this one (logged); otherwise "
                        "training never changes what serves")
    p.add_argument("--by", help="--serve-if-none: who the promotion is logged under (default: the OS user)")
    p.set_defaults(func=cmd_train)


def _add_lifecycle_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """models, rules, report: what serves, and how well it decides."""
    p = sub.add_parser("models", help="list, check, promote, roll back or shadow model versions",
                       description="models list | models check | models promote VERSION | models rollback | "
                                   "models shadow VERSION | models shadow off")  # fmt: skip
    p.add_argument("action", choices=["list", "check", "promote", "rollback", "shadow"])
    p.add_argument("version", nargs="?", help="promote/shadow: the version; `shadow off` stops the shadow")
    p.add_argument("--by", help="who the change is logged under (default: the OS user)")
    p.add_argument("--reason", help="recorded with the change")
    p.add_argument("--last", type=int, default=10, help="list: history lines to show")
    p.set_defaults(func=cmd_models)

    p = sub.add_parser("rules", help="backtest a rules file on replayed feedback, or promote it")
    p.add_argument("action", choices=["backtest", "promote"])
    p.add_argument("rules_file", type=Path)
    p.add_argument("--since", help="backtest: decisions at or after this ISO time (UTC if no offset)")
    p.add_argument("--by", help="promote: who it is logged under (default: the OS user)")
    p.add_argument("--reason", help="promote: recorded with the change")
    p.add_argument("--json", action="store_true", help="backtest: machine-readable summary")
    p.set_defaults(func=cmd_rules)

    p = sub.add_parser("report", help="reports: quality per model version and rule")
    p.add_argument("what", choices=["quality"])
    p.add_argument("--replay", action="store_true",
                   help="recompute from the feedback and labels topics (offset 0) instead of the workers' Redis state")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_report)


def _add_service_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """worker, gateway, loadgen: run the pipeline and put load on it."""
    p = sub.add_parser("worker", help="run a scoring worker")
    p.add_argument("--web-port", type=int, help="faust web port (one per worker on a machine)")
    p.add_argument(
        "--role", choices=["all", "score", "feedback"],
        help="default FRAUD_WORKER_ROLE (all: scoring and the feedback loop in one process; "
        "production: score workers plus a feedback worker)",
    )  # fmt: skip
    p.add_argument("--loglevel", default="info")
    p.add_argument("--broker-wait", type=float, default=120.0, help="seconds to wait for the broker at start")
    p.set_defaults(func=cmd_worker)

    p = sub.add_parser("gateway", help="REST entry point and analyst review page")
    p.add_argument("--port", type=int, help="default FRAUD_GATEWAY_PORT (8080)")
    p.add_argument("--host", help="default FRAUD_GATEWAY_HOST (127.0.0.1; 0.0.0.0 in a container)")
    p.add_argument(
        "--grpc-port", type=int,
        help="also serve gRPC (fraud.v1.FraudScoring, docs/grpc.md) on this port; default FRAUD_GATEWAY_GRPC_PORT (0: off)",
    )  # fmt: skip
    p.add_argument("--broker-wait", type=float, default=120.0, help="seconds to wait for the broker at start")
    p.set_defaults(func=cmd_gateway)

    p = sub.add_parser("loadgen", help="produce live transactions and measure decisions")
    p.add_argument("--rate", type=float, default=200.0, help="transactions per second (Poisson)")
    p.add_argument("--duration", type=float, default=20.0, help="seconds")
    p.add_argument("--data", type=Path, default=DEFAULT_DATA, help="simulated data (for its population)")
    p.add_argument("--fraud-rate", type=float, default=0.02)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--every", type=float, default=1.0, help="seconds between progress lines")
    p.add_argument("--json", help="write the summary here")
    p.add_argument("--labels", type=float, default=0.0,
                   help="share of transactions also labelled with the simulator's ground truth (feedback loop demos)")
    p.add_argument("--verify-share", type=float, default=1.0,
                   help="share of decisions whose signature is checked (with FRAUD_DECISION_PUBLIC_KEYS*)")
    p.set_defaults(func=cmd_loadgen)


def _add_setup_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """keys, topics, stack: what the services need before they start."""
    p = sub.add_parser("keys", help="create a producer client key (HMAC signing)")
    p.add_argument("client", help="the producing client's id, e.g. pos-eu-1")
    p.add_argument("--file", type=Path, default=Path("config/client-keys.json"))
    p.add_argument("--rotate", action="store_true", help="replace an existing key")
    p.set_defaults(func=cmd_keys)

    p = sub.add_parser("decision-key", help="create or rotate the workers' decision signing key (Ed25519)")
    p.add_argument("--key", type=Path, default=Path("config/decision-key.pem"), help="the private key (PEM, 0600)")
    p.add_argument("--public", type=Path, default=Path("config/decision-public-keys.json"),
                   help="the public keys file consumers verify with")
    p.add_argument("--rotate", action="store_true", help="replace the private key; the old public key stays valid")
    p.add_argument("--retire", metavar="KEY_ID", help="remove a rotated-out key from the public keys file")
    p.set_defaults(func=cmd_decision_key)

    p = sub.add_parser("topics", help="create the topics")
    p.set_defaults(func=cmd_topics)

    p = sub.add_parser("stack", help="local broker and Redis")
    p.add_argument("action", choices=["up", "down", "status"])
    p.add_argument("--secure", action="store_true",
                   help="up: SASL/SCRAM over TLS with per-role ACLs (SECURITY.md)")  # fmt: skip
    p.add_argument("--brokers", type=int, default=1,
                   help="3: 3 Kafka brokers, 3 KRaft controllers and a Redis with replicas and Sentinels (tools/cluster.py)")  # fmt: skip
    p.set_defaults(func=cmd_stack)


def _add_scale_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """scale advise: how many workers the measured load needs."""
    p = sub.add_parser("scale", help="autoscaling advice from consumer lag and measured throughput")
    scale = p.add_subparsers(dest="scale_command", required=True)
    p = scale.add_parser(
        "advise", help="recommend a worker count (capped by the partition count), with the reasoning",
        description="Scrape every worker's /metrics twice, INTERVAL seconds apart (or, with --from-broker, read "
        "the consumer group's offsets from the broker); from the lag per partition and the measured throughput, "
        "recommend how many workers the load needs.",
    )  # fmt: skip
    p.add_argument("--worker", action="append", metavar="URL",
                   help="a worker's web address, e.g. http://127.0.0.1:6066 (repeat per worker; default that one)")
    p.add_argument("--from-broker", action="store_true",
                   help="read lag and rates from the broker (KAFKA_BOOTSTRAP, group FRAUD_APP_ID) instead of the "
                        "workers; needs --capacity-tps")
    p.add_argument("--interval", type=float, default=5.0, help="seconds between the two samples")
    p.add_argument("--drain-s", type=float, default=60.0, help="drain the current lag within this many seconds")
    p.add_argument("--target-utilization", type=float, default=0.7, help="keep each worker this busy at most")
    p.add_argument("--capacity-tps", type=float, help="per-worker capacity to assume instead of the measured one")
    p.add_argument("--partitions", type=int, help="partitions of the transactions topic (default FRAUD_PARTITIONS)")
    p.add_argument("--current-workers", type=int, help="workers running now (default: the number scraped)")
    p.add_argument("--json", action="store_true", help="print the measurement and advice as JSON")
    p.set_defaults(func=cmd_scale)


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    try:
        from app.settings import check_environment

        check_environment()  # before any command: a mistyped FRAUD_* name must not pass silently
        return int(args.func(args))
    except Exception as exc:  # one clear line for the operator, not a traceback
        from app.errors import FraudPipelineError

        if isinstance(exc, (FraudPipelineError, FileNotFoundError)):
            print(f"fraud-pipeline {args.command}: {exc}", file=sys.stderr)
            return 2
        raise


if __name__ == "__main__":
    sys.exit(main())
