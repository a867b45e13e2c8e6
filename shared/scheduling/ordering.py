"""Ordering, admission and preemption: who gets verifier time first.

A policy orders requests; the core fills micro-batches in that order (running requests first,
then admissions while the budget and the running-set limit last) and preempts the running
requests the policy names. FCFS is the baseline; LAPS-SD, LAS and LP-SJF implement the same
interface with the context it passes (request states with their attained service and accepted
lengths, the clock, the cost model).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from shared.scheduling.cost_model import CostModel
from shared.scheduling.request import RequestState


@dataclass(frozen=True)
class PolicyContext:
    now: float
    cost: CostModel | None
    max_running: int


class SchedulingPolicy(Protocol):
    name: str

    def order(self, requests: Sequence[RequestState], ctx: PolicyContext) -> list[RequestState]:
        """Requests in the order they should get verifier time."""
        ...

    def preempt(
        self,
        running: Sequence[RequestState],
        waiting: Sequence[RequestState],
        ctx: PolicyContext,
    ) -> list[RequestState]:
        """Running requests to preempt so that waiting ones can run."""
        ...

    def forget(self, request_id: str) -> None:
        """The request finished: drop what the policy kept of it."""
        ...


class FCFS:
    """First come, first served: vLLM's priority field first, then arrival; no preemption."""

    name = "fcfs"

    def order(self, requests: Sequence[RequestState], ctx: PolicyContext) -> list[RequestState]:
        return sorted(requests, key=lambda r: (r.priority, r.arrival))

    def preempt(
        self,
        running: Sequence[RequestState],
        waiting: Sequence[RequestState],
        ctx: PolicyContext,
    ) -> list[RequestState]:
        return []

    def forget(self, request_id: str) -> None:
        pass


POLICIES = ("fcfs", "las", "lp-sjf", "laps-sd")
NEEDS_LENGTHS = ("lp-sjf", "laps-sd")
