"""A lease in Redis: at most one holder of a role at a time, taken over when the holder dies.

The holder renews the key every third of its TTL; a process that wants the role (a restarted
scheduler, a standby) polls until the key is free and then takes it with SET NX. A holder whose
key expired without anyone taking it (its event loop stalled past the TTL, Redis restarted)
takes it again at its next renewal. Renewal and
release only touch the key while it still names this holder (one Lua script each), so a holder
that lost its lease can never extend or delete its successor's.

A holder that cannot renew (Redis unreachable, or the key names someone else) for a whole TTL
must assume another process took over; `keep` reports that by returning, and the holder stops
acting on the role. The window in which two holders could both act is therefore bounded by
the clocks' drift over one TTL, not by how long the old holder stays partitioned.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from redis.exceptions import RedisError

from shared.bus.client import Bus, raise_if_cancelled

log = logging.getLogger(__name__)

# KEYS[1] the lease, ARGV[1] the holder, ARGV[2] the TTL in ms. A lease that expired with
# nobody taking it over is taken again: no one else acted meanwhile (a stalled event loop, a
# Redis restart), so the holder may go on.
_RENEW = """
local holder = redis.call('GET', KEYS[1])
if holder == ARGV[1] then
    return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
if not holder then
    redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
    return 1
end
return 0
"""
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
    return redis.call('DEL', KEYS[1])
end
return 0
"""


class Lease:
    def __init__(self, bus: Bus, key: str, holder: str, ttl_ms: int) -> None:
        self.bus = bus
        self.key = key
        self.holder = holder
        self.ttl_ms = ttl_ms
        self._renewed_at = 0.0  # monotonic time of the last successful take or renewal

    @property
    def renew_interval_s(self) -> float:
        return self.ttl_ms / 3000

    async def try_take(self) -> bool:
        taken = await self.bus.redis.set(self.key, self.holder, nx=True, px=self.ttl_ms)
        if taken:
            self._renewed_at = time.monotonic()
        return bool(taken)

    async def holder_now(self) -> str | None:
        value = await self.bus.redis.get(self.key)
        return value.decode() if isinstance(value, bytes) else value

    async def take(self, on_wait: Callable[[str | None], None] | None = None) -> None:
        """Wait until the lease is free and take it; `on_wait(holder)` once before waiting."""
        told = False
        while True:
            try:
                if await self.try_take():
                    return
                if not told and on_wait is not None:
                    told = True
                    on_wait(await self.holder_now())
            except (RedisError, OSError) as error:
                raise_if_cancelled()
                log.warning("taking lease %s failed: %s", self.key, error)
            await asyncio.sleep(self.renew_interval_s)

    async def renew(self) -> bool:
        """Extend the lease if this holder still has it (or take it again if it expired with
        nobody taking it); False once it is someone else's."""
        renewed = bool(await self.bus.redis.eval(_RENEW, 1, self.key, self.holder, self.ttl_ms))
        if renewed:
            self._renewed_at = time.monotonic()
        return renewed

    async def release(self) -> None:
        """Give the lease up now (a clean stop: the successor need not wait for the TTL)."""
        await self.bus.redis.eval(_RELEASE, 1, self.key, self.holder)

    async def keep(self) -> str:
        """Renew until the lease is lost; returns why. Cancel it to stop renewing."""
        while True:
            await asyncio.sleep(self.renew_interval_s)
            try:
                if not await self.renew():
                    return f"lease {self.key} is held by {await self.holder_now()!r}"
            except (RedisError, OSError) as error:
                raise_if_cancelled()
                log.warning("renewing lease %s failed: %s", self.key, error)
            # stop before the key can expire for others: a margin of one renewal interval
            if time.monotonic() - self._renewed_at > self.ttl_ms / 1000 - self.renew_interval_s:
                return f"lease {self.key} not renewed for {self.ttl_ms} ms"
