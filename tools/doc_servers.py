"""The servers a smoke run of the documented commands starts as a doc shows them
(`python -m services all ... &`, `bash scripts/serve.sh`, one service per process): each in the
background, in its own process group, until `python -m services health` says it is ready; the
commands after it in its doc run against it. Starting a whole stack stops whatever runs; starting
one service stops a whole stack (a split stack's services run side by side); the doc's end stops
them all; a stack stops only the servers of its own cell (`AUGURY_SERVICE__CELL`), so cells run
side by side. Every server shares one loopback Redis (`redis_url`), emptied between stacks, or,
where its doc sets `AUGURY_REDIS__CLUSTER=true`, a three-master Redis Cluster started then."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import redis

from tools.doc_extract import assignments
from tools.doc_smoke import DOC_PORT, server_probe, starts_a_stack

STOP_TIMEOUT_S = 30.0
POLL_S = 1.0


@dataclass
class Server:
    line: str
    probe: str  # the service `python -m services health` checks for readiness
    whole_stack: bool
    cell: str
    process: subprocess.Popen[bytes]
    log: Path


@dataclass
class Servers:
    """The running servers of one smoke run, and the environment the commands share with them."""

    cwd: Path
    redis_url: str
    port: int
    logs: Path
    running: list[Server] = field(default_factory=list)
    started: int = 0
    # (probe, cwd, env) -> whether the server is ready; None: `is_ready`
    ready: Callable[[str, Path, Mapping[str, str]], bool] | None = None
    start_cluster: Callable[[], str] | None = None  # starts a Redis Cluster: its URL
    cluster_url: str | None = None

    def env(self, command_env: Mapping[str, str] | None = None) -> dict[str, str]:
        """What every server, and every command while one runs, gets: the shared Redis (the
        cluster where `command_env` asks for one), the gateway's port, and request recording on
        (docs/load-testing.md)."""
        url = self.redis_url
        if (command_env or {}).get("AUGURY_REDIS__CLUSTER") == "true":
            if self.cluster_url is None:
                assert self.start_cluster is not None, "no way to start a Redis Cluster"
                self.cluster_url = self.start_cluster()
            url = self.cluster_url
        return {
            "AUGURY_REDIS__URL": url,
            "AUGURY_GATEWAY__PORT": str(self.port),
            "AUGURY_GATEWAY__RECORD_REQUESTS": "true",
        }

    def as_here(self, line: str) -> str:
        """`line` with the docs' gateway port and Redis host turned into this run's."""
        if self.port != DOC_PORT:
            line = re.sub(rf"(127\.0\.0\.1|localhost):{DOC_PORT}\b", rf"\1:{self.port}", line)
        return re.sub(r"redis://host:6379/0", self.redis_url, line)

    def start(
        self, line: str, command: str, env: Mapping[str, str], timeout_s: float
    ) -> tuple[str, float, str]:
        """Start `command` (the run form of the server `line`) in the background and wait for
        it: (pass | fail | timeout, seconds, the log's tail). A server that failed is stopped."""
        probe = server_probe(line)
        assert probe is not None, line
        whole_stack = starts_a_stack(line)
        env = {**env, **assignments(line)}
        cell = env.get("AUGURY_SERVICE__CELL", "0")
        self.stop(lambda s: s.cell == cell and (whole_stack or s.whole_stack))
        self.started += 1
        log = self.logs / f"server-{self.started}.log"
        with log.open("wb") as out:
            process = subprocess.Popen(
                command.removesuffix("&").rstrip(),
                shell=True,
                cwd=self.cwd,
                env={**os.environ, **env, **self.env(env)},
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        server = Server(line, probe, whole_stack, cell, process, log)
        self.running.append(server)
        started = time.monotonic()
        status = self._wait_ready(server, env, started + timeout_s)
        if status != "pass":
            self.stop(lambda s: s is server)
        return status, time.monotonic() - started, tail(log)

    def _wait_ready(self, server: Server, env: Mapping[str, str], deadline: float) -> str:
        ready = self.ready or is_ready
        while time.monotonic() < deadline:
            if server.process.poll() is not None:
                return "fail"
            if ready(server.probe, self.cwd, {**os.environ, **env, **self.env(env)}):
                return "pass"
            time.sleep(POLL_S)
        return "timeout"

    def stop(self, which: Callable[[Server], bool] = lambda server: True) -> None:
        """Stop the running servers `which` picks (all by default), each's process group
        SIGTERM then, past `STOP_TIMEOUT_S`, SIGKILL; Redis emptied once none runs."""
        for server in [s for s in self.running if which(s)]:
            stop_group(server.process)
            self.running.remove(server)
        if not self.running:
            client = redis.Redis.from_url(self.redis_url)
            try:
                client.flushdb()
            finally:
                client.close()


def is_ready(probe: str, cwd: Path, env: Mapping[str, str]) -> bool:
    """`python -m services health PROBE` (no torch import: well under a second) exits 0."""
    done = subprocess.run(
        [sys.executable, "-m", "services", "health", probe],
        cwd=cwd,
        env=dict(env),
        capture_output=True,
        check=False,
        timeout=60,
    )
    return done.returncode == 0


def stop_group(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    else:
        # the shell may be gone with its children still up
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)


def tail(log: Path, chars: int = 2000) -> str:
    return log.read_bytes()[-chars:].decode(errors="replace")
