"""Answers the scheduler waits for: CandidateTrees and VerifyResults, by micro-batch.

The consumer of the candidates and results streams hands each answer to the micro-batch that
waits for it and then holds the entry until that micro-batch has written its next hop (the
VerifyJob after drafting, the Tokens after verification): so the entry is acknowledged only
after the next write, as the bus contract asks. Answers nobody waits for (a redelivery after
the micro-batch moved on, a late answer after a timeout) are acknowledged and dropped.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

M = TypeVar("M")


@dataclass
class _Slot(Generic[M]):
    answer: asyncio.Future[M]
    settled: asyncio.Event = field(default_factory=asyncio.Event)


class Replies(Generic[M]):
    def __init__(self) -> None:
        self._slots: dict[Hashable, _Slot[M]] = {}
        self.dropped = 0

    def expect(self, key: Hashable) -> asyncio.Future[M]:
        slot = _Slot[M](asyncio.get_running_loop().create_future())
        self._slots[key] = slot
        return slot.answer

    async def deliver(self, key: Hashable, message: M) -> None:
        """Called by the stream handler; returns once the waiter settled (then the entry acks)."""
        slot = self._slots.get(key)
        if slot is None or slot.answer.done():
            self.dropped += 1
            return
        slot.answer.set_result(message)
        await slot.settled.wait()

    def settle(self, *keys: Hashable) -> None:
        """The next hop is written (or the waiter gave up): let the answers' entries be acked."""
        for key in keys:
            slot = self._slots.pop(key, None)
            if slot is not None:
                slot.settled.set()
                if not slot.answer.done():
                    slot.answer.cancel()

    def settle_where(self, keep: Callable[[Hashable], bool]) -> None:
        self.settle(*[key for key in self._slots if keep(key)])

    def settle_all(self) -> None:
        self.settle(*list(self._slots))
