"""Local network helpers."""

from __future__ import annotations

import random
import socket

_EPHEMERAL_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"


def free_port() -> int:
    """A TCP port free on this host right now (the caller binds it soon after), below the
    kernel's ephemeral range: a port of that range can be taken in between by any outgoing
    connection (gloo opens many), one below it only by another listener."""
    low = _ephemeral_low()
    rng = random.SystemRandom()
    for _ in range(100):
        port = rng.randrange(low // 2, low)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("", port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


def _ephemeral_low() -> int:
    try:
        with open(_EPHEMERAL_RANGE_FILE) as f:
            return max(2048, int(f.read().split()[0]))
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default range starts here
