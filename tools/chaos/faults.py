"""The faults: each listed service SIGKILLed in turn while the replay runs, and started again.
A kill target is a service or one draft model's drafter (`drafter:<model>`, its first replica;
`tools/chaos/cluster.py`); the killed instance is started again as a new replica.

The first kill comes `first_kill_s` after the start, each next one `spacing_s` after the
previous service is back (its new replica's heartbeat is in Redis); when it is due, a kill
waits (up to `busy_wait_s`) until some request is streaming output, so that it hits requests
mid-generation rather than an idle system. A kill's window, from the SIGKILL until the new replica
is back, is what the report attributes requests to.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from tools.chaos.cluster import Cluster, wait_alive


@dataclass
class Kill:
    """One fault; times in seconds after the replay's start."""

    service: str  # the kill target: a service, or drafter:<model>
    killed_replica: str
    killed_at_s: float
    restarted_replica: str | None = None
    restarted_at_s: float | None = None
    back_at_s: float | None = None  # the new replica's first heartbeat

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Kill:
        return cls(**data)

    def overlaps(self, start_s: float, end_s: float) -> bool:
        """Whether [start_s, end_s] meets the window from the kill until the service is back."""
        back = self.back_at_s if self.back_at_s is not None else float("inf")
        return start_s <= back and end_s >= self.killed_at_s


@dataclass(frozen=True)
class FaultPlan:
    services: Sequence[str]
    first_kill_s: float
    spacing_s: float
    restart_after_s: float
    start_timeout_s: float
    busy_wait_s: float = 30.0


async def inject(
    cluster: Cluster,
    plan: FaultPlan,
    *,
    start: float,
    say: Callable[[str], None],
    kills: list[Kill],
    streaming: Callable[[], int] = lambda: 1,
) -> None:
    """Kill and restart each service of the plan in turn, appending to `kills` as it goes."""

    def now() -> float:
        return time.monotonic() - start

    next_at = plan.first_kill_s
    for service in plan.services:
        if next_at > now():
            await asyncio.sleep(next_at - now())
        busy_until = now() + plan.busy_wait_s
        while streaming() == 0 and now() < busy_until:
            await asyncio.sleep(0.02)
        killed = cluster.kill(service)
        kill = Kill(service, killed.replica, now())
        kills.append(kill)
        say(f"killed {service} ({killed.replica}) with SIGKILL")
        await asyncio.sleep(plan.restart_after_s)
        restarted = cluster.start(killed.instance)
        kill.restarted_replica, kill.restarted_at_s = restarted.replica, now()
        say(f"restarted {service} as {restarted.replica}")
        try:
            await wait_alive(cluster, restarted, plan.start_timeout_s)
        except RuntimeError as error:  # the report says it never came back; no more kills
            say(f"{service} did not come back: {error}")
            return
        kill.back_at_s = now()
        down = kill.back_at_s - kill.killed_at_s
        say(f"{service} is back ({restarted.replica}), {down:.1f} s after the kill")
        next_at = kill.back_at_s + plan.spacing_s
