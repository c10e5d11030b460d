"""The ports tests, benches and the demo's test start servers on: each comes with
its next port free (a broker's controller listens there), and none is one that
an outgoing connection could take between the probe and the server's bind."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest

from tools import stack
from tools.stack import ports as stack_ports


def _bind_all(ports: set[int]) -> None:
    socks = []
    try:
        for port in sorted(ports):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            socks.append(sock)
            sock.bind(("127.0.0.1", port))  # raises if the port was not free
    finally:
        for sock in socks:
            sock.close()


def test_each_port_and_the_next_are_free_different_and_below_the_ephemeral_range() -> None:
    low = stack_ports._ephemeral_low()
    for _ in range(20):
        ports = stack.free_ports(6)
        taken = {*ports, *(port + 1 for port in ports)}
        assert len(taken) == 12
        assert max(taken) < low
        _bind_all(taken)


def test_a_listeners_port_is_never_given_nor_the_port_before_it(monkeypatch: pytest.MonkeyPatch) -> None:
    listened, spare = stack.free_ports(2)
    draws: Iterator[int] = iter([listened, listened - 1, spare])

    class Draws:
        def randint(self, a: int, b: int) -> int:
            return next(draws)

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
        listener.bind(("127.0.0.1", listened))
        listener.listen()
        monkeypatch.setattr(stack_ports.random, "Random", Draws)
        assert stack.free_ports(1) == [spare]
