"""Which drafter replicas are alive, and what the models cost: read in the background from the
replicas' heartbeat keys and the model services' published cost profiles, and handed to the
scheduler core (`SchedulerCore.set_drafters`, `SchedulerCore.cost`)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import defaultdict

from shared.bus import Bus, live_replicas
from shared.bus.heartbeat import refresh_forever
from shared.bus.profiles import assemble, read_profiles, role_name
from shared.scheduling.core import SchedulerCore
from shared.scheduling.cost_model import CostModel
from shared.wire.streams import DRAFTER

log = logging.getLogger(__name__)


def kept_scales(
    scales: dict[str, float], was: dict[str, str], now: dict[str, str]
) -> dict[str, float]:
    """The calibration (`CostModel.scales`) of each role whose published profile is unchanged:
    a new draft's profile rebuilds the cost model, and the others' measured steps still hold.
    Profiles are keyed `target` and `draft:<model>`, scales `target` and `<model>`."""
    same = {role_name(role) for role, text in now.items() if was.get(role) == text}
    return {role: scale for role, scale in scales.items() if role in same}


class DrafterDirectory:
    def __init__(self, bus: Bus, cell: str, core: SchedulerCore) -> None:
        self.bus = bus
        self.cell = cell
        self.core = core
        self._task: asyncio.Task[None] | None = None
        self._profiles: dict[str, str] = {}  # role -> the JSON the cost model was built from

    @property
    def replicas(self) -> dict[str, list[str]]:
        """Live draft model -> its replicas."""
        return self.core.drafters

    def load(self) -> dict[str, int]:
        """Requests placed on each replica."""
        return dict(self.core.matcher.load())

    async def refresh(self) -> None:
        beats = await live_replicas(self.bus, self.cell, DRAFTER)
        replicas: dict[str, list[str]] = defaultdict(list)
        for beat in beats:
            if beat.model:
                replicas[beat.model].append(beat.replica)
        live = {model: sorted(names) for model, names in replicas.items()}
        was = {model: sorted(names) for model, names in self.core.drafters.items()}
        if live != was:
            # requests on a replica that left move to a live one of the same model when they
            # next draft; the draft choice's statistics are per model and stay
            log.info("drafter replicas now %s (were %s); requests per replica %s",
                     live, was, self.load())  # fmt: skip
        self.core.set_drafters(replicas)
        await self.refresh_cost()

    async def refresh_cost(self) -> None:
        """Rebuild the core's cost model when the published profiles changed."""
        profiles = await read_profiles(self.bus, self.cell)
        raw = {role: p.model_dump_json() for role, p in profiles.items()}
        if raw == self._profiles:
            return
        was, self._profiles = self._profiles, raw
        assembled = assemble(profiles)
        if assembled is not None:
            cost = CostModel(assembled)
            if self.core.cost is not None:
                cost.scales = kept_scales(self.core.cost.scales, was, raw)
            self.core.cost = cost
            log.info("cost model: target and drafts %s", sorted(assembled.drafts))

    async def start(self) -> None:
        await self.refresh()
        refreshing = refresh_forever(
            self.bus.settings.heartbeat_interval_s, self.refresh, "drafter heartbeats"
        )
        self._task = asyncio.create_task(refreshing, name="drafter-directory")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
