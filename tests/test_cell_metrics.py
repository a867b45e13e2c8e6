"""vLLM's load gauges and histograms in the gateway's /metrics: requests waiting and running in
the scheduler, KV-cache usage per model service, queue times, aborted requests."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from services.gateway.metrics import CellLoad
from services.runtime import ModelPaths
from shared.bus import Bus, EmbeddedRedis
from shared.bus.cell_stats import (
    QUEUE_TIME_BUCKETS,
    QueueTimes,
    publish_kv_usage,
    publish_scheduler_stats,
    read_cell_stats,
)
from shared.settings import RedisSettings
from tests.test_replay import MODEL, models, serving  # noqa: F401 (a fixture)

pytestmark = pytest.mark.anyio


def test_queue_times_fall_in_their_buckets() -> None:
    times = QueueTimes()
    for seconds in (0.0, 0.01, 0.3, 500.0, -0.2):  # a skewed clock's negative wait counts as 0
        times.observe(seconds)
    assert times.buckets[0] == 3  # 0, 0.01 (le 0.01) and the clamped one
    assert times.buckets[QUEUE_TIME_BUCKETS.index(0.5)] == 1
    assert times.buckets[-1] == 1 and times.count == 5
    taken = times.take()
    assert times.count == 0 and sum(times.buckets) == 0 and taken.count == 5
    times.add(taken)
    assert times.count == 5 and times.total_s == pytest.approx(500.31)


async def test_published_stats_read_back_and_export(server: EmbeddedRedis) -> None:
    bus = Bus(server.url, RedisSettings(url=server.url), "stats")
    try:
        assert (await read_cell_stats(bus, "m")).running is None
        queued = QueueTimes()
        for seconds in (0.02, 0.02, 3.0):
            queued.observe(seconds)
        for _ in range(2):  # totals add up over writes
            await publish_scheduler_stats(
                bus, "m", running=3, waiting=5, queued=queued, ttl_ms=10_000
            )
        await publish_kv_usage(bus, "m", "draft:d", "host-1", used=25, total=100, ttl_ms=10_000)
        stats = await read_cell_stats(bus, "m")
    finally:
        await bus.close()
    assert (stats.running, stats.waiting, stats.queue_count) == (3, 5, 6)
    assert stats.queue_sum_s == pytest.approx(6.08)
    assert stats.kv_usage == {("draft:d", "host-1"): 0.25}
    registry = CollectorRegistry()
    load = CellLoad()
    registry.register(load)
    load.stats = stats
    text = generate_latest(registry).decode()
    assert "augury_num_requests_waiting 5.0" in text
    assert "augury_scheduler_num_requests_running 3.0" in text
    assert 'augury_kv_cache_usage_perc{replica="host-1",role="draft:d"} 0.25' in text
    assert 'augury_request_queue_time_seconds_bucket{le="0.025"} 4.0' in text
    assert 'augury_request_queue_time_seconds_bucket{le="+Inf"} 6.0' in text
    assert "augury_request_queue_time_seconds_count 6.0" in text


async def metrics_text(http: aiohttp.ClientSession, base: str) -> str:
    async with http.get(f"{base}/metrics") as response:
        return await response.text()


async def until_in(http: aiohttp.ClientSession, base: str, *needles: str) -> str:
    deadline = time.monotonic() + 15.0
    while True:
        text = await metrics_text(http, base)
        if all(n in text for n in needles) or time.monotonic() > deadline:
            return text
        await asyncio.sleep(0.2)


async def test_the_services_publish_their_load(
    server: EmbeddedRedis,
    models: ModelPaths,  # noqa: F811
) -> None:
    async with serving(server, models, "load") as (_, base), aiohttp.ClientSession() as http:
        body = {"model": MODEL, "prompt": "Hi", "max_tokens": 3, "ignore_eos": True}
        for _ in range(2):
            async with http.post(f"{base}/v1/completions", json=body) as response:
                assert response.status == 200
        # a client that leaves mid-stream: aborted
        long = {**body, "max_tokens": 1500, "stream": True}
        async with http.post(f"{base}/v1/completions", json=long) as response:
            await response.content.readline()
            response.close()
        needles = (
            "augury_request_queue_time_seconds_count 3.0",  # each request once
            "augury_num_requests_waiting 0.0",
            'role="target"}',
            'role="draft:tiny"}',
            "augury_num_requests_aborted_total 1.0",
        )
        text = await until_in(http, base, *needles)
    for needle in needles:
        assert needle in text, needle
    usage = [
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("augury_kv_cache_usage_perc{")
    ]
    assert len(usage) == 2 and all(0.0 <= u <= 1.0 for u in usage)
