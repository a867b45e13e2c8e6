"""Loopback ports for the processes a tool starts."""

from __future__ import annotations

import socket


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def port_free(port: int) -> bool:
    """Whether nothing listens on loopback `port`."""
    with socket.socket() as probe:
        return probe.connect_ex(("127.0.0.1", port)) != 0
