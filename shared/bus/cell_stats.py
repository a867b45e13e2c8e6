"""A cell's load as its services see it, through Redis, for the gateway's /metrics (vLLM's
gauges and histograms under our prefix).

- The scheduler writes its running and waiting request counts (one hash, rewritten every
  heartbeat interval, with a TTL so a dead scheduler's numbers vanish) and adds the queue times
  it observed since the last write to a histogram (HINCRBY per bucket: the totals survive a
  scheduler restart). One pipeline per interval, nothing per step.
- Each model service writes its KV-cache usage (one hash per replica, with a TTL).
- The gateway reads them at scrape time (`read_cell_stats`).
"""

from __future__ import annotations

import asyncio
import bisect
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from redis.exceptions import RedisError

from shared.bus.client import Bus, raise_if_cancelled
from shared.wire.streams import cell_prefix

log = logging.getLogger(__name__)

# seconds from the gateway's submit to the request's first micro-batch
QUEUE_TIME_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
SUM = "sum"
COUNT = "count"


def scheduler_stats_key(cell: str) -> str:
    return f"{cell_prefix(cell)}:stats:scheduler"


def queue_time_key(cell: str) -> str:
    return f"{cell_prefix(cell)}:stats:queue_time"


def kv_usage_key(cell: str, role: str, replica: str) -> str:
    return f"{cell_prefix(cell)}:stats:kv:{role}:{replica}"


def kv_usage_pattern(cell: str) -> str:
    return f"{cell_prefix(cell)}:stats:kv:*"


@dataclass
class QueueTimes:
    """Queue times observed since the last `take`: a count per bucket (upper bounds
    `QUEUE_TIME_BUCKETS`, then +Inf), their sum and count."""

    buckets: list[int] = field(default_factory=lambda: [0] * (len(QUEUE_TIME_BUCKETS) + 1))
    total_s: float = 0.0
    count: int = 0

    def observe(self, seconds: float) -> None:
        seconds = max(0.0, seconds)  # gateway and scheduler clocks may differ a little
        self.buckets[bisect.bisect_left(QUEUE_TIME_BUCKETS, seconds)] += 1
        self.total_s += seconds
        self.count += 1

    def take(self) -> QueueTimes:
        taken = QueueTimes(self.buckets, self.total_s, self.count)
        self.buckets, self.total_s, self.count = [0] * len(self.buckets), 0.0, 0
        return taken

    def add(self, other: QueueTimes) -> None:
        """Put back what a failed write took."""
        self.buckets = [a + b for a, b in zip(self.buckets, other.buckets, strict=True)]
        self.total_s += other.total_s
        self.count += other.count


@dataclass
class CellStats:
    running: int | None = None  # None: no live scheduler wrote its counts
    waiting: int | None = None
    queue_buckets: list[int] = field(default_factory=lambda: [0] * (len(QUEUE_TIME_BUCKETS) + 1))
    queue_sum_s: float = 0.0
    queue_count: int = 0
    kv_usage: dict[tuple[str, str], float] = field(default_factory=dict)  # (role, replica)


async def publish_scheduler_stats(
    bus: Bus, cell: str, *, running: int, waiting: int, queued: QueueTimes, ttl_ms: int
) -> None:
    pipe = bus.redis.pipeline(transaction=False)
    key = scheduler_stats_key(cell)
    pipe.hset(key, mapping={"running": running, "waiting": waiting})
    pipe.pexpire(key, ttl_ms)
    if queued.count:
        histogram = queue_time_key(cell)
        for i, n in enumerate(queued.buckets):
            if n:
                pipe.hincrby(histogram, str(i), n)
        pipe.hincrbyfloat(histogram, SUM, queued.total_s)
        pipe.hincrby(histogram, COUNT, queued.count)
    await pipe.execute()


async def publish_kv_usage(
    bus: Bus, cell: str, role: str, replica: str, *, used: int, total: int, ttl_ms: int
) -> None:
    key = kv_usage_key(cell, role, replica)
    pipe = bus.redis.pipeline(transaction=False)
    pipe.hset(key, mapping={"used": used, "total": total})
    pipe.pexpire(key, ttl_ms)
    await pipe.execute()


async def read_cell_stats(bus: Bus, cell: str) -> CellStats:
    stats = CellStats()
    counts = _text_map(await bus.redis.hgetall(scheduler_stats_key(cell)))
    if counts:
        stats.running, stats.waiting = int(counts["running"]), int(counts["waiting"])
    histogram = _text_map(await bus.redis.hgetall(queue_time_key(cell)))
    for i in range(len(stats.queue_buckets)):
        stats.queue_buckets[i] = int(histogram.get(str(i), 0))
    stats.queue_sum_s = float(histogram.get(SUM, 0.0))
    stats.queue_count = int(histogram.get(COUNT, 0))
    prefix = kv_usage_pattern(cell).removesuffix("*")
    keys = [key async for key in bus.redis.scan_iter(kv_usage_pattern(cell), 100)]
    for key in keys:
        name = key.decode() if isinstance(key, bytes) else key
        usage = _text_map(await bus.redis.hgetall(key))
        if not usage or int(usage["total"]) <= 0:
            continue
        role, _, replica = name.removeprefix(prefix).rpartition(":")
        stats.kv_usage[(role, replica)] = int(usage["used"]) / int(usage["total"])
    return stats


def _text_map(raw: dict[bytes | str, bytes | str]) -> dict[str, str]:
    return {
        (k.decode() if isinstance(k, bytes) else k): (v.decode() if isinstance(v, bytes) else v)
        for k, v in raw.items()
    }


async def publish_forever(
    interval_s: float, publish: Callable[[], Awaitable[None]], what: str
) -> None:
    """Call the coroutine function `publish` every `interval_s` until cancelled; a Redis
    failure is logged and retried at the next interval."""
    while True:
        try:
            await publish()
        except (RedisError, OSError) as error:
            raise_if_cancelled()
            log.warning("could not publish %s: %s", what, error)
        await asyncio.sleep(interval_s)
