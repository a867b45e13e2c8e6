"""Which replica of a draft model serves a request.

A request stays on its replica while that replica lives (its draft KV stays warm); a new or
orphaned request goes to the live replica with the fewest requests. Spin's per-drafter batch
capacities plug in here.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Protocol


class ReplicaMatcher(Protocol):
    name: str

    def place(self, request_id: str, current: str | None, replicas: Sequence[str]) -> str:
        """A replica (one of `replicas`, never empty) for the request; `current` while it is
        one of them."""
        ...

    def release(self, request_id: str) -> None: ...

    def load(self) -> Mapping[str, int]: ...


class LeastLoadedSticky:
    name = "least-loaded"

    def __init__(self) -> None:
        self._where: dict[str, str] = {}
        self._load: Counter[str] = Counter()

    def place(self, request_id: str, current: str | None, replicas: Sequence[str]) -> str:
        if current is not None and current in replicas:
            if self._where.get(request_id) != current:  # e.g. a fast switch to its standby
                self.release(request_id)
                self._where[request_id] = current
                self._load[current] += 1
            return current
        self.release(request_id)
        replica = min(replicas, key=lambda r: (self._load[r], r))
        self._where[request_id] = replica
        self._load[replica] += 1
        return replica

    def release(self, request_id: str) -> None:
        replica = self._where.pop(request_id, None)
        if replica is not None:
            self._load[replica] -= 1
            if self._load[replica] <= 0:
                del self._load[replica]

    def load(self) -> Mapping[str, int]:
        return dict(self._load)


MATCHERS = {"least-loaded": LeastLoadedSticky}


def make_matcher(name: str) -> ReplicaMatcher:
    try:
        return MATCHERS[name]()
    except KeyError:
        raise ValueError(f"unknown replica matcher {name!r}; known: {sorted(MATCHERS)}") from None
