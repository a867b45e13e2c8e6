"""The policies as real replays through the services, beside the simulator's account of them.

For each policy the services start fresh (`python -m services all`, in a cell of their own on
the system Redis) with `scheduler.policy` set, `scheduler.length_predictor = learned` where the
policy needs lengths, and a running set of `--batch-size`; the same held-out requests are sent
together (50 ms apart, so that arrival order is fixed), each with `max_tokens` = the target's
true answer length and `ignore_eos`. The client measures each request's latency; the preemption
totals come from the scheduler's Redis hash (what /metrics exports). The simulator then serves
the same requests with the cost profile the services published and the per-step overhead
measured from the scheduler's DEBUG log of these runs, and the two rankings are compared.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import signal
import subprocess
import sys
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp

from bench.scheduling.experiments import (
    BY_LABEL,
    mean_latency_s,
    p99_latency_s,
    simulate,
)
from bench.scheduling.workloads import Labelled, burst, draw, pool, trace_requests
from shared.model.model_set import REPO_ROOT
from shared.scheduling.cost_model import CostModel, ModelProfile
from shared.settings import LapsSettings
from tools.load.client import replay
from tools.load.records import RequestRecord
from tools.load.trace import TraceRequest
from tools.ports import free_port
from tools.sim.acceptance import AcceptanceModel

SPACING_S = 0.05
READY_TIMEOUT_S = 600.0
LOGS = REPO_ROOT / ".cache" / "bench-scheduling"
REDIS_URL = os.environ.get("AUGURY_REDIS__URL", "redis://127.0.0.1:6379/0")  # the system's


async def wait_ready(base_url: str, process: subprocess.Popen[bytes], timeout_s: float) -> None:
    """Until /health/ready answers 200 (a one-token generation went through)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"the services exited with {process.returncode}")
            try:
                async with session.get(f"{base_url}/health/ready") as response:
                    if response.status == 200:
                        return
            except (aiohttp.ClientError, OSError, TimeoutError):
                pass
            if asyncio.get_running_loop().time() > deadline:
                raise RuntimeError(f"the services were not ready in {timeout_s:g} s")
            await asyncio.sleep(1.0)


async def read_cell(cell: str) -> tuple[dict[str, int], dict[str, ModelProfile]]:
    """The cell's preemption totals (what /metrics exports) and its published cost profiles;
    then the cell's keys are deleted."""
    from shared.bus import Bus
    from shared.bus.preemptions import read_preemptions
    from shared.bus.profiles import read_profiles
    from shared.settings import RedisSettings
    from shared.wire.streams import cell_pattern

    bus = Bus(REDIS_URL, RedisSettings(url=REDIS_URL), "bench-scheduling")
    try:
        found = dict(await read_preemptions(bus, cell)), await read_profiles(bus, cell)
        keys = [key async for key in bus.redis.scan_iter(cell_pattern(cell), 200)]
        if keys:  # the run's streams and hashes: nothing else reads them
            await bus.redis.delete(*keys)
        return found
    finally:
        await bus.close()


def policy_env(policy: str, batch_size: int, laps: LapsSettings) -> dict[str, str]:
    """The settings (as environment variables) of a policy's run."""
    run = BY_LABEL[policy]
    env = {
        "AUGURY_SCHEDULER__POLICY": run.policy,
        "AUGURY_SCHEDULER__MAX_RUNNING_REQUESTS": str(batch_size),
    }
    for name, value in laps.model_dump().items():
        env[f"AUGURY_SCHEDULER__LAPS__{name.upper()}"] = str(value)
    if run.predictor is not None:
        env["AUGURY_SCHEDULER__LENGTH_PREDICTOR"] = run.predictor
    return env


def start_services(
    overrides: Mapping[str, str],
    *,
    draft: str | Sequence[str] | None,
    timeout_s: float,
    cell: str,
    port: int,
    log: Path,
) -> subprocess.Popen[bytes]:
    """`python -m services all` in `cell` on the system Redis, gateway on `port`, the settings
    `overrides` (environment variables) on top; its output (DEBUG) goes to `log`."""
    env = dict(os.environ)
    env.update(
        {
            "AUGURY_REDIS__URL": REDIS_URL,
            "AUGURY_SERVICE__CELL": cell,
            "AUGURY_GATEWAY__PORT": str(port),
            # one request at a time: a queued request waits for minutes without a token
            "AUGURY_GATEWAY__OUTPUT_IDLE_TIMEOUT_S": str(timeout_s),
        }
    )
    env.update(overrides)
    command = [sys.executable, "-m", "services", "all", "--threads", "2"]
    if draft is not None:  # None: every configured draft
        command += ["--drafts", *([draft] if isinstance(draft, str) else draft)]
    command += ["--log-level", "DEBUG"]  # the per-micro-batch timings the simulator calibrates on
    with log.open("wb") as out:
        return subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT)


def stop(process: subprocess.Popen[bytes]) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@dataclass
class Served:
    records: list[RequestRecord]
    preemptions: dict[str, int]
    cost: CostModel  # the profile the services published (what they measured or loaded)
    log: Path


@dataclass(frozen=True)
class Running:
    """Services started by `running`, ready."""

    cell: str
    base_url: str
    process: subprocess.Popen[bytes]
    log: Path


@contextmanager
def running(
    name: str,
    overrides: Mapping[str, str],
    *,
    draft: str | Sequence[str] | None,
    timeout_s: float,
    logs: Path = LOGS,
) -> Iterator[Running]:
    """Fresh services (a cell of their own, `overrides` set), ready; stopped on leaving."""
    cell = f"bench-{slug(name)}-{secrets.token_hex(3)}"
    port = free_port()
    logs.mkdir(parents=True, exist_ok=True)
    log = logs / f"{slug(name)}.log"  # DEBUG: large, kept out of the results
    process = start_services(
        overrides, draft=draft, timeout_s=timeout_s, cell=cell, port=port, log=log
    )
    try:
        base_url = f"http://127.0.0.1:{port}"
        asyncio.run(wait_ready(base_url, process, READY_TIMEOUT_S))
        yield Running(cell, base_url, process, log)
    finally:
        stop(process)


def slug(name: str) -> str:
    """A name fit for a cell and a file name (`lp-sjf/oracle` -> `lp-sjf-oracle`)."""
    return "".join(c if c.isalnum() or c in "-_." else "-" for c in name)


def replay_and_read(
    name: str, services: Running, trace: list[TraceRequest], timeout_s: float, *, strict: bool
) -> Served:
    """Replay `trace` through ready `services` and read their cell (then emptied); with
    `strict`, a failed request raises, else the failures stay in the records."""
    from shared.bus.profiles import assemble

    records = asyncio.run(replay(trace, services.base_url, request_timeout_s=timeout_s))
    preemptions, profiles = asyncio.run(read_cell(services.cell))
    failed = [r for r in records if not r.is_completed]
    if failed and strict:
        raise RuntimeError(f"{name}: {len(failed)} requests failed: {failed[0].error}")
    profile = assemble(profiles)
    if profile is None:
        raise RuntimeError(f"{name}: the services published no cost profile")
    return Served(records, preemptions, CostModel(profile), services.log)


def serve(
    policy: str, args: argparse.Namespace, laps: LapsSettings, trace: list[TraceRequest]
) -> Served:
    overrides = policy_env(policy, args.batch_size, laps)
    with running(policy, overrides, draft=args.draft, timeout_s=args.timeout_s) as services:
        return replay_and_read(policy, services, trace, args.timeout_s, strict=True)


def real(
    args: argparse.Namespace,
    heldout: Sequence[Labelled],
    laps: LapsSettings,
    acceptance: AcceptanceModel,
) -> dict[str, Any]:
    from bench.scheduling.experiments import Machine
    from tools.load.report import write_report
    from tools.sim.calibrate import mean_overhead, parse_log

    items = draw(pool(heldout, args.workload), args.requests, seed=args.seed)
    arrivals = burst(len(items), SPACING_S)
    trace = trace_requests(items, arrivals)
    served = {}
    for policy in args.policies:
        served[policy] = serve(policy, args, laps, trace)
        run = served[policy]
        write_report(args.out / "real" / policy, run.records, meta={"policy": policy}, plots=False)
        print(f"{policy}: mean {mean_latency_s(run.records):.2f} s", file=sys.stderr)
    # the simulator on the services' own profile, with their per-step overhead measured from
    # the scheduler's DEBUG log of every run (one request at a time: one number, no fit)
    cost = next(iter(served.values())).cost
    steps = [s for run in served.values() for s in parse_log(run.log.read_text().splitlines())]
    overhead = mean_overhead(steps, cost)
    machine = Machine("services' profile", cost, step_overhead_ms=overhead)
    out: dict[str, Any] = {
        "workload": args.workload,
        "requests": len(items),
        "batch_size": args.batch_size,
        "laps": laps.model_dump(),
        "device": cost.profile.target.key.device,
        "step_overhead_ms": overhead,
        "policies": {},
    }
    for policy, run in served.items():
        simulated = simulate(
            items, arrivals, machine, acceptance, BY_LABEL[policy],
            batch_size=args.batch_size, laps=laps, draft=args.draft,
        )  # fmt: skip
        out["policies"][policy] = {
            "mean_s": mean_latency_s(run.records),
            "p99_s": p99_latency_s(run.records),
            "simulated_mean_s": mean_latency_s(simulated),
            "preemptions": run.preemptions,
        }
    rows = out["policies"]
    out["ranking_real"] = sorted(rows, key=lambda p: rows[p]["mean_s"])
    out["ranking_sim"] = sorted(rows, key=lambda p: rows[p]["simulated_mean_s"])
    return out
