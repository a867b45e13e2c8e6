"""Ordering, admission and preemption: who gets verifier time first.

A policy orders requests; the core fills micro-batches in that order (running requests first,
then admissions while the budget and the running-set limit last) and preempts the running
requests the policy names. FCFS is the baseline; LAPS-SD, LAS and LP-SJF implement the same
interface with the context it passes (request states with their attained service and accepted
lengths, the clock, the cost model).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from shared.scheduling.cost_model import CostModel
from shared.scheduling.request import RequestState

if TYPE_CHECKING:
    from shared.settings import LapsSettings


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


def make_policy(
    name: str,
    predictor: str | None = None,
    laps: LapsSettings | None = None,
    true_lengths: Mapping[str, int] | None = None,
) -> SchedulingPolicy:
    """The policy called `name`; LP-SJF and LAPS-SD use the length predictor named (None: the
    learned one). `true_lengths` (request id -> its answer's length, filled as requests come)
    is for the `oracle` predictor of an experiment that knows them; no other predictor sees it."""
    from shared.scheduling.laps import LAPSSD, LAS, LPSJF, PREDICTORS, OracleLength

    if name not in POLICIES:
        raise ValueError(f"unknown scheduling policy {name!r}; known: {list(POLICIES)}")
    if name == "fcfs":
        return FCFS()
    if name == "las":
        return LAS()
    predictor = predictor or "learned"
    if predictor not in PREDICTORS:
        raise ValueError(
            f"unknown output-length predictor {predictor!r} (known: {sorted(PREDICTORS)}; "
            "the oracle is for experiments that know each request's length)"
        )
    lengths = OracleLength(true_lengths) if predictor == "oracle" else PREDICTORS[predictor]()
    if name == "lp-sjf":
        return LPSJF(lengths)
    return LAPSSD(lengths) if laps is None else LAPSSD(lengths, laps)
