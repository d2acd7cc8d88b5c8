"""free_port picks listening ports outside the kernel's ephemeral range, which outgoing
connections (gloo opens many per process group) take from: a port chosen there could be taken
between the choice and the bind (a test saw an SGLang stand-in fail to bind that way)."""

from __future__ import annotations

import socket

from gspo_megatron import network


def test_ports_are_free_and_below_the_ephemeral_range():
    low = network._ephemeral_low()
    ports = {network.free_port() for _ in range(20)}
    assert all(low // 2 <= p < low for p in ports) and len(ports) > 1
    for port in ports:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("", port))  # still free


def test_a_taken_port_is_skipped(monkeypatch):
    taken = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    taken.bind(("", 0))
    taken.listen()
    port = taken.getsockname()[1]
    # every draw lands on the taken port, then the kernel picks one
    monkeypatch.setattr(network.random.SystemRandom, "randrange", lambda self, a, b: port)
    try:
        assert network.free_port() != port
    finally:
        taken.close()
