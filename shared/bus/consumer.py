"""A consumer-group reader that hands each message to an async handler and acks on success.

Life of an entry:
- read with XREADGROUP: first this consumer's own pending entries (`0`, a restart picks up what
  it held), then new ones (`>`), never more than the free handler slots (backpressure);
- decoded; a malformed entry is dead-lettered at once;
- handled: `await handler(delivery)`. Returning means the next hop's write succeeded and the
  entry is acked. Raising leaves it pending; raising `DeadLetterError` dead-letters it now;
- a sweeper XAUTOCLAIMs entries idle past `claim_idle_ms` (a handler failed, or a consumer died)
  and hands them over again. An entry delivered more than `max_deliveries` times, or failing on
  its last allowed delivery, goes to the dead-letter stream instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from shared.bus.client import Bus
from shared.bus.connect import RedisClient
from shared.wire.base import WireMessage, decode_entry
from shared.wire.codec import ProtocolError

log = logging.getLogger(__name__)

RETRY_MIN_S = 0.05
RETRY_MAX_S = 2.0
STOP_GRACE_S = 5.0
GHOST_SCAN = 100

RawEntry = tuple[bytes | None, dict[bytes, bytes] | None]


@dataclass(frozen=True)
class Delivery:
    stream: str
    entry_id: str
    message: WireMessage
    deliveries: int  # 1 on the first delivery; more means a retry or a takeover


Handler = Callable[[Delivery], Awaitable[None]]


class DeadLetterError(Exception):
    """Raised by a handler for a message that can never succeed: dead-letter it now."""


@dataclass(frozen=True)
class _Pending:
    stream: str
    entry_id: str
    fields: dict[bytes, bytes]
    deliveries: int


@dataclass
class ConsumerStats:
    handled: int = 0
    failed: int = 0
    dead_lettered: int = 0
    claimed: int = 0


def _text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


class StreamConsumer:
    """Reads `streams` as `consumer` in `group`; runs `handler` on up to `concurrency` at once."""

    def __init__(
        self,
        bus: Bus,
        *,
        group: str,
        streams: Sequence[str],
        handler: Handler,
        concurrency: int = 1,
        consumer: str | None = None,
    ) -> None:
        if concurrency < 1:
            raise ValueError("concurrency must be >= 1")
        if not streams:
            raise ValueError("a consumer reads at least one stream")
        self.bus = bus
        self.group = group
        self.streams = tuple(streams)
        self.handler = handler
        self.concurrency = concurrency
        self.consumer = consumer or bus.consumer_name
        self.stats = ConsumerStats()
        settings = bus.settings
        self._block_ms = settings.block_ms
        self._claim_idle_ms = settings.claim_idle_ms
        self._max_deliveries = settings.max_deliveries
        self._sweep_every_s = max(settings.claim_idle_ms / 2000, 0.05)
        self._queue: asyncio.Queue[_Pending] = asyncio.Queue()
        self._busy = 0
        self._local: set[tuple[str, str]] = set()  # queued or being handled here
        self._slot_freed = asyncio.Event()
        self._claim_cursor = dict.fromkeys(self.streams, "0-0")
        self._ghosts_seen = False
        self._reader_client: RedisClient | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._workers: list[asyncio.Task[None]] = []
        self._stopping = asyncio.Event()
        self.crashed: BaseException | None = None  # set if the reader or sweeper died

    # ---- lifecycle -----------------------------------------------------------------------------
    async def start(self) -> None:
        for stream in self.streams:
            await self.bus.ensure_group(stream, self.group)
        self._reader_client = self.bus.blocking_client()
        self._workers = [
            asyncio.create_task(self._work(), name=f"{self.group}-worker-{i}")
            for i in range(self.concurrency)
        ]
        self._tasks = [
            asyncio.create_task(self._read(), name=f"{self.group}-reader"),
            asyncio.create_task(self._sweep(), name=f"{self.group}-sweeper"),
        ]
        for task in self._tasks:
            task.add_done_callback(self._report_crash)

    def _report_crash(self, task: asyncio.Task[None]) -> None:
        if not task.cancelled() and task.exception() is not None:
            self.crashed = task.exception()
            log.error("%s: %s stopped", self.group, task.get_name(), exc_info=task.exception())

    async def stop(self) -> None:
        """Stop reading, let handlers in progress finish (within a grace), then close.

        The reader and sweeper are asked to stop rather than cancelled: a command cancelled
        half-way (e.g. while connecting) can leave its connection pool unable to close.
        """
        self._stopping.set()
        self._slot_freed.set()
        loop_wait = self._block_ms / 1000 + STOP_GRACE_S
        _, stuck = await asyncio.wait(self._tasks, timeout=loop_wait) if self._tasks else ((), ())
        for task in stuck:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        deadline = asyncio.get_running_loop().time() + STOP_GRACE_S
        while self._busy and asyncio.get_running_loop().time() < deadline:
            self._slot_freed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._slot_freed.wait(), 0.1)
        for task in self._workers:
            task.cancel()
        await asyncio.gather(*self._workers, return_exceptions=True)
        self._tasks, self._workers = [], []
        if self._reader_client is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._reader_client.aclose(), STOP_GRACE_S)
            self._reader_client = None

    async def __aenter__(self) -> StreamConsumer:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()

    # ---- slots ---------------------------------------------------------------------------------
    @property
    def free_slots(self) -> int:
        return max(0, self.concurrency - self._busy - self._queue.qsize())

    async def _wait_for_slot(self) -> int:
        """Free slots, waiting for one; 0 only when stopping."""
        while self.free_slots == 0 and not self._stopping.is_set():
            self._slot_freed.clear()
            await self._slot_freed.wait()
        return self.free_slots

    def _enqueue(self, item: _Pending) -> None:
        self._local.add((item.stream, item.entry_id))
        self._queue.put_nowait(item)

    # ---- reading -------------------------------------------------------------------------------
    async def _read(self) -> None:
        await self._with_retries(self._read_own_pending)
        while not self._stopping.is_set():
            await self._with_retries(self._read_new)

    async def _with_retries(self, step: Callable[[], Awaitable[None]]) -> None:
        delay = RETRY_MIN_S
        while not self._stopping.is_set():
            try:
                await step()
                return
            except (RedisConnectionError, RedisTimeoutError, OSError) as error:
                log.warning(
                    "%s: redis unavailable (%s), retrying in %.2fs", self.group, error, delay
                )
            except ResponseError as error:
                if "NOGROUP" not in str(error):
                    raise
                log.warning("%s: group vanished, recreating", self.group)
                for stream in self.streams:
                    await self.bus.ensure_group(stream, self.group)
            await asyncio.sleep(delay)
            delay = min(delay * 2, RETRY_MAX_S)

    async def _read_own_pending(self) -> None:
        """Entries delivered to this consumer name before (a restart) come first."""
        assert self._reader_client is not None
        cursors = dict.fromkeys(self.streams, "0")
        while cursors and not self._stopping.is_set():
            count = await self._wait_for_slot()
            if not count:
                return
            reply = await self._reader_client.xreadgroup(
                self.group, self.consumer, cursors, count=count
            )
            answered = {_text(raw_stream): entries for raw_stream, entries in reply or []}
            for stream in list(cursors):
                entries = answered.get(stream)
                if not entries:
                    del cursors[stream]  # nothing (more) pending on this stream
                    continue
                cursors[stream] = _text(entries[-1][0])
                await self._accept(stream, entries, deliveries=None)

    async def _read_new(self) -> None:
        assert self._reader_client is not None
        count = await self._wait_for_slot()
        if not count:
            return
        reply = await self._reader_client.xreadgroup(
            self.group,
            self.consumer,
            dict.fromkeys(self.streams, ">"),
            count=count,
            block=self._block_ms,
        )
        for raw_stream, entries in reply or []:
            await self._accept(_text(raw_stream), entries, deliveries=1)

    async def _accept(
        self, stream: str, entries: Sequence[RawEntry], deliveries: int | None
    ) -> None:
        """Queue delivered entries; entries trimmed away since (no fields) are acked."""
        live = [(_text(i), f) for i, f in entries if i is not None and f]
        gone = [_text(i) for i, f in entries if i is not None and not f]
        self._ghosts_seen |= any(i is None for i, _ in entries)
        if gone:
            await self.bus.ack(stream, self.group, *gone)
        if deliveries is None:
            counts = await self.bus.delivery_counts(stream, self.group, [i for i, _ in live])
        else:
            counts = [deliveries] * len(live)
        for (entry_id, fields), count in zip(live, counts, strict=True):
            if (stream, entry_id) not in self._local:
                self._enqueue(_Pending(stream, entry_id, fields, max(count, 1)))

    # ---- sweeping ------------------------------------------------------------------------------
    async def _sweep(self) -> None:
        while not self._stopping.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), self._sweep_every_s)
                return
            for stream in self.streams:
                if self.free_slots:
                    await self._with_retries(lambda s=stream: self._claim_idle(s))
            if self._ghosts_seen:
                self._ghosts_seen = False
                for stream in self.streams:
                    await self._with_retries(lambda s=stream: self._ack_ghosts(s))

    async def _claim_idle(self, stream: str) -> None:
        reply = await self.bus.redis.xautoclaim(
            stream,
            self.group,
            self.consumer,
            self._claim_idle_ms,
            start_id=self._claim_cursor[stream],
            count=self.free_slots,
        )
        self._claim_cursor[stream] = _text(reply[0])
        # Redis >= 7 drops entries trimmed away from the pending list itself (reply[2]);
        # Redis 6.2 answers (None, None) for them, which _ack_ghosts cleans up.
        claimed = [
            (i, f) for i, f in reply[1] if i is None or (stream, _text(i)) not in self._local
        ]
        if claimed:
            self.stats.claimed += sum(1 for i, _ in claimed if i is not None)
            await self._accept(stream, claimed, deliveries=None)

    async def _ack_ghosts(self, stream: str) -> None:
        """Ack pending entries of this consumer whose stream entry no longer exists."""
        rows = await self.bus.redis.xpending_range(
            stream, self.group, "-", "+", GHOST_SCAN, consumername=self.consumer
        )
        ids = [_text(r["message_id"]) for r in rows]
        ids = [i for i in ids if (stream, i) not in self._local]
        pipe = self.bus.redis.pipeline(transaction=False)
        for entry_id in ids:
            pipe.xrange(stream, entry_id, entry_id)
        found = await pipe.execute() if ids else []
        ghosts = [i for i, hit in zip(ids, found, strict=True) if not hit]
        await self.bus.ack(stream, self.group, *ghosts)

    # ---- handling ------------------------------------------------------------------------------
    async def _work(self) -> None:
        while True:
            item = await self._queue.get()
            self._busy += 1
            try:
                await self._handle(item)
            except asyncio.CancelledError:
                raise
            except Exception:  # a Redis failure while acking: the entry stays pending
                log.exception("%s: could not settle %s %s", self.group, item.stream, item.entry_id)
            finally:
                self._busy -= 1
                self._local.discard((item.stream, item.entry_id))
                self._slot_freed.set()

    async def _handle(self, item: _Pending) -> None:
        try:
            message = decode_entry(item.fields)
        except ProtocolError as error:
            await self._dead_letter(item, f"malformed: {error}")
            return
        if item.deliveries > self._max_deliveries:
            await self._dead_letter(
                item, f"delivered {item.deliveries} times (max {self._max_deliveries})"
            )
            return
        delivery = Delivery(item.stream, item.entry_id, message, item.deliveries)
        try:
            await self.handler(delivery)
        except DeadLetterError as error:
            await self._dead_letter(item, f"rejected by handler: {error}")
            return
        except asyncio.CancelledError:
            raise
        except Exception as error:
            self.stats.failed += 1
            if item.deliveries >= self._max_deliveries:
                await self._dead_letter(
                    item, f"handler failed on delivery {item.deliveries}: {error!r}"
                )
            else:
                log.warning(
                    "%s: handler failed on %s %s (delivery %d), left pending: %r",
                    self.group,
                    item.stream,
                    item.entry_id,
                    item.deliveries,
                    error,
                )
            return
        await self.bus.ack(item.stream, self.group, item.entry_id)
        self.stats.handled += 1

    async def _dead_letter(self, item: _Pending, reason: str) -> None:
        await self.bus.dead_letter(
            item.stream, self.group, item.entry_id, item.fields, reason, item.deliveries
        )
        self.stats.dead_lettered += 1
