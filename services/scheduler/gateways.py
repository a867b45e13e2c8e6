"""Which gateway replicas are alive (their heartbeat keys), by the output stream each reads.

The scheduler writes a request's Tokens only to a live gateway's stream: a Submit naming any
other stream is dropped (nobody could read its answer, and the scheduler must not write where a
message says at will), and a request whose gateway stopped beating is cancelled, since its
client's connection died with that gateway. "Stopped" means missing for a whole heartbeat TTL
more after its key expired: a gateway whose event loop stalled past one TTL (a loaded machine)
beats again and keeps its requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable

from shared.bus import Bus, live_replicas
from shared.bus.heartbeat import refresh_forever
from shared.wire.streams import GATEWAY, heartbeat_key, output_stream, output_stream_replica

FORGET_MISSING_TTLS = 10  # a stream missing this many heartbeat TTLs is no longer tracked


class GatewayDirectory:
    def __init__(
        self, bus: Bus, cell: str, on_refresh: Callable[[], Awaitable[None]] | None = None
    ) -> None:
        self.bus = bus
        self.cell = cell
        self.live: frozenset[str] = frozenset()  # output streams of live gateway replicas
        self._missing_since: dict[str, float] = {}  # monotonic time each stream was first missed
        self._on_refresh = on_refresh
        self._task: asyncio.Task[None] | None = None

    async def refresh(self) -> None:
        beats = await live_replicas(self.bus, self.cell, GATEWAY)
        self.live = frozenset(output_stream(self.cell, beat.replica) for beat in beats)
        # forget streams back alive, and those missing long past the point of cancelling
        forget_after = FORGET_MISSING_TTLS * self.bus.settings.heartbeat_ttl_ms / 1000
        now = time.monotonic()
        self._missing_since = {
            stream: since
            for stream, since in self._missing_since.items()
            if stream not in self.live and now - since < forget_after
        }
        if self._on_refresh is not None:
            await self._on_refresh()

    async def is_live(self, stream: str) -> bool:
        """Whether `stream` is a live gateway's output stream of this cell. One not known yet is
        looked up by its own heartbeat key, a single EXISTS: a gateway's first request may come
        before this directory's next refresh, and a stream of made-up names must not cost a
        scan of every heartbeat each."""
        if stream in self.live:
            return True
        replica = output_stream_replica(self.cell, stream)
        if replica is None:
            return False
        if not await self.bus.redis.exists(heartbeat_key(self.cell, GATEWAY, replica)):
            return False
        self.live = self.live | {stream}
        self._missing_since.pop(stream, None)
        return True

    def gone(self, stream: str) -> bool:
        """Whether the gateway reading `stream` has been missing for a heartbeat TTL since the
        first refresh that missed it (its key had already outlived one TTL by then)."""
        if stream in self.live:
            return False
        now = time.monotonic()
        missing_since = self._missing_since.setdefault(stream, now)
        return now - missing_since >= self.bus.settings.heartbeat_ttl_ms / 1000

    async def start(self) -> None:
        await self.refresh()
        refreshing = refresh_forever(
            self.bus.settings.heartbeat_interval_s, self.refresh, "gateway heartbeats"
        )
        self._task = asyncio.create_task(refreshing, name="gateway-directory")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
