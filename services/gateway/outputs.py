"""This gateway replica's output stream, fanned out to its requests.

Schedulers append `Tokens` and `RequestError` for our requests to `augury:out:{replica}`. One
task reads it with plain XREAD (no group: if this replica dies, its clients' connections die
with it) on its own blocking connection and puts each message on its request's queue. Entries
for requests no longer here (finished, disconnected) are dropped.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from shared.bus import Bus
from shared.wire import ProtocolError, RequestError, Tokens, WireMessage, decode_entry
from shared.wire.streams import output_stream

log = logging.getLogger(__name__)

OUTPUT_STREAM_TTL_S = 3600  # an abandoned replica's stream expires an hour after it last read
READ_COUNT = 256


class OutputRouter:
    def __init__(self, bus: Bus) -> None:
        self.bus = bus
        self.stream = output_stream(bus.consumer_name)
        self._queues: dict[str, asyncio.Queue[Tokens | RequestError]] = {}
        self._client: aioredis.Redis | None = None
        self._task: asyncio.Task[None] | None = None
        self._last_id = "$"
        self._stopping = asyncio.Event()

    def open(self, request_id: str) -> asyncio.Queue[Tokens | RequestError]:
        queue: asyncio.Queue[Tokens | RequestError] = asyncio.Queue()
        self._queues[request_id] = queue
        return queue

    def close(self, request_id: str) -> None:
        self._queues.pop(request_id, None)

    async def start(self) -> None:
        self._client = self.bus.blocking_client()
        # start after the newest entry: nothing before this replica started is ours
        newest = await self.bus.redis.xrevrange(self.stream, count=1)
        self._last_id = newest[0][0].decode() if newest else "0-0"
        self._task = asyncio.create_task(self._read(), name="gateway-outputs")

    async def stop(self) -> None:
        """Ask the reader to stop (it returns within one block time), then close."""
        self._stopping.set()
        if self._task is not None:
            grace = self.bus.settings.socket_timeout_s
            _, stuck = await asyncio.wait({self._task}, timeout=grace)
            for task in stuck:
                task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._client is not None:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(grace):
                    await self._client.aclose()

    async def _read(self) -> None:
        assert self._client is not None
        while not self._stopping.is_set():
            try:
                reply = await self._client.xread(
                    {self.stream: self._last_id},
                    count=READ_COUNT,
                    block=self.bus.settings.block_ms,
                )
                await self.bus.redis.expire(self.stream, OUTPUT_STREAM_TTL_S)
            except (RedisError, OSError) as error:
                log.warning("output stream read failed (%s); retrying", error)
                await asyncio.sleep(0.5)
                continue
            for _, entries in reply or []:
                for entry_id, fields in entries:
                    self._last_id = entry_id.decode()
                    self._route(fields)

    def _route(self, fields: dict[bytes, bytes]) -> None:
        try:
            message: WireMessage = decode_entry(fields)
        except ProtocolError as error:
            log.warning("dropping a malformed output entry: %s", error)
            return
        if not isinstance(message, Tokens | RequestError):
            log.warning("dropping an unexpected %s on the output stream", message.TYPE)
            return
        queue = self._queues.get(message.request_id)
        if queue is not None:
            queue.put_nowait(message)
