"""Measuring a suspect cost profile again in the background.

A model service that starts with a suspect quick profile (measured while something else ran on
the machine), or with none (too little free KV then), measures again once its device is quiet:
no forward has run on it for `idle_s`. The measurement runs on the service's model thread, the
one every forward runs on, so it never overlaps a forward: a job that arrives meanwhile waits
for one quick measurement (a few seconds at most). Each measurement is checked
(`profile_trust`); a trusted one is cached and put in force (published for the scheduler and
/metrics); a suspect one is logged and dropped, and the next try waits `backoff_s`, doubled each
time, up to `tries` tries.

"Device" is per process and device name: the verifier and a drafter of one process on one CPU
wait for each other's forwards, and their measurements never run at the same time.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

from services.runtime import ModelThread
from shared.model.cost_profiles import ProfileChoice
from shared.scheduling.cost_model import ModelProfile

log = logging.getLogger(__name__)
T = TypeVar("T")
POLL_S = 0.05  # the shortest wait between looks at a device that is not quiet yet


class DeviceActivity:
    """When the device last ran forward work, and whether it runs some now. Updated on the
    event loop only (around each model-thread call), so reads need no lock."""

    def __init__(self) -> None:
        self.running = 0
        self.last_end = time.monotonic()

    def begin(self) -> None:
        self.running += 1

    def end(self) -> None:
        self.running -= 1
        self.last_end = time.monotonic()

    def quiet_for(self) -> float:
        """Seconds since the last forward ended (0 while one runs)."""
        return 0.0 if self.running else time.monotonic() - self.last_end

    async def run(self, thread: ModelThread, fn: Callable[..., T], *args: object) -> T:
        """`fn` on `thread`, counted as work on this device."""
        self.begin()
        try:
            return await thread.run(fn, *args)
        finally:
            self.end()

    async def wait_quiet(self, idle_s: float, since: float = 0.0) -> float:
        """Wait until no forward has run for `idle_s`, nor anything since `since` (a
        `time.monotonic()`); how long it has been quiet."""
        while (quiet := min(self.quiet_for(), time.monotonic() - since)) < idle_s:
            await asyncio.sleep(max(idle_s - quiet, POLL_S))
        return quiet


_DEVICES: dict[str, DeviceActivity] = {}


def device_activity(device: str) -> DeviceActivity:
    """The activity of `device` ("cpu", "cuda:0") in this process, shared by its services."""
    return _DEVICES.setdefault(device, DeviceActivity())


@dataclass(frozen=True)
class RefreshPolicy:
    idle_s: float = 5.0
    tries: int = 4
    backoff_s: float = 30.0


@dataclass
class ProfileRefresh:
    """One model's background refresh. `measure` runs on the model thread (given the target's
    profile to check a draft against, from `reference`); `put_in_force` publishes a trusted
    result."""

    name: str
    activity: DeviceActivity
    thread: ModelThread
    measure: Callable[[ModelProfile | None], ProfileChoice]
    reference: Callable[[], Awaitable[ModelProfile | None]]
    put_in_force: Callable[[ProfileChoice], Awaitable[None]]
    policy: RefreshPolicy

    async def run(self) -> ProfileChoice | None:
        """Measure until a trusted profile is in force (returned) or the tries run out (None)."""
        backoff_s = self.policy.backoff_s
        started = time.monotonic()  # the measurement at start ran on the device until now
        for attempt in range(1, self.policy.tries + 1):
            reference = await self.reference()
            quiet_s = await self.activity.wait_quiet(self.policy.idle_s, since=started)
            log.info(
                "cost profile of %s: measuring again in the background (try %d of %d; no "
                "forward for %.1f s)",
                self.name, attempt, self.policy.tries, quiet_s,
            )  # fmt: skip
            choice = await self.activity.run(self.thread, self.measure, reference)
            if choice.trusted and choice.profile is not None:
                await self.put_in_force(choice)
                log.info(
                    "cost profile of %s: the background measurement (%s) is in force and "
                    "published",
                    self.name, choice.source,
                )  # fmt: skip
                return choice
            if attempt < self.policy.tries:
                log.warning(
                    "cost profile of %s: background measurement %d of %d not kept (%s); "
                    "trying again in %.0f s",
                    self.name, attempt, self.policy.tries, choice.detail, backoff_s,
                )  # fmt: skip
                await asyncio.sleep(backoff_s)
                backoff_s *= 2
        log.warning(
            "cost profile of %s: %d background measurement(s), none trusted; the profile at "
            "start stays in force (python -m tools.profile on a quiet machine measures one)",
            self.name, self.policy.tries,
        )  # fmt: skip
        return None
