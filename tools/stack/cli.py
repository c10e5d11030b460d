"""``python -m tools.stack up|down|status|env``."""

from __future__ import annotations

import argparse
import logging
import shlex
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from app.errors import StackError
from tools import kafka_acls
from tools.stack.lifecycle import running, stack_down, stack_status, stack_up
from tools.stack.ports import DEFAULT_BROKER_PORT, DEFAULT_REDIS_PORT
from tools.stack.secure import role_env
from tools.stack.state import DEFAULT_SECURE_STATE_DIR, DEFAULT_STATE_DIR

__all__ = ["main"]

logger = logging.getLogger(__name__)

_DESCRIPTION = "The local stack: an Apache Kafka broker (KRaft, one node) and Redis on loopback."


def main(argv: Sequence[str] | None = None, cluster_cli: Callable[[argparse.Namespace], int] | None = None) -> int:
    """``python -m tools.stack up|down|status|env``; ``up`` and ``env`` print ``export`` lines for ``eval``.

    ``cluster_cli``: what runs ``--brokers 3`` (``tools.cluster.cli``; passed in by
    ``python -m tools.stack`` and the CLI, since tools.cluster builds on this module).
    """
    parser = argparse.ArgumentParser(
        prog="python -m tools.stack", description=_DESCRIPTION
    )
    parser.add_argument("command", choices=("up", "down", "status", "env"))
    parser.add_argument(
        "--secure", action="store_true",
        help="the secure stack (SASL/SCRAM over TLS, ACLs, Redis users per role), state in "
        f"{DEFAULT_SECURE_STATE_DIR} unless --state-dir",
    )  # fmt: skip
    parser.add_argument(
        "--brokers", type=int, default=1,
        help="1: one Kafka node and one Redis; 3 (or more): a KRaft cluster (3 replicas, min ISR 2) and a Redis "
        "primary with 2 replicas and 3 Sentinels (tools/cluster.py), state in .stack/cluster[-secure]",
    )  # fmt: skip
    parser.add_argument(
        "--state-dir", type=Path, help=f"PID, log and env files (default {DEFAULT_STATE_DIR})"
    )
    parser.add_argument("--broker-port", type=int, help=f"up: the broker's port (default {DEFAULT_BROKER_PORT}; "
                        "a cluster's first node: 29092, the next ones 2 ports apart)")  # fmt: skip
    parser.add_argument("--redis-port", type=int, help=f"up: Redis's port (default {DEFAULT_REDIS_PORT}; "
                        "a cluster's first Redis node: 29379)")  # fmt: skip
    parser.add_argument("--kafka-user", help="env: the process's SCRAM user on the secure broker")
    parser.add_argument("--redis-user", help="env: the process's ACL user on the secure Redis")
    args = parser.parse_args(argv)
    # Messages to stderr, so stdout of `up` stays fit for eval.
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    # The client library's own INFO lines ("Authenticated as admin ...") are noise here.
    logging.getLogger("aiokafka").setLevel(logging.WARNING)
    if args.brokers == 2 or args.brokers < 1:
        print("error: --brokers is 1 or at least 3 (3 replicas with min.insync.replicas=2)", file=sys.stderr)
        return 2
    try:
        if args.brokers >= 3:
            if cluster_cli is None:
                raise StackError("--brokers 3 runs through `python -m tools.stack` (tools/cluster.py)")
            return cluster_cli(args)
        state_dir: Path = args.state_dir or (DEFAULT_SECURE_STATE_DIR if args.secure else DEFAULT_STATE_DIR)
        if args.command == "up":
            return _cmd_up(
                state_dir, secure=args.secure, broker_port=args.broker_port or DEFAULT_BROKER_PORT,
                redis_port=args.redis_port or DEFAULT_REDIS_PORT,
                other=None if args.state_dir else (DEFAULT_STATE_DIR if args.secure else DEFAULT_SECURE_STATE_DIR),
            )  # fmt: skip
        if args.command == "env":
            env = role_env(state_dir, args.kafka_user, args.redis_user)
            print("".join(f"export {key}={shlex.quote(value)}\n" for key, value in env.items()), end="")
            return 0
        return _COMMANDS[args.command](state_dir)
    except StackError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


def _cmd_up(
    state_dir: Path,
    *,
    secure: bool = False,
    broker_port: int = DEFAULT_BROKER_PORT,
    redis_port: int = DEFAULT_REDIS_PORT,
    other: Path | None = None,
) -> int:
    """``other``: the default state dir of the other kind of stack, which uses the same ports."""
    if other is not None and (live := running(other)):
        kind = "secure" if other == DEFAULT_SECURE_STATE_DIR else "plaintext"
        raise StackError(
            f"the {kind} stack ({other}: {', '.join(live)}) holds the ports: stop it first "
            f"(`python -m tools.stack down{' --secure' if kind == 'secure' else ''}`)"
        )
    env = stack_up(state_dir, secure=secure, broker_port=broker_port, redis_port=redis_port)
    print((state_dir / "env").read_text(), end="")
    logger.info(
        "stack up: %s (env in %s)", ", ".join(f"{k}={v}" for k, v in env.items()), state_dir / "env"
    )
    if secure:
        logger.info(
            "secure stack: each process takes its role's users, e.g. "
            "`eval \"$(python -m tools.stack env --state-dir %s --kafka-user scoring --redis-user worker)\"` "
            "(Kafka users: %s; Redis users: %s)",
            state_dir, ", ".join(f"{role}={user}" for role, user in kafka_acls.ROLES.items()),
            ", ".join(_redis_roles()),
        )  # fmt: skip
    return 0


def _redis_roles() -> list[str]:
    from app.redis_keys import ACL_KEY_PATTERNS

    return [*ACL_KEY_PATTERNS, "admin"]


def _cmd_down(state_dir: Path) -> int:
    stack_down(state_dir)
    return 0


def _cmd_status(state_dir: Path) -> int:
    rows = stack_status(state_dir)
    for name, pid, url, ready in rows:
        pid_text = "-" if pid is None else str(pid)
        state = "ready" if ready else "NOT ready"
        print(f"{name:<7} pid {pid_text:<8} {url or '(not configured)':<28} {state}")
    return 0 if all(ready for *_, ready in rows) else 1


_COMMANDS: dict[str, Callable[[Path], int]] = {
    "down": _cmd_down,
    "status": _cmd_status,
}

