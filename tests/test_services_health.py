"""`python -m services health [--live]`: liveness (no torch, no Redis) apart from readiness."""

from __future__ import annotations

import asyncio
import fnmatch
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from services.health import (
    LIVE_MAX_AGE_S,
    SERVICE_NAMES,
    alive,
    heartbeat_match,
    keep_alive,
    live_file,
    ready,
)
from shared.bus import Bus, EmbeddedRedis, Heartbeater
from shared.settings import AugurySettings
from shared.wire.streams import heartbeat_key
from tests.test_services_support import make_settings

pytestmark = pytest.mark.anyio
ROOT = Path(__file__).resolve().parents[1]


def test_the_probe_imports_no_torch(tmp_path: Path) -> None:
    """A healthcheck has seconds; importing torch alone takes seconds on a busy machine."""
    code = (
        "import sys; from services.__main__ import main; "
        "rc = main(['health', '--live', 'verifier']); "
        "print(rc, 'torch' in sys.modules)"
    )
    env = {**os.environ, "TMPDIR": str(tmp_path)}  # no other process's liveness files
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True, env=env
    )
    assert out.stdout.split() == ["1", "False"], out  # nothing of the verifier runs here


def test_service_names_match_the_runner() -> None:
    from services.run import SERVICES

    assert SERVICE_NAMES == SERVICES


async def test_liveness_follows_the_event_loop(tmp_path: Path) -> None:
    assert not alive("drafter", tmp_path)
    task = asyncio.create_task(keep_alive("drafter", tmp_path))
    await asyncio.sleep(0.05)
    assert alive("drafter", tmp_path) and not alive("verifier", tmp_path)
    assert alive("*", tmp_path)  # `health --live` without a service: any
    path = live_file("drafter", os.getpid(), tmp_path)
    stale = time.time() - LIVE_MAX_AGE_S - 1  # a wedged loop stops touching it
    os.utime(path, (stale, stale))
    assert not alive("drafter", tmp_path)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert not path.exists()  # a clean exit leaves nothing that reads alive


def test_the_heartbeat_pattern_matches_the_bus_keys() -> None:
    key = heartbeat_key("7", "drafter", "host-a-1234")
    assert fnmatch.fnmatchcase(key, heartbeat_match("7", "drafter", "host-a"))
    assert not fnmatch.fnmatchcase(key, heartbeat_match("7", "drafter", "host-b"))
    assert not fnmatch.fnmatchcase(key, heartbeat_match("7", "verifier", "host-a"))


async def test_readiness_is_this_hosts_heartbeat(server: EmbeddedRedis) -> None:
    settings = make_settings(server.url, "health")
    assert not await asyncio.to_thread(ready, settings, "drafter", "host-a")
    bus = Bus(server.url, settings.redis, "host-a-42")
    beat = Heartbeater(bus, service="drafter", cell="health", model="d")
    await beat.start()
    try:
        assert await asyncio.to_thread(ready, settings, "drafter", "host-a")
        assert not await asyncio.to_thread(ready, settings, "drafter", "host-b")
        assert not await asyncio.to_thread(ready, settings, "verifier", "host-a")
        other_cell = make_settings(server.url, "other")
        assert not await asyncio.to_thread(ready, other_cell, "drafter", "host-a")
    finally:
        await beat.stop()
        await bus.close()
    assert not await asyncio.to_thread(ready, settings, "drafter", "host-a")


def test_readiness_without_redis_or_gateway_is_false() -> None:
    assert not ready(AugurySettings(), "scheduler")  # embedded Redis: nothing to probe
    unreachable = AugurySettings(gateway={"port": 1, "ready_timeout_s": 0.5})
    assert not ready(unreachable, "gateway")


def test_readiness_on_a_cluster_sees_a_heartbeat_on_any_master(tmp_path: Path) -> None:
    """The cells' heartbeats hash to different masters; the probe must find each one (a plain
    client of the URL's node saw only the cells whose slot it held)."""
    from redis.cluster import RedisCluster

    from tools.redis_cluster import redis_cluster

    cells = [f"cell-{i}" for i in range(8)]
    with redis_cluster(tmp_path) as cluster:
        assert len({cluster.node_of(heartbeat_key(c, "scheduler", "x")) for c in cells}) > 1
        client = RedisCluster.from_url(cluster.url)
        try:
            for cell in cells:
                client.set(heartbeat_key(cell, "scheduler", "host-a-7"), b"1")
        finally:
            client.close()
        for cell in cells:
            settings = AugurySettings(
                redis={"url": cluster.url, "cluster": True}, service={"cell": cell}
            )
            assert ready(settings, "scheduler", "host-a"), cell
            assert not ready(settings, "verifier", "host-a"), cell
