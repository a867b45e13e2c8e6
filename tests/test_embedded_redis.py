"""An embedded redis-server never outlives the process that started it, SIGKILL included."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from shared.bus import EmbeddedRedis

ROOT = Path(__file__).resolve().parents[1]
GONE_WITHIN_S = 15.0

# Starts an embedded server, says where it is, then waits to be killed.
STARTER = """
import json, sys, time
from pathlib import Path
from shared.bus import EmbeddedRedis
db = sys.argv[1] or None
server = EmbeddedRedis(Path(db) if db else None)
print(json.dumps({"pid": server.server_pid, "socket": str(server.socket_path),
                  "dir": server._server.redis_dir}), flush=True)
time.sleep(600)
"""


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie is gone for our purposes (its parent, init, reaps it)
    status = Path(f"/proc/{pid}/stat")
    return status.exists() and status.read_text().split(") ")[-1][:1] != "Z"


def wait_gone(pid: int) -> bool:
    deadline = time.monotonic() + GONE_WITHIN_S
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not alive(pid)


def start_and_kill(db_path: str) -> dict[str, object]:
    starter = subprocess.Popen(
        [sys.executable, "-c", STARTER, db_path],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert starter.stdout is not None
        where = json.loads(starter.stdout.readline())
        assert isinstance(where["pid"], int) and alive(where["pid"])
        starter.send_signal(signal.SIGKILL)
        starter.wait(timeout=10)
    finally:
        if starter.poll() is None:
            starter.kill()
            starter.wait()
    return where


def test_a_private_server_dies_with_its_sigkilled_starter() -> None:
    where = start_and_kill("")
    pid = int(where["pid"])  # type: ignore[call-overload]
    try:
        assert wait_gone(pid), f"redis-server {pid} outlived its starter"
        deadline = time.monotonic() + 5.0
        while Path(str(where["dir"])).exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not Path(str(where["dir"])).exists()  # its temporary directory went with it
    finally:
        if alive(pid):
            os.kill(pid, signal.SIGKILL)


def test_a_shared_server_stops_once_its_sigkilled_starter_left_no_client(
    tmp_path: Path,
) -> None:
    where = start_and_kill(str(tmp_path / "shared.db"))
    pid = int(where["pid"])  # type: ignore[call-overload]
    try:
        assert wait_gone(pid), f"redis-server {pid} outlived its starter"
    finally:
        if alive(pid):
            os.kill(pid, signal.SIGKILL)


def test_a_clean_stop_ends_the_watchdog_too() -> None:
    server = EmbeddedRedis()
    watchdog, pid = server.watchdog, server.server_pid
    assert watchdog is not None and pid is not None
    server.stop()
    assert watchdog.poll() is not None and wait_gone(pid)
    assert server.watchdog is None


def test_the_watchdog_leaves_a_shared_server_in_use(tmp_path: Path) -> None:
    """A shared server whose starter died still serves the processes connected to it."""
    import redis

    db = str(tmp_path / "shared.db")
    where = start_and_kill(db)
    pid = int(where["pid"])  # type: ignore[call-overload]
    client = redis.Redis(unix_socket_path=str(where["socket"]))
    try:
        client.set("k", "v")
        time.sleep(4.0)  # past the watchdog's idle checks: a connected client keeps it up
        assert client.get("k") == b"v" and alive(pid)
    finally:
        client.close()
    try:
        assert wait_gone(pid), "the shared server outlived its last client"
    finally:
        if alive(pid):
            os.kill(pid, signal.SIGKILL)
