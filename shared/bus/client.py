"""The Redis-streams bus: publishing, consumer groups, acknowledgement and dead letters.

One `Bus` per process holds a command connection pool. Blocking reads never share it: each
consumer gets its own single-connection client whose socket timeout exceeds the block time.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping, Sequence

from redis.asyncio.client import Pipeline
from redis.exceptions import ResponseError

from shared.bus.connect import RedisClient, SlotTransactions, connect
from shared.settings import RedisSettings
from shared.wire.base import WireMessage
from shared.wire.streams import dead_letter_stream

log = logging.getLogger(__name__)

COMMAND_TIMEOUT_S = 10.0
MAX_REASON_CHARS = 1000

# Fields the bus adds to a dead letter, beside the original entry's own fields.
DEAD_REASON = "dead_reason"
DEAD_STREAM = "dead_stream"
DEAD_ID = "dead_id"
DEAD_GROUP = "dead_group"
DEAD_CONSUMER = "dead_consumer"
DEAD_DELIVERIES = "dead_deliveries"


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


class Bus:
    """Publishes messages and manages the groups, acks and dead letters of consumers."""

    def __init__(self, url: str, settings: RedisSettings, consumer_name: str) -> None:
        self.url = url
        self.settings = settings
        self.consumer_name = consumer_name
        self.redis: RedisClient = connect(url, settings, socket_timeout=COMMAND_TIMEOUT_S)
        self._transactions = SlotTransactions(self.redis)

    def blocking_client(self) -> RedisClient:
        """A client with its own pool for one reader's blocking reads (timeout > block time)."""
        return connect(
            self.url,
            self.settings,
            socket_timeout=self.settings.socket_timeout_s,
            max_connections=2,
        )

    async def transaction(self, key: str) -> Pipeline:
        """A MULTI/EXEC pipeline for keys in `key`'s hash slot (a cell's keys share one)."""
        return await self._transactions.pipeline(key)

    async def close(self) -> None:
        await self._transactions.aclose()
        await self.redis.aclose()

    # ---- writing -------------------------------------------------------------------------------
    async def publish(self, stream: str, message: WireMessage) -> str:
        """XADD with approximate MAXLEN trimming; returns the entry id."""
        entry_id = await self.redis.xadd(
            stream, message.to_entry(), maxlen=self.settings.stream_maxlen, approximate=True
        )
        return _text(entry_id)

    async def publish_all(
        self,
        messages: Sequence[tuple[str, WireMessage]],
        *,
        also: Callable[[Pipeline], None] | None = None,
        slot_key: str | None = None,
    ) -> list[str]:
        """Several XADDs in one round trip (not atomic: a redelivery re-sends the rest).

        `also` queues more commands on the same pipeline; then all of it is one MULTI/EXEC,
        written entirely or not at all, and every key must be in the hash slot of `slot_key`
        (default: the first message's stream)."""
        if also is None:
            pipe = self.redis.pipeline(transaction=False)
        else:
            pipe = await self.transaction(slot_key or messages[0][0])
        for stream, message in messages:
            pipe.xadd(
                stream, message.to_entry(), maxlen=self.settings.stream_maxlen, approximate=True
            )
        if also is not None:
            also(pipe)
        replies = await pipe.execute()
        return [_text(entry_id) for entry_id in replies[: len(messages)]]

    # ---- groups ----------------------------------------------------------------------------------
    async def ensure_group(self, stream: str, group: str) -> None:
        """Create the group (and stream) reading from the start; an existing group is fine."""
        try:
            await self.redis.xgroup_create(stream, group, id="0", mkstream=True)
        except ResponseError as error:
            if "BUSYGROUP" not in str(error):
                raise

    async def ack(self, stream: str, group: str, *entry_ids: str) -> int:
        return int(await self.redis.xack(stream, group, *entry_ids)) if entry_ids else 0

    async def dead_letter(
        self,
        stream: str,
        group: str,
        entry_id: str,
        fields: Mapping[bytes, bytes],
        reason: str,
        deliveries: int,
    ) -> None:
        """Copy the entry with the reason to `{stream}:dead`, then ack it (one transaction)."""
        letter: dict[bytes | str, bytes | str | int] = dict(fields)
        letter.update(
            {
                DEAD_REASON: reason[:MAX_REASON_CHARS],
                DEAD_STREAM: stream,
                DEAD_ID: entry_id,
                DEAD_GROUP: group,
                DEAD_CONSUMER: self.consumer_name,
                DEAD_DELIVERIES: deliveries,
            }
        )
        pipe = await self.transaction(stream)
        pipe.xadd(
            dead_letter_stream(stream),
            letter,
            maxlen=self.settings.stream_maxlen,
            approximate=True,
        )
        pipe.xack(stream, group, entry_id)
        await pipe.execute()
        log.warning("dead-lettered %s %s (group %s): %s", stream, entry_id, group, reason)

    async def delivery_counts(self, stream: str, group: str, entry_ids: Sequence[str]) -> list[int]:
        """How often each pending entry has been delivered (0 if no longer pending)."""
        pipe = self.redis.pipeline(transaction=False)
        for entry_id in entry_ids:
            pipe.xpending_range(stream, group, entry_id, entry_id, 1)
        counts = []
        for rows in await pipe.execute():
            counts.append(int(rows[0]["times_delivered"]) if rows else 0)
        return counts


def raise_if_cancelled() -> None:
    """End a loop whose task was cancelled while a Redis command ran.

    redis-py can swallow a cancellation that lands mid-command (the command's connection is
    dropped and the call returns or fails with a connection error), so a loop that catches Redis
    errors and is stopped by `Task.cancel` would keep going forever; it calls this after each
    command."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError
