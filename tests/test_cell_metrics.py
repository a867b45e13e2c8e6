"""vLLM's load gauges and histograms in the gateway's /metrics: requests waiting and running in
the scheduler, KV-cache usage per model service, queue times, aborted requests."""

from __future__ import annotations

import asyncio
import time

import aiohttp
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from services.gateway.app import Gateway
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
from shared.bus.preemptions import add_preemptions
from shared.bus.profiles import TARGET, draft_role, publish_profile, publish_profile_status
from shared.scheduling.cost_model import ForwardCurve, ModelProfile, ProfileKey
from shared.settings import AugurySettings, RedisSettings
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
    load.stats = {"m": stats}
    text = generate_latest(registry).decode()
    assert 'augury_num_requests_waiting{cell="m"} 5.0' in text
    assert 'augury_scheduler_num_requests_running{cell="m"} 3.0' in text
    assert 'augury_kv_cache_usage_perc{cell="m",replica="host-1",role="draft:d"} 0.25' in text
    assert 'augury_request_queue_time_seconds_bucket{cell="m",le="0.025"} 4.0' in text
    assert 'augury_request_queue_time_seconds_bucket{cell="m",le="+Inf"} 6.0' in text
    assert 'augury_request_queue_time_seconds_count{cell="m"} 6.0' in text


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
            'augury_request_queue_time_seconds_count{cell="load"} 3.0',  # each request once
            'augury_num_requests_waiting{cell="load"} 0.0',
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


def flat_profile(model: str, ms: float) -> ModelProfile:
    curve = ForwardCurve(
        tokens=[1, 4], contexts=[0], ms_grid=[[ms], [ms]], rel_spread=[[0.1], [0.1]], repeats=3
    )
    key = ProfileKey(model=model, fingerprint="f", device="cpu: x", dtype="float32", threads=1)
    return ModelProfile(key=key, curve=curve, single=curve)


async def test_one_gateways_metrics_cover_every_cell_it_routes_to(server: EmbeddedRedis) -> None:
    """A gateway over cells x and y (not its own cell, z): each cell's scheduler gauges, queue
    times, KV usage, preemptions, profiles in force and profile numbers, labelled by cell; a
    cell that published nothing shows only its zero totals."""
    from aiohttp.test_utils import TestClient, TestServer
    from transformers import AutoTokenizer

    from shared.model.smollm2 import ensure_smollm2

    settings = AugurySettings(
        redis=RedisSettings(url=server.url),
        gateway={"cells": ["x", "y", "quiet"]},
        service={"cell": "z", "replica": "gw"},
    )
    bus = Bus(server.url, settings.redis, "gw")
    tokenizer = AutoTokenizer.from_pretrained(ensure_smollm2())
    gateway = Gateway(settings, bus, tokenizer, vocab_size=len(tokenizer), max_context=2048)
    client = TestClient(TestServer(gateway.app()))
    await client.start_server()
    try:
        for cell, (running, waiting) in {"x": (2, 1), "y": (7, 4)}.items():
            queued = QueueTimes()
            queued.observe(0.02 if cell == "x" else 3.0)
            await publish_scheduler_stats(
                bus, cell, running=running, waiting=waiting, queued=queued, ttl_ms=10_000
            )
            used = 10 if cell == "x" else 30
            await publish_kv_usage(
                bus, cell, TARGET, f"v-{cell}", used=used, total=100, ttl_ms=10_000
            )
            await publish_profile(
                bus, cell, TARGET, flat_profile("t", 40.0 if cell == "x" else 9.0)
            )
            source = "stored" if cell == "x" else "measured"
            await publish_profile_status(
                bus, cell, TARGET, source=source, detail="", published=True
            )
        await publish_profile_status(
            bus, "y", draft_role("d"), source="suspect", detail="1.97x", published=False
        )
        await add_preemptions(bus, "y", {"swapped": 2})
        text = await (await client.get("/metrics")).text()
    finally:
        await client.close()
        await bus.close()
    for needle in (
        'augury_num_requests_waiting{cell="x"} 1.0',
        'augury_num_requests_waiting{cell="y"} 4.0',
        'augury_scheduler_num_requests_running{cell="x"} 2.0',
        'augury_scheduler_num_requests_running{cell="y"} 7.0',
        'augury_request_queue_time_seconds_bucket{cell="x",le="0.025"} 1.0',
        'augury_request_queue_time_seconds_bucket{cell="y",le="0.025"} 0.0',
        'augury_request_queue_time_seconds_count{cell="y"} 1.0',
        'augury_request_queue_time_seconds_count{cell="quiet"} 0.0',
        'augury_kv_cache_usage_perc{cell="x",replica="v-x",role="target"} 0.1',
        'augury_kv_cache_usage_perc{cell="y",replica="v-y",role="target"} 0.3',
        'augury_cost_profile_info{cell="x",published="1",role="target",source="stored"} 1.0',
        'augury_cost_profile_info{cell="y",published="1",role="target",source="measured"} 1.0',
        'augury_cost_profile_info{cell="y",published="0",role="draft:d",source="suspect"} 1.0',
        'augury_cost_forward_ms{cell="x",context="0",role="target",tokens="4"} 40.0',
        'augury_cost_forward_ms{cell="y",context="0",role="target",tokens="4"} 9.0',
        'augury_num_preemptions_total{cell="y",kind="swapped"} 2.0',
        'augury_num_preemptions_total{cell="x",kind="swapped"} 0.0',
    ):
        assert needle in text, needle
    assert 'cell="z"' not in text  # its own cell is not one it routes to
    assert 'augury_num_requests_waiting{cell="quiet"}' not in text  # no live scheduler


def test_a_cells_profile_series_are_replaced_and_the_others_kept() -> None:
    from services.gateway.metrics import GatewayMetrics, export_profile_statuses, export_profiles

    metrics = GatewayMetrics()
    stored = {"source": "stored", "published": "1"}
    export_profile_statuses(metrics, {"x": {TARGET: stored}, "y": {TARGET: stored}})
    export_profiles(metrics, {"x": {TARGET: flat_profile("t", 5.0)}})
    # y's model service measured a new one; x's read failed this scrape (left out)
    export_profile_statuses(metrics, {"y": {TARGET: {"source": "measured", "published": "1"}}})
    export_profiles(metrics, {"y": {}})

    def info(cell: str, source: str) -> float | None:
        labels = {"cell": cell, "role": TARGET, "source": source, "published": "1"}
        return metrics.registry.get_sample_value("augury_cost_profile_info", labels)

    assert (info("x", "stored"), info("y", "stored"), info("y", "measured")) == (1.0, None, 1.0)
    forward = {"cell": "x", "role": TARGET, "tokens": "1", "context": "0"}
    assert metrics.registry.get_sample_value("augury_cost_forward_ms", forward) == 5.0
