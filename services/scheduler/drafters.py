"""Which drafter replicas are alive, which draft model a request uses, and on which replica.

Replicas announce themselves with heartbeat keys; the directory re-reads them in the background.
A request stays on its replica while that replica lives (its draft KV stays warm); a new or
orphaned request goes to the live replica of its model with the fewest requests. The model is
the one the request asked for, else the chooser's pick (a fixed model for now; Spin's bandit
implements the same interface).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from typing import Protocol

from redis.exceptions import RedisError

from services.scheduler.request import PoolRequest
from shared.bus import Bus, live_replicas
from shared.wire.streams import DRAFTER

log = logging.getLogger(__name__)


class DraftModelChooser(Protocol):
    name: str

    def choose(self, request: PoolRequest, live_models: Sequence[str]) -> str | None: ...


class FixedDraftModel:
    """The first of the preferred models that is alive (configured order), else any live one."""

    name = "fixed"

    def __init__(self, preferred: Sequence[str] = ()) -> None:
        self.preferred = list(preferred)

    def choose(self, request: PoolRequest, live_models: Sequence[str]) -> str | None:
        for model in self.preferred:
            if model in live_models:
                return model
        return min(live_models) if live_models else None


class DrafterDirectory:
    def __init__(self, bus: Bus, cell: str, chooser: DraftModelChooser) -> None:
        self.bus = bus
        self.cell = cell
        self.chooser = chooser
        self.replicas: dict[str, list[str]] = {}  # model -> live replica names
        self._load: Counter[str] = Counter()  # replica -> requests assigned to it
        self._task: asyncio.Task[None] | None = None
        # (model, replica, request id) of draft state left behind by a move: to be released
        self.left_behind: list[tuple[str, str, str]] = []

    async def refresh(self) -> None:
        beats = await live_replicas(self.bus, self.cell, DRAFTER)
        replicas: dict[str, list[str]] = defaultdict(list)
        for beat in beats:
            if beat.model:
                replicas[beat.model].append(beat.replica)
        self.replicas = dict(replicas)

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.bus.settings.heartbeat_interval_s)
            try:
                await self.refresh()
            except (RedisError, OSError) as error:
                log.warning("could not read drafter heartbeats: %s", error)

    async def start(self) -> None:
        await self.refresh()
        self._task = asyncio.create_task(self._loop(), name="drafter-directory")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def is_live(self, model: str | None, replica: str | None) -> bool:
        return model is not None and replica in self.replicas.get(model, ())

    def assign(self, request: PoolRequest) -> bool:
        """Keep or (re)place the request's drafter; False when no drafter can serve it."""
        live = sorted(self.replicas)
        wanted = request.requested_draft if request.requested_draft in live else None
        model = wanted or (
            request.draft_model
            if request.draft_model in live
            else self.chooser.choose(request, live)
        )
        if model is None:
            return False
        if model == request.draft_model and self.is_live(model, request.drafter):
            return True
        self.release(request)
        if request.draft_model is not None and request.drafter is not None:
            self.left_behind.append((request.draft_model, request.drafter, request.request_id))
        replica = min(self.replicas[model], key=lambda r: (self._load[r], r))
        request.draft_model, request.drafter = model, replica
        request.num_seen_by_drafter = 0  # a new replica starts from the first token
        self._load[replica] += 1
        return True

    def release(self, request: PoolRequest) -> None:
        if request.drafter is not None:
            self._load[request.drafter] -= 1
            if self._load[request.drafter] <= 0:
                del self._load[request.drafter]

    def load(self) -> dict[str, int]:
        return dict(self._load)

    def models(self) -> Iterable[str]:
        return self.replicas.keys()
