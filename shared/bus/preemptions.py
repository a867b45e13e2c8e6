"""Preemption totals through Redis: the scheduler adds what its core counted since it last
wrote (HINCRBY, so totals survive a scheduler restart), and the gateway exports them under
/metrics as `augury_num_preemptions_total{cell,kind}`."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping

from shared.bus.client import Bus
from shared.wire.streams import preemptions_key


async def add_preemptions(bus: Bus, cell: str, counts: Mapping[str, int]) -> None:
    """Add `counts` (preemptions by kind since the last call) to the cell's totals."""
    if not any(counts.values()):
        return
    pipe = bus.redis.pipeline(transaction=False)
    for kind, n in counts.items():
        if n:
            pipe.hincrby(preemptions_key(cell), kind, n)
    await pipe.execute()


async def read_preemptions(bus: Bus, cell: str) -> Counter[str]:
    raw = await bus.redis.hgetall(preemptions_key(cell))
    totals: Counter[str] = Counter()
    for key, value in raw.items():
        kind = key.decode() if isinstance(key, bytes) else key
        totals[kind] = int(value)
    return totals
