"""What the gateway's /metrics reads from Redis at scrape time, for every cell it routes to
(`gateway.cells`, else its own cell): the cost profiles and their statuses (which profile is in
force), the preemption totals and the load (`shared.bus.cell_stats`). The cells are read
concurrently (on a Redis Cluster each from its own node); a cell whose read fails keeps what the
last scrape exported for it, and the failure is logged."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

from redis.exceptions import RedisError

from services.gateway.metrics import GatewayMetrics, export_profile_statuses, export_profiles
from shared.bus import Bus
from shared.bus.cell_stats import read_cell_stats
from shared.bus.preemptions import read_preemptions
from shared.bus.profiles import read_profile_statuses, read_profiles

log = logging.getLogger(__name__)
T = TypeVar("T")
READ_ERRORS = (RedisError, OSError, ValueError, KeyError)


async def _read_each(
    cells: Sequence[str], read: Callable[[Bus, str], Awaitable[T]], bus: Bus, what: str
) -> dict[str, T]:
    """`read(bus, cell)` of every cell, concurrently; the cells whose read failed are left out."""
    answers = await asyncio.gather(*(read(bus, cell) for cell in cells), return_exceptions=True)
    out: dict[str, T] = {}
    for cell, answer in zip(cells, answers, strict=True):
        if isinstance(answer, READ_ERRORS):
            log.warning("could not read %s of cell %s: %s", what, cell, answer)
        elif isinstance(answer, BaseException):
            raise answer
        else:
            out[cell] = answer
    return out


async def scrape_cells(bus: Bus, cells: Sequence[str], metrics: GatewayMetrics) -> None:
    profiles, statuses, preemptions, load = await asyncio.gather(
        _read_each(cells, read_profiles, bus, "the cost profiles"),
        _read_each(cells, read_profile_statuses, bus, "the cost profiles' statuses"),
        _read_each(cells, read_preemptions, bus, "the preemption totals"),
        _read_each(cells, read_cell_stats, bus, "the load"),
    )
    export_profiles(metrics, profiles)
    export_profile_statuses(metrics, statuses)
    metrics.preemptions.totals.update(preemptions)
    metrics.cell_load.stats.update(load)
