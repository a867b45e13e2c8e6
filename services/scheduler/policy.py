"""Scheduling policies: who runs first, who is admitted, who is preempted.

A policy orders requests; the scheduler fills micro-batches in that order (running requests
first, then admissions while the budget lasts). FCFS is the baseline; LAPS-SD, LAS and LP-SJF
implement the same interface.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from services.scheduler.request import PoolRequest


class SchedulingPolicy(Protocol):
    name: str

    def order(self, requests: Sequence[PoolRequest]) -> list[PoolRequest]:
        """Requests in the order they should get verifier time."""
        ...

    def preempt(
        self, running: Sequence[PoolRequest], waiting: Sequence[PoolRequest]
    ) -> list[PoolRequest]:
        """Running requests to preempt so that waiting ones can run (recomputed later)."""
        ...


class FCFS:
    """First come, first served: arrival order, vLLM's priority field first; no preemption."""

    name = "fcfs"

    def order(self, requests: Sequence[PoolRequest]) -> list[PoolRequest]:
        return sorted(requests, key=lambda r: (r.priority, r.arrival))

    def preempt(
        self, running: Sequence[PoolRequest], waiting: Sequence[PoolRequest]
    ) -> list[PoolRequest]:
        return []


POLICIES: dict[str, type[SchedulingPolicy]] = {"fcfs": FCFS}


def make_policy(name: str) -> SchedulingPolicy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(f"unknown scheduling policy {name!r}; known: {sorted(POLICIES)}") from None
