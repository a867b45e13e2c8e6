"""The services of a chaos run, one process each, that can be SIGKILLed and started again.

Every process runs `python -m services <service>` in a session (process group) of its own, so
a kill takes whatever it started with it; each start gets a fresh replica name
(`<cell>-<instance>-<n>`), as a real restart on another pod would. All of them share one Redis
and one cell, and take the same settings (environment variables) on every start.

An *instance* is one slot of the deployment: `gateway`, `scheduler`, `verifier`, and one
`drafter:<model>:<i>` per replica of each draft model. A kill names a *target*: a service (its
first instance: `drafter` is the first drafter) or `drafter:<model>` (that model's first replica).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

from shared.model.model_set import REPO_ROOT

SERVICES = ("gateway", "scheduler", "verifier", "drafter")
STOP_TIMEOUT_S = 60.0  # SIGTERM, then SIGKILL: each service has its own 20 s stop bound


@dataclass(frozen=True)
class Draft:
    """A draft model and how many drafter replicas serve it."""

    name: str
    dir: Path
    replicas: int = 1


@dataclass(frozen=True)
class Models:
    target: Path
    drafts: tuple[Draft, ...]

    def __post_init__(self) -> None:
        if not self.drafts or any(d.replicas < 1 for d in self.drafts):
            raise ValueError("a chaos run needs at least one drafter replica of every draft")
        names = [d.name for d in self.drafts]
        if len(set(names)) != len(names):
            raise ValueError(f"draft models named twice: {names}")

    def instances(self) -> list[str]:
        """Every instance to start, model services first (the scheduler waits on them)."""
        drafters = [f"drafter:{d.name}:{i}" for d in self.drafts for i in range(d.replicas)]
        return ["verifier", *drafters, "scheduler", "gateway"]


def kill_targets(models: Models) -> list[str]:
    """What a kill may name: the services, and `drafter:<model>` for each draft model."""
    return [*SERVICES, *(f"drafter:{d.name}" for d in models.drafts)]


@dataclass
class Incarnation:
    """One process of an instance."""

    service: str
    instance: str
    replica: str
    process: subprocess.Popen[bytes]
    log: Path
    started_at: float  # monotonic


@dataclass
class Cluster:
    """The running processes, by instance; `start` and `kill` keep `current` up to date."""

    redis_url: str
    cell: str
    port: int
    models: Models
    logs: Path
    settings: Mapping[str, str]  # AUGURY_* variables every service gets
    threads: int = 1
    current: dict[str, Incarnation] = field(default_factory=dict)
    every: list[Incarnation] = field(default_factory=list)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def env(self, replica: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("AUGURY_")}
        drafts = [{"name": d.name, "dir": str(d.dir)} for d in self.models.drafts]
        env.update(
            {
                "PYTHONPATH": str(REPO_ROOT),
                "AUGURY_REDIS__URL": self.redis_url,
                "AUGURY_SERVICE__CELL": self.cell,
                "AUGURY_SERVICE__REPLICA": replica,
                "AUGURY_GATEWAY__PORT": str(self.port),
                "AUGURY_MODELS__TARGET_DIR": str(self.models.target),
                "AUGURY_MODELS__DRAFTS": json.dumps(drafts),
                **self.settings,
            }
        )
        return env

    def instance_for(self, target: str) -> str:
        """The live instance a kill of `target` hits (see the module's docstring)."""
        if target not in kill_targets(self.models):
            known = ", ".join(kill_targets(self.models))
            raise ValueError(f"unknown kill target {target!r}; one of {known}")
        for instance in self.current:
            if instance == target or instance.startswith(target + ":"):
                return instance
        raise ValueError(f"no live instance of {target!r} to kill")

    def start(self, instance: str) -> Incarnation:
        if instance not in self.models.instances():
            known = ", ".join(self.models.instances())
            raise ValueError(f"unknown instance {instance!r}; one of {known}")
        service, _, draft = instance.partition(":")
        number = sum(1 for i in self.every if i.instance == instance)
        replica = f"{self.cell}-{instance.replace(':', '-')}-{number}"
        args = [service]
        if service == "drafter":
            args += ["--name", draft.partition(":")[0]]
        command = [sys.executable, "-m", "services", *args, "--threads", str(self.threads)]
        self.logs.mkdir(parents=True, exist_ok=True)
        log = self.logs / f"{replica}.log"
        # stderr to a file: a pipe nobody drains blocks a process that logs more than it holds
        with log.open("wb") as out:
            process = subprocess.Popen(
                command,
                cwd=REPO_ROOT,
                env=self.env(replica),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group: killed whole
            )
        incarnation = Incarnation(service, instance, replica, process, log, time.monotonic())
        self.current[instance] = incarnation
        self.every.append(incarnation)
        return incarnation

    def kill(self, target: str) -> Incarnation:
        """SIGKILL the target's live instance's process group (no shutdown, no goodbye to
        Redis); `start(incarnation.instance)` brings it back."""
        incarnation = self.current.pop(self.instance_for(target))
        _signal_group(incarnation.process, signal.SIGKILL)
        incarnation.process.wait()
        return incarnation

    def exited(self) -> list[Incarnation]:
        """Current processes that died without being killed by us."""
        return [i for i in self.current.values() if i.process.poll() is not None]

    def stop_all(self) -> None:
        """SIGTERM every live process group, then SIGKILL what is left after the bound."""
        live = [i for i in self.every if i.process.poll() is None]
        for incarnation in live:
            _signal_group(incarnation.process, signal.SIGTERM)
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for incarnation in live:
            try:
                incarnation.process.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal_group(incarnation.process, signal.SIGKILL)
                incarnation.process.wait()
        for incarnation in self.every:  # anything a dead leader left in its group
            _signal_group(incarnation.process, signal.SIGKILL)
        self.current.clear()

    def log_tail(self, incarnation: Incarnation, num_chars: int = 3000) -> str:
        return incarnation.log.read_text(errors="replace")[-num_chars:]


def _signal_group(process: subprocess.Popen[bytes], sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, sig)


async def wait_alive(cluster: Cluster, incarnation: Incarnation, timeout_s: float) -> float:
    """Until the incarnation's heartbeat is in Redis (it has started serving); the time then.
    Raises RuntimeError when the process exits or the bound passes."""
    from shared.bus import Bus
    from shared.bus.heartbeat import live_replicas
    from shared.settings import RedisSettings

    bus = Bus(cluster.redis_url, RedisSettings(url=cluster.redis_url), f"{cluster.cell}-chaos")
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            if incarnation.process.poll() is not None:
                raise RuntimeError(
                    f"{incarnation.replica} exited with {incarnation.process.returncode}:\n"
                    + cluster.log_tail(incarnation)
                )
            beats = await live_replicas(bus, cluster.cell, incarnation.service)
            if any(beat.replica == incarnation.replica for beat in beats):
                return time.monotonic()
            if time.monotonic() > deadline:
                raise RuntimeError(f"{incarnation.replica} did not start in {timeout_s:g} s")
            await asyncio.sleep(0.1)
    finally:
        await bus.close()


async def wait_ready(cluster: Cluster, timeout_s: float) -> None:
    """Until the gateway's /health/ready answers 200: a one-token generation went through
    gateway, scheduler, verifier and back. Raises RuntimeError if a process exits."""
    deadline = time.monotonic() + timeout_s
    url = f"{cluster.base_url}/health/ready"
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        while True:
            for incarnation in cluster.exited():
                raise RuntimeError(
                    f"{incarnation.replica} exited with {incarnation.process.returncode}:\n"
                    + cluster.log_tail(incarnation)
                )
            try:
                async with session.get(url) as response:
                    if response.status == 200:
                        return
            except (aiohttp.ClientError, OSError, TimeoutError):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"the services were not ready in {timeout_s:g} s")
            await asyncio.sleep(1.0)
