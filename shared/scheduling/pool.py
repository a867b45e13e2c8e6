"""The scheduler core's request pool: the requests it holds (running and waiting), the policies
every part of the core consults, what it remembers per request, and the state it tells the
executor to free. One pool is shared by the core's parts (`core.py`)."""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Sequence

from shared.errors import ContextLengthError, InvalidRequestError
from shared.scheduling.core_types import (
    CoreConfig,
    PendingCounterfactual,
    Release,
    StepOutput,
    tree_capacity_with,
)
from shared.scheduling.cost_model import CostModel
from shared.scheduling.draft_choice import DraftChooser
from shared.scheduling.features import FeatureLog
from shared.scheduling.micro_batches import StepShape
from shared.scheduling.ordering import SchedulingPolicy
from shared.scheduling.prefix_index import PrefixIndex
from shared.scheduling.replicas import ReplicaMatcher
from shared.scheduling.request import FinishReason, RequestState, Standby
from shared.scheduling.speculation import AcceptanceEstimate, CopyEstimate, SpeculationState
from shared.scheduling.tree_selection import TreeSelector
from shared.values.methods import DraftMethod


class RequestPool:
    def __init__(
        self,
        config: CoreConfig,
        policy: SchedulingPolicy,
        chooser: DraftChooser,
        matcher: ReplicaMatcher,
        selector: TreeSelector,
        cost: CostModel | None,
        prefix_index: PrefixIndex | None,
    ) -> None:
        self.config = config
        self.policy = policy
        self.chooser = chooser
        self.matcher = matcher
        self.selector = selector
        self.cost = cost
        # the verifier's cached and pending blocks as the core sees them: what a chunk is
        # charged (where the KV view cannot attach prefixes: the scheduler service), and which
        # requests wait for a shared prefix that a chunk in flight computes
        self.prefix_index = prefix_index
        self.requests: dict[str, RequestState] = {}
        self.running: list[RequestState] = []  # admission order
        self.waiting: list[RequestState] = []
        self.drafters: dict[str, list[str]] = {}  # live draft model -> its replicas
        self.releases: list[Release] = []
        self.preemptions: Counter[str] = Counter()  # by kind: kept, swapped, recomputed
        self.kv_full = False  # without a KV view: the verifier refused, admit nobody new
        self.step_shape = StepShape()  # what a decoding request's steps verify, on average
        # what the planner remembers, per request and draft model
        self.speculation: dict[str, dict[str, SpeculationState]] = {}
        self.model_estimates: dict[str, AcceptanceEstimate] = {}
        # a model-free draft's over all requests, by how its previous step ended (`CopyRuns`)
        self.copy_estimates: dict[tuple[str, bool], CopyEstimate] = {}
        self.features: dict[str, FeatureLog] = {}  # feature-level drafts: the target's
        self.counterfactuals: dict[str, list[PendingCounterfactual]] = {}
        self._arrivals = itertools.count()

    # ---- requests in and out -------------------------------------------------------------------
    def check(self, prompt: Sequence[int], max_tokens: int) -> None:
        """Refuse what no schedule can serve (raises `InvalidRequestError` subclasses)."""
        if not prompt:
            raise InvalidRequestError("prompt is empty", param="prompt")
        vocab = self.config.vocab_size
        bad = next((t for t in prompt if not 0 <= t < vocab), None)
        if bad is not None:
            raise InvalidRequestError(f"token id {bad} out of range [0, {vocab})", param="prompt")
        if len(prompt) + max_tokens > self.config.max_context:
            raise ContextLengthError(
                f"prompt of {len(prompt)} tokens plus max_tokens={max_tokens} exceeds the "
                f"model's context of {self.config.max_context} tokens",
                param="max_tokens",
            )

    def add(self, request: RequestState) -> None:
        self.check(request.prompt, request.params.max_tokens)
        if request.request_id in self.requests:
            raise InvalidRequestError(
                f"request id {request.request_id!r} is already in use", param="request_id"
            )
        request.arrival = next(self._arrivals)
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def admit(self, request: RequestState) -> None:
        if request in self.waiting:
            self.waiting.remove(request)
            self.running.append(request)

    def requeue(self, request: RequestState) -> None:
        """Move a running request back to the front of the queue."""
        if request in self.running:
            self.running.remove(request)
        self.waiting.insert(0, request)

    def finished_output(
        self,
        request: RequestState,
        reason: FinishReason,
        error: str | None = None,
        error_type: str | None = None,
    ) -> StepOutput:
        self.finish(request, reason, error)
        return StepOutput(
            request.request_id,
            request.step,
            len(request.output),
            [],
            reason,
            error=error,
            error_type=error_type,
        )

    def finish(self, request: RequestState, reason: FinishReason, error: str | None = None) -> None:
        """Drop the request from the pool; its target and draft state are to be released."""
        request.finish_reason = reason
        request.error = error
        rid = request.request_id
        self.requests.pop(rid, None)
        if request in self.running:
            self.running.remove(request)
        if request in self.waiting:
            self.waiting.remove(request)
        self.kv_full = False
        if self.prefix_index is not None and error is None and not request.is_prefilling:
            # the verifier keeps its committed tokens' blocks (all but the last one emitted)
            self.prefix_index.insert(request.all_tokens, request.num_tokens - 1)
        self.releases.append(Release(rid, True))
        self.release_draft(request)
        self.chooser.forget(rid)
        self.policy.forget(rid)
        self.speculation.pop(rid, None)
        self.features.pop(rid, None)
        self.counterfactuals.pop(rid, None)

    # ---- state the executor frees --------------------------------------------------------------
    def release_target(self, request: RequestState) -> None:
        """The request's target KV goes (it is recomputed when it runs again)."""
        request.drop_kv()
        self.releases.append(Release(request.request_id, True))

    def release_draft(self, request: RequestState) -> None:
        """Leave the request's drafters, current, standby and parked (their state is to be
        freed)."""
        self.release_current(request)
        self.release_standby(request)
        for parked in request.parked.values():
            self.releases.append(Release(request.request_id, False, (parked.model, parked.replica)))
        request.parked.clear()

    def leave_current(self, request: RequestState) -> None:
        """Switch away from the request's current drafter: parked there (it keeps the request's
        committed tokens for a switch back) where the chooser parks, else released."""
        model, replica, held = request.draft_model, request.drafter, request.num_seen_by_drafter
        if self.chooser.parks_switched and model is not None and replica is not None and held > 0:
            request.parked[model] = Standby(model, replica, held)
            request.draft_model = None  # kept there: `release_current` frees nothing
        self.release_current(request)

    def take_parked(self, request: RequestState, model: str) -> Standby | None:
        """The request's parked drafter of `model` if it is on a live replica and holds
        anything (a parked state elsewhere is released)."""
        parked = request.parked.pop(model, None)
        if parked is None:
            return None
        if parked.replica in self.drafters.get(model, ()) and parked.num_seen > 0:
            return parked
        self.releases.append(Release(request.request_id, False, (parked.model, parked.replica)))
        return None

    def release_current(self, request: RequestState) -> None:
        """Leave the request's current drafter (its state there is to be freed)."""
        if request.draft_model is not None and request.drafter is not None:
            self.releases.append(
                Release(request.request_id, False, (request.draft_model, request.drafter))
            )
        self.matcher.release(request.request_id)
        request.draft_model = request.drafter = None
        request.num_seen_by_drafter = 0

    def release_standby(self, request: RequestState) -> None:
        standby = request.standby
        if standby is not None:
            self.releases.append(
                Release(request.request_id, False, (standby.model, standby.replica))
            )
            request.standby = None

    def drop_kept(self) -> None:
        """The verifier ran out of memory: every kept request's KV goes (recomputed later)."""
        for request in [r for r in self.waiting if r.kv == "kept"]:
            self.release_draft(request)
            self.release_target(request)
            self.preemptions["recomputed"] += 1

    # ---- what a request may draft --------------------------------------------------------------
    def wants_features(self, request: RequestState) -> bool:
        """Whether the verifier should return the target's features for this request."""
        return bool(self.config.feature_drafts) and request.speculate

    def method(self, request: RequestState) -> DraftMethod | None:
        if not request.speculate or request.tokens_left <= 1:
            return None
        return request.method or self.config.method

    def step_method(self, request: RequestState, num_requests: int) -> DraftMethod | None:
        """This step's drafting method: the request's own, else the selector's choice for a
        step of `num_requests` under the hardware budget."""
        method = self.method(request)
        if request.method is not None:
            return method
        budget = self.config.token_budget
        if self.cost is not None:
            budget = min(budget, self.cost.hardware_budget())
        return self.selector.draft_method(method, num_requests, budget)

    def tree_capacity(self, request: RequestState) -> int:
        """Nodes (root included) the request's tree may take this step."""
        method = self.method(request)
        if request.method is None:  # the selector may resize the configured method per step
            method = self.selector.method_bound(method)
        return tree_capacity_with(method, self.config)

    def max_depth(self, request: RequestState) -> int:
        room = self.config.max_context - request.num_tokens
        return max(0, min(request.tokens_left - 1, room))

    @property
    def scores_model_free(self) -> bool:
        """Whether every request drafting with a model also gets a model-free draft's tree, to
        merge (`merge_drafts = model-free`) or to score (a chooser that reads counterfactuals)."""
        config = self.config
        merges = config.merge_drafts == "model-free"
        return bool(config.model_free_drafts) and (merges or self.chooser.counterfactual)

    def first_live_model_free(self) -> str | None:
        """The model-free draft that drafts beside model drafts: the first configured live one."""
        return next((m for m in self.config.model_free_drafts if m in self.drafters), None)

    def model_free_depth(self, request: RequestState) -> int:
        """How deep a model-free draft drafts for the request: its method's depth, as far as
        the request's tokens left and context allow."""
        return min(self.config.model_free_method.num_layers, self.max_depth(request))

    def model_free_partner(self, request: RequestState, model: str | None = None) -> str | None:
        """The model-free draft whose tree merges with the request's model draft (`model`,
        where not its current one) this step and whose acceptance plans the model's depth
        (`merge_drafts = model-free`, `model_beside_copy` not "always"); None where none does."""
        config = self.config
        if config.merge_drafts != "model-free" or config.model_beside_copy == "always":
            return None
        if (model or request.draft_model) in config.model_free_drafts:
            return None
        return self.first_live_model_free()

    # ---- what the planner remembers ------------------------------------------------------------
    def state(self, request: RequestState, model: str) -> SpeculationState:
        per_model = self.speculation.setdefault(request.request_id, {})
        state = per_model.get(model)
        if state is None:
            state = per_model[model] = SpeculationState(AcceptanceEstimate())
        return state

    def model_estimate(self, model: str) -> AcceptanceEstimate:
        return self.model_estimates.setdefault(model, AcceptanceEstimate())

    def copy_estimate(self, model: str, running: bool) -> CopyEstimate:
        return self.copy_estimates.setdefault((model, running), CopyEstimate())
