"""Cells on a real three-master Redis Cluster: the bus in cluster mode (a cell's streams read
together, its transactions and its heartbeats), the gateway's cell routing, and two cells served
end to end through one gateway while one cell's scheduler is SIGKILLed."""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from aiohttp.test_utils import TestClient, TestServer

from services.gateway.app import Gateway
from services.gateway.cells import CellRouter, RoutingRules, affinity_order
from shared.bus import Bus, Delivery, Heartbeater, StreamConsumer, live_replicas
from shared.bus.cell_stats import QueueTimes, publish_scheduler_stats
from shared.settings import (
    AugurySettings,
    GatewaySettings,
    RedisSettings,
    SettingsError,
    load_settings,
)
from shared.values.sampling import SamplingParams
from shared.wire import Cancel, Submit, decode_entry
from shared.wire.streams import (
    GATEWAY,
    SCHEDULER,
    candidates_stream,
    output_stream,
    requests_stream,
    results_stream,
    scheduler_progress_key,
)
from tests.conftest import make_tiny_checkpoint
from tests.test_services_processes import launch, log_tail, service_env, stop
from tests.test_services_support import plain_greedy
from tools.redis_cluster import Cluster, redis_cluster

pytestmark = pytest.mark.anyio
TTL_MS = 600


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


# ---- two cells end to end through one gateway ---------------------------------------------------
GATEWAY_REPLICA = "gw"


@pytest.fixture(scope="module")
def tiny_with_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random LLaMA with SmolLM2's vocabulary and tokenizer files (the gateway needs a
    tokenizer; a tiny model keeps the run short on a CPU)."""
    from shared.model.smollm2 import ensure_smollm2

    path = make_tiny_checkpoint(
        tmp_path_factory.mktemp("cells_target"),
        seed=0,
        vocab_size=49152,
        hidden_size=64,
        num_layers=2,
        max_positions=2048,
        tie=True,
    )
    for source in ensure_smollm2().iterdir():
        if source.name.startswith("tokenizer") or source.suffix == ".jinja":
            shutil.copy(source, path / source.name)
    return path


async def complete(client: TestClient, prompt: list[int], max_tokens: int) -> tuple[str, str, int]:
    """A streamed greedy completion of token ids: (request id, text, completion tokens)."""
    body = {
        "model": GatewaySettings().model_name,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    response = await client.post("/v1/completions", json=body)
    assert response.status == 200, await response.text()
    request_id, text, tokens = "", "", 0
    async for raw in response.content:
        line = raw.decode().strip()
        if not line.startswith("data: {"):
            continue
        event = json.loads(line.removeprefix("data: "))
        assert "error" not in event, event
        request_id = event["id"]
        text += "".join(choice["text"] for choice in event["choices"])
        if event.get("usage"):
            tokens = event["usage"]["completion_tokens"]
    return request_id, text, tokens


async def served_by(bus: Bus, cell: str) -> set[str]:
    """Request ids that got output from `cell` (its output stream for our gateway)."""
    entries = await bus.redis.xrange(output_stream(cell, GATEWAY_REPLICA))
    return {decode_entry(fields).request_id for _, fields in entries}  # type: ignore[attr-defined]


@pytest.fixture
def processes() -> Iterator[list[subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []
    yield started
    stop(started)


@pytest.mark.slow
async def test_two_cells_on_a_cluster_serve_through_one_gateway_and_survive_a_scheduler_kill(
    cluster: Cluster, tiny_with_tokenizer: Path, processes: list[subprocess.Popen[bytes]]
) -> None:
    """Cells on two masters; 100 greedy requests through one gateway, equal to plain greedy.
    Cell A's scheduler is SIGKILLed while its requests stream: the gateway takes A out of
    rotation (B serves every new request) and A's requests resume, once A has a scheduler
    again, where their streams stopped."""
    from transformers import AutoTokenizer

    target = tiny_with_tokenizer
    a, b = cells_on_different_nodes(cluster, 2, "cell")
    rng = random.Random(39)
    prompts = [[rng.randrange(100, 49000) for _ in range(rng.randrange(3, 12))] for _ in range(100)]
    lengths = [24 if i < 40 else 8 for i in range(100)]
    expected = plain_greedy(target, prompts, [SamplingParams(max_tokens=n) for n in lengths])
    tokenizer = AutoTokenizer.from_pretrained(target)
    want = [tokenizer.decode(ids, skip_special_tokens=True) for ids in expected]

    def env(cell: str) -> dict[str, str]:
        return service_env(
            target,
            target,  # the target drafts for itself
            cell,
            AUGURY_REDIS__URL=cluster.url,
            AUGURY_REDIS__CLUSTER="true",
            AUGURY_SCHEDULER__LEASE_TTL_MS="2000",
        )

    for args in (("verifier",), ("drafter", "--name", "d"), ("scheduler",)):
        processes.append(launch(*args, env=env(a)))
    scheduler_a = processes[-1]
    processes.append(launch("all", "--no-gateway", env=env(b)))

    settings = AugurySettings(
        redis=RedisSettings(url=cluster.url, cluster=True, block_ms=100, heartbeat_ttl_ms=1500),
        # the dead cell's clients wait for its next scheduler, which starts only after the
        # second batch: on a busy 2-core machine that can pass the default 120 s
        gateway={"cells": [a, b], "affinity_prefix_tokens": 0, "output_idle_timeout_s": 900},
        service={"cell": a, "replica": GATEWAY_REPLICA},
    )
    bus = Bus(cluster.url, settings.redis, GATEWAY_REPLICA)
    gateway = Gateway(settings, bus, tokenizer, vocab_size=len(tokenizer), max_context=2048)
    beats = [Heartbeater(bus, service=GATEWAY, cell=cell) for cell in (a, b)]
    for beat in beats:
        await beat.start()
    client = TestClient(TestServer(gateway.app()))
    await client.start_server()
    try:
        deadline = time.monotonic() + 180
        while gateway.cells.live != {a, b}:  # both schedulers publish once they serve
            for process in processes:
                assert process.poll() is None, log_tail(process)
            assert time.monotonic() < deadline, "the cells never came up"
            await asyncio.sleep(0.2)
        first = [asyncio.create_task(complete(client, prompts[i], lengths[i])) for i in range(40)]
        while not await served_by(bus, a) or not await served_by(bus, b):
            for task in first:
                if task.done():
                    task.result()  # a failed request fails the test here, with its reason
            assert time.monotonic() < deadline, "a cell served nothing"
            await asyncio.sleep(0.05)
        assert not all(task.done() for task in first), "finished before the kill"
        scheduler_a.kill()
        while gateway.cells.live != {b}:
            assert time.monotonic() < deadline, "the dead cell stayed in rotation"
            await asyncio.sleep(0.1)
        on_a_at_kill = await served_by(bus, a)
        second = await asyncio.gather(
            *(complete(client, prompts[i], lengths[i]) for i in range(40, 100))
        )
        assert await served_by(bus, a) == on_a_at_kill  # nothing new went to the dead cell
        assert {rid for rid, _, _ in second} <= await served_by(bus, b)
        processes.append(launch("scheduler", env=env(a)))  # A's requests resume with it
        results = [*await asyncio.gather(*first), *second]
    finally:
        await client.close()
        for beat in beats:
            await beat.stop()
        await bus.close()
    assert scheduler_a.wait() == -signal.SIGKILL
    processes.remove(scheduler_a)
    for i, (_, text, tokens) in enumerate(results):
        assert (text, tokens) == (want[i], lengths[i]), i
    first_ids = {rid for rid, _, _ in results[:40]}
    assert first_ids & on_a_at_kill and first_ids - on_a_at_kill  # both cells served
