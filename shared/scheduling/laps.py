"""LAPS-SD (Least-Attained/Perceptible-Service for speculative decoding) and the two baselines it
is measured against, LAS and LP-SJF, as ordering/admission/preemption policies of the core.

LAPS-SD keeps K priority queues on service (verifier and drafter time), with thresholds growing
exponentially: Q_j holds requests whose service is below S_1 * M^(j-1). A new request is
*non-perceptible* and starts in Q1; it moves down as its attained service passes the thresholds,
and while non-perceptible it may be preempted whenever the order puts it outside the running set
(least-attained-service behaviour: nothing long blocks the short). Once its acceptance rate is
stable (over the last `stable_rounds` decode steps the cumulative rate moved by less than
`stable_delta`) it becomes *perceptible*: its remaining time T can be estimated (Eq. 6 below),
and it moves to the queue of the service it is expected to have in all, attained + T. Within a
queue perceptible requests go first, shortest estimated time first, then non-perceptible ones in
arrival order.

The paper schedules perceptible requests "by SJF without preemption". We read its lifecycle
events literally: becoming perceptible is a move between queues, so at that one moment the
request takes its place in the order (it yields if a request in a better place waits; its KV
stays where it is); once it runs as a perceptible request it is never preempted again. Were it
never to yield, a request that stabilizes while running would always run to the end, every
other request would wait unexplored, and the schedule would be first come, first served.

Eq. 6, for the remaining output L (predicted total minus what is generated), n draft tokens per
step and acceptance rate A (per draft token, so a step commits n*A + 1 tokens on average):

    T = n * L * T_draft / (n*A + 1)  +  L * T_verify / (n*A + 1)

T_draft is one draft forward of one token and T_verify one verifier forward of n + 1 tokens, both
from the cost model at the request's context. The paper drafts chains, n forwards of one token a
step; a tree of depth D drafts its n tokens in D forwards of about n/D tokens each, so we charge
D * T_draft(n/D) where the paper charges n * T_draft(1) (the same for a chain, where D = n), with
n and D the request's means so far. The paper serves one request at a time (B = 1);
with a running set of B requests the same estimate ranks them, and the core fills micro-batches
in that order (B = 1 stays reachable with `max_running_requests = 1`). The estimate is for one
request alone; in a batch every request's time scales alike, which leaves the ranking unchanged.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from shared.scheduling.lengths import LearnedLength
from shared.scheduling.request import RequestState
from shared.settings import LapsSettings

if TYPE_CHECKING:
    from shared.scheduling.ordering import PolicyContext


class LengthPredictor(Protocol):
    name: str

    def predict(self, request: RequestState) -> float:
        """The request's total output length in tokens."""
        ...

    def forget(self, request_id: str) -> None:
        """The request finished: drop what was kept of it."""
        ...


class OracleLength:
    """The request's true length where the experiment gives it (`true_lengths`: the simulator
    knows every answer's length), else its `max_tokens` (a replay that sends each request's
    length as `max_tokens` with `ignore_eos`). For upper-bound experiments only."""

    name = "oracle"

    def __init__(self, true_lengths: Mapping[str, int] | None = None) -> None:
        self.true_lengths = true_lengths if true_lengths is not None else {}

    def predict(self, request: RequestState) -> float:
        known = self.true_lengths.get(request.request_id)
        return float(request.params.max_tokens if known is None else known)

    def forget(self, request_id: str) -> None:
        pass


# "learned" (the default) is trained on the target's own answers (shared/scheduling/lengths.py)
PREDICTORS: dict[str, type[LengthPredictor]] = {"learned": LearnedLength, "oracle": OracleLength}


def remaining_tokens(request: RequestState, predictor: LengthPredictor) -> float:
    return max(predictor.predict(request) - len(request.output), 1.0)


def _by_service_then_arrival(request: RequestState) -> tuple[int, float, int]:
    return (request.priority, request.attained_service_ms, request.arrival)


def _outside_top(
    running: Sequence[RequestState],
    waiting: Sequence[RequestState],
    ordered: list[RequestState],
    max_running: int,
) -> list[RequestState]:
    """Running requests the order puts outside the first `max_running`, when waiting ones are
    inside (else preempting them would only idle the slot), but for those still prefilling."""
    top = {id(r) for r in ordered[:max_running]}
    if not any(id(r) in top for r in waiting):
        return []
    # a prompt half prefilled is finished first: preempting it would throw its chunks away,
    # and two requests taking turns at that could each start over forever
    return [r for r in running if id(r) not in top and not r.is_prefilling]


class LAS:
    """Least attained service first; a running request is preempted for a waiting one with less."""

    name = "las"

    def forget(self, request_id: str) -> None:
        pass

    def order(self, requests: Sequence[RequestState], ctx: PolicyContext) -> list[RequestState]:
        return sorted(requests, key=_by_service_then_arrival)

    def preempt(
        self,
        running: Sequence[RequestState],
        waiting: Sequence[RequestState],
        ctx: PolicyContext,
    ) -> list[RequestState]:
        ordered = self.order([*running, *waiting], ctx)
        return _outside_top(running, waiting, ordered, ctx.max_running)


class LPSJF:
    """Shortest predicted remaining output first; no preemption."""

    name = "lp-sjf"

    def __init__(self, predictor: LengthPredictor) -> None:
        self.predictor = predictor

    def forget(self, request_id: str) -> None:
        self.predictor.forget(request_id)

    def order(self, requests: Sequence[RequestState], ctx: PolicyContext) -> list[RequestState]:
        return sorted(
            requests,
            key=lambda r: (r.priority, remaining_tokens(r, self.predictor), r.arrival),
        )

    def preempt(
        self,
        running: Sequence[RequestState],
        waiting: Sequence[RequestState],
        ctx: PolicyContext,
    ) -> list[RequestState]:
        return []


@dataclass
class _Tracked:
    """What LAPS-SD remembers of one request: its recent cumulative acceptance rates."""

    rates: deque[float]
    last_step: int = -1
    acceptance: float | None = None  # set once stable: the request is perceptible
    is_committed: bool = False  # it has run as a perceptible request: never preempted again


@dataclass
class LAPSSD:
    predictor: LengthPredictor
    params: LapsSettings = field(default_factory=LapsSettings)
    name: str = "laps-sd"
    _tracked: dict[str, _Tracked] = field(default_factory=dict)

    # ---- the request's state -------------------------------------------------------------------
    def queue(self, request: RequestState, ctx: PolicyContext | None = None) -> int:
        """1..K: the first queue whose threshold the request's service is below: its attained
        service, or for a perceptible request (given the cost model in `ctx`) the service it is
        expected to have when it finishes."""
        service = request.attained_service_ms
        acceptance = self.acceptance(request)
        if acceptance is not None and ctx is not None and ctx.cost is not None:
            service += self.estimated_ms(request, acceptance, ctx)
        return self._queue_of(service)

    def _queue_of(self, service_ms: float) -> int:
        p = self.params
        threshold = p.first_threshold_ms
        for j in range(1, p.num_queues):
            if service_ms < threshold:
                return j
            threshold *= p.threshold_base
        return p.num_queues

    def acceptance(self, request: RequestState) -> float | None:
        """The stable acceptance rate (perceptible), or None (non-perceptible yet)."""
        tracked = self._track(request)
        return tracked.acceptance

    def _track(self, request: RequestState) -> _Tracked:
        tracked = self._tracked.get(request.request_id)
        if tracked is None:
            tracked = _Tracked(deque(maxlen=self.params.stable_rounds))
            self._tracked[request.request_id] = tracked
        if tracked.acceptance is None and request.output and request.step != tracked.last_step:
            tracked.last_step = request.step  # one sample per decode step
            stats = request.stats
            rate = stats.num_accepted / stats.num_draft_tokens if stats.num_draft_tokens else 0.0
            tracked.rates.append(rate)
            full = len(tracked.rates) == tracked.rates.maxlen
            if full and max(tracked.rates) - min(tracked.rates) < self.params.stable_delta:
                tracked.acceptance = sum(tracked.rates) / len(tracked.rates)
        return tracked

    def estimated_ms(self, request: RequestState, acceptance: float, ctx: PolicyContext) -> float:
        """Eq. 6: the remaining time of a perceptible request (for trees as the module says)."""
        stats = request.stats
        n = stats.num_draft_tokens / stats.num_drafts if stats.num_drafts else 0.0
        depth = stats.num_draft_layers / stats.num_drafts if stats.num_drafts else 0.0
        remaining = remaining_tokens(request, self.predictor)
        context = request.num_tokens
        draft_ms, verify_ms = 0.0, 1.0  # without a cost model: steps, each as long
        if ctx.cost is not None:
            verify_ms = ctx.cost.verify_ms(round(n) + 1, context, 1)
            model = request.draft_model
            if depth and model is not None and ctx.cost.has_draft(model):
                width = max(1, round(n / depth))
                draft_ms = depth * ctx.cost.draft_forward_ms(model, width, context, 1)
        steps = remaining / (n * acceptance + 1)
        return steps * (draft_ms + verify_ms)

    def forget(self, request_id: str) -> None:
        self._tracked.pop(request_id, None)
        self.predictor.forget(request_id)

    # ---- the policy ----------------------------------------------------------------------------
    def _key(self, request: RequestState, ctx: PolicyContext) -> tuple[int, int, int, float]:
        acceptance = self.acceptance(request)
        service = request.attained_service_ms
        if acceptance is None:  # non-perceptible: first come, first served, after perceptible
            return (request.priority, self._queue_of(service), 1, float(request.arrival))
        estimate = self.estimated_ms(request, acceptance, ctx)
        if ctx.cost is not None:  # else the estimate counts steps, not milliseconds
            service += estimate
        return (request.priority, self._queue_of(service), 0, estimate)

    def order(self, requests: Sequence[RequestState], ctx: PolicyContext) -> list[RequestState]:
        return sorted(requests, key=lambda r: self._key(r, ctx))

    def preempt(
        self,
        running: Sequence[RequestState],
        waiting: Sequence[RequestState],
        ctx: PolicyContext,
    ) -> list[RequestState]:
        ordered = self.order([*running, *waiting], ctx)
        victims = [r for r in _outside_top(running, waiting, ordered, ctx.max_running)
                   if not self._track(r).is_committed]  # fmt: skip
        preempted = {id(r) for r in victims}
        for request in running:  # a perceptible request that runs on is committed to
            if id(request) not in preempted and self.acceptance(request) is not None:
                self._track(request).is_committed = True
        return victims
