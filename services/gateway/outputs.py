"""This gateway replica's output streams (one per cell), fanned out to its requests.

Each cell's scheduler appends `Tokens` and `RequestError` for our requests to
`augury:{cell}:out:{replica}`. One task per cell reads it with plain XREAD (no group: if this
replica dies, its clients' connections die with it) on its own blocking connection and puts each
message on its request's queue. Entries for requests no longer here (finished, disconnected) are
dropped.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence

from redis.exceptions import RedisError

from shared.bus import Bus
from shared.bus.connect import RedisClient
from shared.wire import ProtocolError, RequestError, Tokens, WireMessage, decode_entry
from shared.wire.streams import output_stream

log = logging.getLogger(__name__)

OUTPUT_STREAM_TTL_S = 3600  # an abandoned replica's stream expires an hour after it last read
READ_COUNT = 256


class OutputRouter:
    """One reader per cell the gateway routes to (a cell's output stream lives in the cell's
    hash slot, beside the scheduler's keys it is written with), into one set of queues."""

    def __init__(self, bus: Bus, cells: Sequence[str]) -> None:
        self.bus = bus
        self.streams = {cell: output_stream(cell, bus.consumer_name) for cell in cells}
        self._queues: dict[str, asyncio.Queue[Tokens | RequestError]] = {}
        self._clients: list[RedisClient] = []
        self._tasks: list[asyncio.Task[None]] = []
        self._stopping = asyncio.Event()

    def stream_of(self, cell: str) -> str:
        return self.streams[cell]

    def open(self, request_id: str) -> asyncio.Queue[Tokens | RequestError]:
        queue: asyncio.Queue[Tokens | RequestError] = asyncio.Queue()
        self._queues[request_id] = queue
        return queue

    def close(self, request_id: str) -> None:
        self._queues.pop(request_id, None)

    async def start(self) -> None:
        for cell, stream in self.streams.items():
            client = self.bus.blocking_client()
            self._clients.append(client)
            # start after the newest entry: nothing before this replica started is ours
            newest = await self.bus.redis.xrevrange(stream, count=1)
            last_id = newest[0][0].decode() if newest else "0-0"
            reading = self._read(client, stream, last_id)
            self._tasks.append(asyncio.create_task(reading, name=f"gateway-outputs-{cell}"))

    async def stop(self) -> None:
        """Ask the readers to stop (they return within one block time), then close."""
        self._stopping.set()
        grace = self.bus.settings.socket_timeout_s
        if self._tasks:
            _, stuck = await asyncio.wait(set(self._tasks), timeout=grace)
            for task in stuck:
                task.cancel()
            for task in self._tasks:
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        for client in self._clients:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(grace):
                    await client.aclose()

    async def _read(self, client: RedisClient, stream: str, last_id: str) -> None:
        while not self._stopping.is_set():
            try:
                reply = await client.xread(
                    {stream: last_id}, count=READ_COUNT, block=self.bus.settings.block_ms
                )
                await self.bus.redis.expire(stream, OUTPUT_STREAM_TTL_S)
            except (RedisError, OSError) as error:
                log.warning("output stream %s read failed (%s); retrying", stream, error)
                await asyncio.sleep(0.5)
                continue
            for _, entries in reply or []:
                for entry_id, fields in entries:
                    last_id = entry_id.decode()
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
