"""Which cell serves a request, when a gateway routes over several (`gateway.cells`).

A cell is live while its scheduler publishes its counts (`shared.bus.cell_stats`: a hash
rewritten every heartbeat interval with a TTL of one heartbeat TTL); one that stops is out of
rotation within that TTL and the next refresh. A new request goes to the live cell with the
least queued work: the published running and waiting counts, plus what this gateway sent it
since it last read them. A prompt of at least `gateway.affinity_prefix_tokens` tokens prefers
the cell its first that-many tokens hash to (rendezvous hashing over the live cells, so a
conversation's turns and requests sharing a long system prompt meet their cached prefix in
the same cell, and a cell leaving moves only its own prefixes), unless that cell has more than
`gateway.affinity_max_extra_load` requests over the least loaded one.

A request stays in the cell it was sent to: if that cell's scheduler dies, its requests wait
for the cell's standby or restarted scheduler, which resumes them (docs/reliability.md); moving
them to another cell would send the client tokens twice or compute them twice. With no live
cell at all, requests go to the configured cells by the same rules and wait in their streams.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass

from shared.bus import Bus
from shared.bus.cell_stats import scheduler_stats_key
from shared.bus.heartbeat import refresh_forever

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RoutingRules:
    cells: tuple[str, ...]
    affinity_prefix_tokens: int = 64  # 0: no prefix affinity
    affinity_max_extra_load: int = 4


def affinity_order(cells: Sequence[str], prefix: Sequence[int]) -> list[str]:
    """`cells` by rendezvous weight for this prefix, highest first."""
    key = ",".join(map(str, prefix)).encode()

    def weight(cell: str) -> bytes:
        return hashlib.blake2b(key, digest_size=8, key=cell.encode()[:64]).digest()

    return sorted(cells, key=weight, reverse=True)


class CellRouter:
    def __init__(self, bus: Bus, rules: RoutingRules) -> None:
        if not rules.cells:
            raise ValueError("a gateway routes over at least one cell")
        self.bus = bus
        self.rules = rules
        self.cells = rules.cells
        self.live: frozenset[str] = frozenset()
        self.published: dict[str, int] = {}  # a live cell's running + waiting, as last read
        self.sent: dict[str, int] = dict.fromkeys(self.cells, 0)  # since that read
        self._cell_of: dict[str, str] = {}  # request id -> its cell, while the request is here
        self._task: asyncio.Task[None] | None = None

    # ---- liveness and load -------------------------------------------------------------------
    async def refresh(self) -> None:
        pipe = self.bus.redis.pipeline(transaction=False)
        for cell in self.cells:
            pipe.hmget(scheduler_stats_key(cell), ["running", "waiting"])
        replies = await pipe.execute()
        published = {}
        for cell, (running, waiting) in zip(self.cells, replies, strict=True):
            if running is not None and waiting is not None:
                published[cell] = int(running) + int(waiting)
        live = frozenset(published)
        if live != self.live:
            log.info(
                "cells in rotation: %s (out: %s)",
                sorted(live) or "none",
                sorted(set(self.cells) - live) or "none",
            )
        self.live, self.published = live, published
        self.sent = dict.fromkeys(self.cells, 0)

    def load(self, cell: str) -> int:
        return self.published.get(cell, 0) + self.sent[cell]

    # ---- choosing ------------------------------------------------------------------------------
    def pick(self, prompt: Sequence[int]) -> str:
        if len(self.cells) == 1:
            return self.cells[0]
        candidates = [cell for cell in self.cells if cell in self.live] or list(self.cells)
        least = min(candidates, key=lambda cell: (self.load(cell), self.cells.index(cell)))
        tokens = self.rules.affinity_prefix_tokens
        if tokens and len(prompt) >= tokens:
            preferred = affinity_order(candidates, prompt[:tokens])[0]
            extra = self.load(preferred) - self.load(least)
            if extra <= self.rules.affinity_max_extra_load:
                return preferred
        return least

    def assign(self, request_ids: Sequence[str], prompt: Sequence[int]) -> str:
        """Route the requests of one prompt (its `n` choices: they share its prefill) to one
        cell; `cell_of` answers for them until `release`."""
        cell = self.pick(prompt)
        for request_id in request_ids:
            self._cell_of[request_id] = cell
        self.sent[cell] += len(request_ids)
        return cell

    def cell_of(self, request_id: str) -> str:
        return self._cell_of.get(request_id, self.cells[0])

    def release(self, request_id: str) -> None:
        self._cell_of.pop(request_id, None)

    # ---- running -------------------------------------------------------------------------------
    async def start(self) -> None:
        if len(self.cells) == 1:
            return  # nothing to choose
        await self.refresh()
        refreshing = refresh_forever(
            self.bus.settings.heartbeat_interval_s, self.refresh, "the cells' load"
        )
        self._task = asyncio.create_task(refreshing, name="gateway-cells")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
