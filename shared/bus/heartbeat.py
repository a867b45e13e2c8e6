"""Heartbeat keys: each replica keeps a hash (the Heartbeat message's entry fields) alive with a
TTL; a replica that stops refreshing it disappears from `live_replicas` within one TTL.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable

from redis.exceptions import RedisError

from shared.bus.client import Bus, raise_if_cancelled
from shared.wire.codec import ProtocolError
from shared.wire.requests import Heartbeat
from shared.wire.streams import heartbeat_key, heartbeat_pattern

log = logging.getLogger(__name__)

SCAN_BATCH = 100


class Heartbeater:
    """Refreshes this replica's heartbeat key every TTL/3 until stopped, then deletes it."""

    def __init__(
        self,
        bus: Bus,
        *,
        service: str,
        cell: str,
        model: str | None = None,
        capacity: int = 0,
        in_flight: Callable[[], int] = lambda: 0,
    ) -> None:
        self.bus = bus
        self.service = service
        self.cell = cell
        self.model = model
        self.capacity = capacity
        self._in_flight = in_flight
        self.replica = bus.consumer_name
        self.key = heartbeat_key(cell, service, self.replica)
        self.started_at = time.time()
        self._task: asyncio.Task[None] | None = None

    def current(self) -> Heartbeat:
        return Heartbeat(
            service=self.service,
            replica=self.replica,
            cell=self.cell,
            started_at=self.started_at,
            sent_at=time.time(),
            model=self.model,
            capacity=self.capacity,
            in_flight=self._in_flight(),
        )

    async def beat(self) -> None:
        pipe = await self.bus.transaction(self.key)
        pipe.delete(self.key)
        pipe.hset(self.key, mapping=self.current().to_entry())
        pipe.pexpire(self.key, self.bus.settings.heartbeat_ttl_ms)
        await pipe.execute()

    async def _loop(self) -> None:
        while True:
            try:
                await self.beat()
            except (RedisError, OSError) as error:
                raise_if_cancelled()
                log.warning("heartbeat %s failed: %s", self.key, error)
            raise_if_cancelled()
            await asyncio.sleep(self.bus.settings.heartbeat_interval_s)

    @property
    def is_beating(self) -> bool:
        return self._task is not None

    async def start(self) -> None:
        await self.beat()  # announce before serving
        self._task = asyncio.create_task(self._loop(), name=f"heartbeat-{self.service}")

    async def stop(self) -> None:
        """Stop beating and withdraw at once (no waiting for the TTL)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        with contextlib.suppress(RedisError, OSError):
            await self.bus.redis.delete(self.key)

    async def __aenter__(self) -> Heartbeater:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()


async def live_replicas(bus: Bus, cell: str, service: str) -> list[Heartbeat]:
    """Replicas of `service` in `cell` whose heartbeat key has not expired, by replica name."""
    keys = [key async for key in bus.redis.scan_iter(heartbeat_pattern(cell, service), SCAN_BATCH)]
    if not keys:
        return []
    pipe = bus.redis.pipeline(transaction=False)
    for key in keys:
        pipe.hgetall(key)
    beats = []
    for key, fields in zip(keys, await pipe.execute(), strict=True):
        if not fields:
            continue  # expired between SCAN and HGETALL
        try:
            beats.append(Heartbeat.from_entry(fields))
        except ProtocolError as error:
            log.warning("ignoring bad heartbeat %r: %s", key, error)
    return sorted(beats, key=lambda beat: beat.replica)


async def refresh_forever(
    interval_s: float, refresh: Callable[[], Awaitable[None]], what: str
) -> None:
    """Call `refresh` every `interval_s` until cancelled; a Redis error is logged and retried
    at the next interval."""
    while True:
        await asyncio.sleep(interval_s)
        try:
            await refresh()
        except (RedisError, OSError) as error:
            raise_if_cancelled()
            log.warning("could not read %s: %s", what, error)
        raise_if_cancelled()
