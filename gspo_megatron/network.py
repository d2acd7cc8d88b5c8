"""Local network helpers."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A TCP port free on this host right now (the caller binds it soon after)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]
