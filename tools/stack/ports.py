"""Ports on loopback: the stack's fixed ones and free ones for tests."""

from __future__ import annotations

import random
import socket
from pathlib import Path

from app.errors import StackError

__all__ = ["DEFAULT_BROKER_PORT", "DEFAULT_REDIS_PORT", "ensure_port_free", "free_port", "free_ports"]

#: Fixed ports for ``up`` (tests use free ports), off the standard 9092/6379 so a
#: system Kafka or Redis on this machine is never mistaken for ours.
DEFAULT_BROKER_PORT = 19092
DEFAULT_REDIS_PORT = 16379


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now, its next port free too."""
    return free_ports(1)[0]


#: Where the kernel's ephemeral range starts when /proc does not say (Linux's default).
_EPHEMERAL_LOW = 32768
#: How far below the ephemeral range ports are drawn from.
_PORT_SPAN = 12000


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return _EPHEMERAL_LOW


def below_ephemeral(span: int = 0) -> tuple[int, int]:
    """(low, high): where ports are drawn from, below the kernel's ephemeral
    range with room for ``span`` more ports above ``high`` (see :func:`free_ports`)."""
    high = _ephemeral_low() - 2 - span
    return max(1024, high - _PORT_SPAN), high


def _probe(port: int) -> socket.socket | None:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind(("127.0.0.1", port))
    except OSError:
        sock.close()
        return None
    return sock


def free_ports(n: int) -> list[int]:
    """``n`` different ports that nothing listens on now, each with its next port
    free too: a broker's KRaft controller listens on the port after the broker's
    (``stack_up``), so any of them can be a broker's.

    Every probe is held until all are chosen. NOTE: ``free_port()`` called twice
    can return one port twice (the first is free again once its probe closes);
    ask for all the ports a test needs in one call. Seen once: a test's gateway
    failed to bind its gRPC port while its other gateway answered there.

    The ports are drawn at random from below the kernel's ephemeral range, not
    by binding port 0: an ephemeral port is also what every outgoing connection
    takes, so between the probe and the server's bind, one of the many client
    connections a parallel test run opens could take it. Seen once, on the port
    after a broker's, which was not probed then: its controller failed to bind.
    """
    high = _ephemeral_low() - 2  # a port and its next one, both below the range
    low = max(1024, high - _PORT_SPAN)
    rng = random.Random()  # seeded from the OS: parallel test workers draw differently
    held: list[socket.socket] = []
    chosen: list[int] = []
    try:
        for _ in range(100 * n + 100):
            if len(chosen) == n:
                break
            if high - low >= 1000:
                port = rng.randint(low, high)
            else:  # a machine whose ephemeral range starts low: let the kernel pick
                with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                    sock.bind(("127.0.0.1", 0))
                    port = int(sock.getsockname()[1])
            pair = [_probe(port), _probe(port + 1)]
            held.extend(sock for sock in pair if sock is not None)
            if None not in pair:
                chosen.append(port)
        if len(chosen) < n:
            raise StackError(f"found {len(chosen)} of {n} free ports on 127.0.0.1 between {low} and {high + 1}")
        return chosen
    finally:
        for sock in held:
            sock.close()


def ensure_port_free(port: int, name: str) -> None:
    """Fail early if ``port`` is taken: a probe would otherwise pass against the wrong server."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        # NOTE: SO_REUSEADDR as the servers set it: leftovers in TIME_WAIT from the
        # last run do not count as taken, only a listener does.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError as exc:
            raise StackError(
                f"cannot start {name}: 127.0.0.1:{port} is in use ({exc.strerror}); "
                "`python -m tools.stack status` (`status --secure`: the secure stack) shows whether it is ours"
            ) from exc

