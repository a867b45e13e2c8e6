"""The executor contract: the transport-free half of a step, written once for every executor.

`SchedulerCore` decides; an executor (the in-process engine, the scheduler service, the
simulator, the tests' fake) moves tokens to models and back. Everything between the two that
involves no transport lives here, so that an executor implements only `Transport`: swap a
preempted request's KV, draft, verify, free. One step, in any executor:

1. `core.next_batch(now, kv)` gives a `MicroBatch`;
2. `Transport.swap_out`, then `route_releases` (what preemption let go), then `Transport.swap_in`;
3. `DraftRound.of(core, batch).jobs`: each request's `DraftRequest` per drafter (its own draft,
   a standby's warm-up, a standby's tree to merge); the transport drafts them and
   `DraftRound.apply` turns the answers (`DraftedTree`) into the core's notes and the trees,
   own and partner, that `core.select_trees` takes;
4. `verify_requests`: the verifier's entries (`VerifyRequest`) for the selected trees and the
   prompt chunks; `step_results` maps its answers (`VerifiedRequest`) to the core's `StepResult`;
5. `core.observe(batch, results, now)` gives each request's `StepOutput`; `route_releases` hands
   the state the core let go (`Release`) to the transport's `free_target` / `free_draft`.

`StepDriver` runs 2-5 for an executor whose transport answers at once (engine, simulator, fake);
the scheduler service, whose transport is asynchronous, calls the same pieces between its awaits.
`new_request` is the one constructor of a request's state, its SLO resolved (`Resolved`).
"""

from __future__ import annotations

import secrets
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from shared.errors import InvalidRequestError
from shared.scheduling.core import (
    DraftPlan,
    MicroBatch,
    SchedulerCore,
    StepOutput,
    StepResult,
    draft_request,
    request_history,
)
from shared.scheduling.cost_model import CostModel
from shared.scheduling.request import RequestState
from shared.scheduling.slo_classes import effective_class, resolve_tpot_slo
from shared.settings import SloSettings
from shared.values.methods import DraftMethod
from shared.values.sampling import SEED_BITS, SamplingParams
from shared.values.steps import DraftedTree, DraftRequest, VerifiedRequest, VerifyRequest
from shared.values.tree import TokenTree


# ---- a request's state ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Resolved:
    """What the executor decides for a request that the request does not say: its seed and its
    TPOT objective and class (kept by the scheduler service across a takeover)."""

    seed: int
    tpot_slo_ms: float | None
    slo_class: str | None


def resolve(
    params: SamplingParams,
    slo_class: str | None,
    tpot_slo_ms: float | None,
    slo: SloSettings,
    cost: CostModel | None,
) -> Resolved:
    """The request's seed (its own, else a random one) and objective (`slo_classes`); raises
    InvalidRequestError for an unknown class or a class objective without a baseline."""
    seed = params.seed if params.seed is not None else secrets.randbits(SEED_BITS)
    objective = resolve_tpot_slo(slo_class, tpot_slo_ms, slo, cost)
    return Resolved(seed, objective, effective_class(slo_class, tpot_slo_ms, slo))


def check_draft_model(draft_model: str | None, known: Iterable[str], param: str) -> None:
    """InvalidRequestError unless the draft a request asks for (if any) is one of `known`."""
    known = sorted(known)
    if draft_model is not None and draft_model not in known:
        raise InvalidRequestError(
            f"unknown draft model {draft_model!r}; known: {known}", param=param
        )


def new_request(
    request_id: str,
    prompt: Sequence[int],
    params: SamplingParams,
    resolved: Resolved,
    *,
    arrival_time: float,
    priority: int = 0,
    requested_draft: str | None = None,
    speculate: bool = True,
    method: DraftMethod | None = None,
    app: str = "",
) -> RequestState:
    """The core's state of a new request (`resolved` by `resolve`, or as stored before)."""
    return RequestState(
        request_id,
        list(prompt),
        params,
        resolved.seed,
        arrival_time=arrival_time,
        priority=priority,
        tpot_slo_ms=resolved.tpot_slo_ms,
        slo_class=resolved.slo_class,
        requested_draft=requested_draft,
        speculate=speculate,
        method=method,
        app=app,
    )


# ---- drafting ------------------------------------------------------------------------------------
# A request's own draft, a standby replica's warm-up (fast switching: only its KV is wanted), or
# a standby's tree to merge with the own draft's (`MicroBatch.merge`)
DraftRole = Literal["draft", "warm", "merge"]
DraftKey = tuple[str, str, str]  # (model, replica, request id): one answer


@dataclass(frozen=True)
class DraftJob:
    """One request's draft on one drafter replica this step."""

    role: DraftRole
    plan: DraftPlan
    entry: DraftRequest

    @property
    def key(self) -> DraftKey:
        return (self.plan.model, self.plan.replica, self.entry.request_id)


@dataclass(frozen=True)
class Drafted:
    """A draft round's trees: each request's own (`select_trees`' `drafted`) and the standby
    trees to merge with them (its `partners`)."""

    trees: dict[str, TokenTree]
    partners: dict[str, TokenTree]


@dataclass(frozen=True)
class DraftRound:
    """The drafting of one micro-batch: its jobs, own drafts first, then the standby jobs."""

    jobs: tuple[DraftJob, ...]

    @classmethod
    def of(cls, core: SchedulerCore, batch: MicroBatch) -> DraftRound:
        eos = core.config.eos_token_ids
        jobs = [
            DraftJob("draft", plan, draft_request(core.requests[rid], plan, eos))
            for rid, plan in batch.drafts.items()
        ]
        for rid, plan in batch.standby_plans.items():
            role: DraftRole = "merge" if rid in batch.merge else "warm"
            jobs.append(DraftJob(role, plan, draft_request(core.requests[rid], plan, eos)))
        return cls(tuple(jobs))

    def by_replica(self) -> dict[tuple[str, str], list[DraftJob]]:
        """The jobs per drafter replica (model, replica), in round order."""
        groups: dict[tuple[str, str], list[DraftJob]] = {}
        for job in self.jobs:
            groups.setdefault((job.plan.model, job.plan.replica), []).append(job)
        return groups

    def apply(self, core: SchedulerCore, answers: Mapping[DraftKey, DraftedTree]) -> Drafted:
        """Tell the core how each job went (`note_drafted`, `note_warmed`) and collect the trees.
        A job is answered when its key holds a tree of its step; anything else (no answer, an
        error, a stale step) leaves that drafter's state unknown to the core, which starts it
        over. (A transport that can receive trees of another state checks their roots.)"""
        trees: dict[str, TokenTree] = {}
        partners: dict[str, TokenTree] = {}
        for job in self.jobs:
            rid = job.entry.request_id
            tree = _answered_tree(job, answers.get(job.key))
            if job.role == "draft":
                core.note_drafted(rid, tree is not None)
                if tree is not None:
                    trees[rid] = tree
                continue
            core.note_warmed(rid, job.plan, tree is not None)
            if tree is not None and job.role == "merge":
                partners[rid] = tree
        return Drafted(trees, partners)


def _answered_tree(job: DraftJob, answer: DraftedTree | None) -> TokenTree | None:
    if answer is None or answer.tree is None or answer.step != job.entry.step:
        return None
    return answer.tree


# ---- verification --------------------------------------------------------------------------------
def verify_requests(
    core: SchedulerCore, batch: MicroBatch, trees: Mapping[str, TokenTree]
) -> tuple[VerifyRequest, ...]:
    """The verifier's entries for a micro-batch: each prefilling request's chunk (the verifier
    computes only what it does not find cached), then each decoding request's selected tree."""
    entries = []
    for r, chunk in batch.prefill:
        start = r.num_prefilled
        entries.append(
            _verify_entry(
                core,
                r,
                chunk=tuple(r.prefill_tokens[start : start + chunk]),
                chunk_start=start,
                chunk_is_last=start + chunk == len(r.prefill_tokens),
            )
        )
    for r in batch.decode:
        entries.append(
            _verify_entry(core, r, tree=trees[r.request_id], context_len=r.num_tokens - 1)
        )
    return tuple(entries)


def _verify_entry(core: SchedulerCore, r: RequestState, **part: Any) -> VerifyRequest:
    """`r`'s verifier entry with its `part`: a prefill chunk's fields or a tree's."""
    return VerifyRequest(
        r.request_id,
        r.step,
        r.params,
        r.seed,
        r.tokens_left,
        want_features=core.wants_features(r),
        history=request_history(r, core.config.eos_token_ids),
        **part,
    )


def step_results(verified: Iterable[VerifiedRequest]) -> dict[str, StepResult]:
    """The verifier's answers as the core's step results, by request id."""
    return {
        v.request_id: StepResult(
            v.request_id,
            v.step,
            v.new_tokens,
            len(v.accepted),
            v.error,
            v.features,
            v.logprobs,
            cached_tokens=v.cached_tokens,
            prompt_logprobs=v.prompt_logprobs,
        )
        for v in verified
    }


# ---- releases ------------------------------------------------------------------------------------
class Releaser(Protocol):
    """Where an executor frees what the core let go."""

    def free_target(self, request_id: str) -> None:
        """Free the request's KV on the target (resident or swapped out)."""
        ...

    def free_draft(self, model: str, replica: str, request_id: str) -> None:
        """Free the request's state on one drafter replica."""
        ...


def route_releases(core: SchedulerCore, releaser: Releaser) -> int:
    """Hand every release the core has made since the last call to `releaser`; how many."""
    releases = core.take_releases()
    for release in releases:
        if release.target:
            releaser.free_target(release.request_id)
        if release.draft is not None:
            releaser.free_draft(release.draft[0], release.draft[1], release.request_id)
    return len(releases)


# ---- the transport and a synchronous step --------------------------------------------------------
class Transport(Releaser, Protocol):
    """All an executor implements: where the KV and the drafts live, and how models are run."""

    def swap_out(self, request: RequestState) -> None:
        """Move a preempted request's target KV to host memory (`MicroBatch.swap_out`)."""
        ...

    def swap_in(self, request: RequestState) -> None:
        """Bring a resumed request's KV back from host memory (`MicroBatch.swap_in`)."""
        ...

    def draft(self, drafts: DraftRound) -> Mapping[DraftKey, DraftedTree]:
        """Run the round's jobs; the answers by job key (a job left out failed)."""
        ...

    def draft_time(self) -> float:
        """The clock when drafting ended: the time `select_trees` is given."""
        ...

    def verify(
        self, batch: MicroBatch, entries: Sequence[VerifyRequest]
    ) -> Sequence[VerifiedRequest]:
        """Verify the entries (one forward of the target; none for a micro-batch that only
        preempted); an answer per entry."""
        ...


@dataclass(frozen=True)
class StepDriver:
    """A step's transport-free half, for a transport that answers at once."""

    core: SchedulerCore
    transport: Transport

    def run(self, batch: MicroBatch) -> dict[str, StepResult]:
        """Preempt and resume, draft, select and verify one micro-batch; its step results."""
        self.prepare(batch)
        return self.speculate(batch)

    def speculate(self, batch: MicroBatch) -> dict[str, StepResult]:
        """Draft, select and verify a prepared micro-batch; its step results."""
        drafts = DraftRound.of(self.core, batch)
        drafted = drafts.apply(self.core, self.transport.draft(drafts) if drafts.jobs else {})
        now = self.transport.draft_time()
        trees = self.core.select_trees(batch, drafted.trees, now, drafted.partners)
        entries = verify_requests(self.core, batch, trees)
        return step_results(self.transport.verify(batch, entries))

    def prepare(self, batch: MicroBatch) -> None:
        """Swap out, free what preemption (or a change of draft model) let go, swap in."""
        for request in batch.swap_out:
            self.transport.swap_out(request)
        route_releases(self.core, self.transport)
        for request in batch.swap_in:
            self.transport.swap_in(request)

    def finish(
        self, batch: MicroBatch, results: Mapping[str, StepResult], now: float
    ) -> list[StepOutput]:
        """Commit a verified micro-batch; its outputs, after the releases are routed."""
        outputs = self.core.observe(batch, results, now)
        route_releases(self.core, self.transport)
        return outputs
