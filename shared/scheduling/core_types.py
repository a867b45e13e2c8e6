"""The scheduler core's data: its settings, the micro-batch it hands an executor, the results it
takes back, and the small pure functions over them that every part of the core shares."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

import numpy as np

from shared.scheduling.request import FinishReason, RequestState
from shared.values.logprobs import TokenLogprobs
from shared.values.methods import MODEL_FREE_METHOD, DraftMethod, tree_capacity
from shared.values.sampling import SEED_BITS, TokenHistory, token_history
from shared.values.steps import DraftRequest
from shared.values.tree import TokenTree

SpeculationPlanner = Literal["goodput", "fixed"]
# Which requests the standby drafter also drafts a tree for, merged with the current drafter's
# (SpecInfer's merge-based trees): none, every request with a standby, or requests with a TPOT
# objective that they are not meeting; "model-free": every request drafting with a model also
# gets the first live model-free draft's tree (`CoreConfig.model_free_drafts`), merged
MergePolicy = Literal["off", "standby", "at-risk", "model-free"]
ModelBesideCopy = Literal["planned", "runs", "always"]
# Which decoding requests a micro-batch takes: the first in the policy's order ("policy"), or
# its share of each draft model's requests ("per-draft", Spin §V-B: the batch on each drafter is
# split into the M micro-batches, so that no micro-batch waits on one drafter holding most of it)
MicroBatchSplit = Literal["policy", "per-draft"]
# A standby drafter's catch-up: append the committed tokens; the one node it drafts is unused.
WARM_METHOD = DraftMethod("chain", k=1)


@dataclass(frozen=True)
class CoreConfig:
    vocab_size: int
    max_context: int
    eos_token_ids: tuple[int, ...] = ()
    token_budget: int = 512  # B: tokens in one verifier forward, prompt chunks and trees
    max_running: int = 64
    micro_batches: int = 1  # M: micro-batches in flight; each takes 1/M of the running set
    # auto: M from the cost profile, 2 up to `micro_batches`, re-chosen as the running set
    # changes size (`shared/scheduling/micro_batches.py`); otherwise always `micro_batches`
    auto_micro_batches: bool = False
    micro_batch_drop: float = 0.1  # auto: the verifier throughput a split may lose
    micro_batch_split: MicroBatchSplit = "policy"
    method: DraftMethod | None = DraftMethod()  # default drafting method; None: no speculation
    # goodput: size each request's speculation by the cost model (zero included);
    # fixed: always draft the method's full tree
    planner: SpeculationPlanner = "goodput"
    # scale the cost model by what the executor measured of each step (`cost_calibration`)
    calibrate_costs: bool = False
    # the planned draft choice leaves a request's current draft only for one whose planned
    # goodput is this fraction higher
    switch_margin: float = 0.0
    # Draft models that read the target's features (EAGLE-style), and the features' width: the
    # core then asks the verifier for features and keeps them per request (`features.py`).
    feature_drafts: frozenset[str] = frozenset()
    feature_size: int = 0
    # Spin's fast switching: keep each drafting request's KV in step on the model the chooser
    # expects it to move to next (`MicroBatch.warm`), so that the switch costs no prefill
    fast_switching: bool = False
    merge_drafts: MergePolicy = "off"
    # with model-free merges: "planned", the model's depth counts only what the partner is not
    # expected to deliver (`DepthQuery.level_gains`); "always", planned as if alone
    model_beside_copy: ModelBesideCopy = "planned"
    # Drafts that load no model (`shared/engine/model_free.py`), in order of preference: they
    # draft with `model_free_method`, cost no drafting time, and, being deterministic functions
    # of the committed tokens, can be scored after every step without being run (counterfactual)
    model_free_drafts: tuple[str, ...] = ()
    model_free_method: DraftMethod = MODEL_FREE_METHOD


class KVView(Protocol):
    """The executor's target KV cache as the core may see it: counts of blocks, no tensors."""

    can_swap: bool  # the executor can move a preempted request's KV to host memory

    def num_free_blocks(self) -> int: ...

    def blocks_needed(self, request_id: str, num_new_tokens: int) -> int:
        """Blocks a forward of `num_new_tokens` more tokens would allocate (all of them for a
        request whose KV is not resident)."""
        ...

    def blocks_held(self, request_id: str) -> int:
        """Blocks freeing the request would give back (not those other requests share)."""
        ...


class PrefixKVView(KVView, Protocol):
    """A KV view whose cache shares prompt prefixes (`docs/prefix-caching.md`)."""

    def attach_prefix(self, request_id: str, tokens: Sequence[int]) -> int:
        """The request, holding no KV, takes the cached KV of the longest cached prefix of
        `tokens` (never all of them); returns how many tokens it now holds."""
        ...


@dataclass(frozen=True)
class DraftPlan:
    """What one request's drafter is asked for this step."""

    model: str
    replica: str
    method: DraftMethod
    base_len: int  # committed tokens the drafter holds ...
    new_tokens: tuple[int, ...]  # ... and those it must append (the last is the root)
    max_depth: int
    max_nodes: int
    # feature-level drafts: the target's features before each new token (`DraftRequest.features`)
    features: np.ndarray | None = None
    # a second drafter of the same request in the same step samples from its own random stream:
    # sibling draws from different drafters must be independent for lossless verification
    stream: int = 0


@dataclass
class MicroBatch:
    id: int
    started: float
    decode: list[RequestState] = field(default_factory=list)
    prefill: list[tuple[RequestState, int]] = field(default_factory=list)  # request, chunk
    drafts: dict[str, DraftPlan] = field(default_factory=dict)  # request id -> plan
    # fast switching: request id -> the standby drafter's catch-up (no tree is used: run it
    # beside the step's drafting, then tell the core with `note_warmed`)
    warm: dict[str, DraftPlan] = field(default_factory=dict)
    # merged trees: request id -> its standby drafter's full draft, merged with the current
    # drafter's tree before selection (the executor hands it to `select_trees` as a partner)
    merge: dict[str, DraftPlan] = field(default_factory=dict)
    swap_out: list[RequestState] = field(default_factory=list)  # preempted: keep KV on host
    drop: list[RequestState] = field(default_factory=list)  # preempted: KV released, recompute
    swap_in: list[RequestState] = field(default_factory=list)  # resumed from host memory
    failed: list[StepOutput] = field(default_factory=list)  # could not go on (reported now)
    probes: set[str] = field(default_factory=set)  # drafting only to re-estimate acceptance
    # decoding requests whose model draft sits out this step (planned at depth 0) beside a
    # model-free partner, which drafts alone for them (`StandbyPlanner`)
    partner_only: set[str] = field(default_factory=set)
    trees: dict[str, TokenTree] = field(default_factory=dict)  # the selected trees
    # each request's own drafter's tree as drafted, before any merge and the selection: the
    # planner's per-depth estimate learns from it (the selector keeps the nodes likely to be
    # accepted, so the verified nodes alone would overstate how deep a draft is accepted)
    drafted_trees: dict[str, TokenTree] = field(default_factory=dict)
    # merged trees: the request's own drafter's tree, before the merge (what its model learns)
    own_trees: dict[str, TokenTree] = field(default_factory=dict)
    # model-free partners (`batch.merge` plans of a model-free draft): the tree each proposed,
    # merged or only scored (its counterfactual acceptance), by request id
    model_free_trees: dict[str, TokenTree] = field(default_factory=dict)
    # prompt chunks' tokens the verifier is expected to find cached (request id -> count):
    # sent with the chunk but not charged to the budget (`PrefixIndex`)
    prefill_cached: dict[str, int] = field(default_factory=dict)
    is_observed: bool = False

    @property
    def standby_plans(self) -> dict[str, DraftPlan]:
        """Every job for a standby replica, warm-up or merged draft (a request has one at most;
        it is always another model than the request's own drafter)."""
        return self.warm | self.merge

    @property
    def members(self) -> list[RequestState]:
        return self.decode + [r for r, _ in self.prefill]

    @property
    def prefill_tokens(self) -> int:
        """Prompt tokens the verifier computes (less those expected cached)."""
        return sum(n for _, n in self.prefill) - sum(self.prefill_cached.values())

    @property
    def is_empty(self) -> bool:
        return not self.decode and not self.prefill


@dataclass(frozen=True)
class StepResult:
    """The verifier's answer for one request of a micro-batch."""

    request_id: str
    step: int
    tokens: Sequence[int] = ()  # accepted draft tokens then the bonus (or a prefill's first)
    num_accepted: int = 0
    error: str | None = None  # "kind: detail"
    # the target's features at the positions it committed (asked with `wants_features`)
    features: np.ndarray | None = None
    logprobs: TokenLogprobs | None = None  # of `tokens` (asked with SamplingParams.logprobs)
    cached_tokens: int = 0  # of a chunk, the first tokens the verifier found cached
    # of a chunk's tokens (asked with SamplingParams.prompt_logprobs; the prompt's first has none)
    prompt_logprobs: TokenLogprobs | None = None


@dataclass(frozen=True)
class StepOutput:
    request_id: str
    step: int
    offset: int  # index of new_tokens[0] in the request's output
    new_tokens: list[int]
    finish_reason: FinishReason | None
    num_draft_tokens: int = 0
    num_accepted: int = 0
    draft_model: str | None = None  # the draft verified in this step, if any
    error: str | None = None
    error_type: str | None = None  # OpenAI error type for the client
    logprobs: TokenLogprobs | None = None  # of new_tokens (asked with SamplingParams.logprobs)
    # the first output's (offset 0): of the prompt's tokens after the first (asked with
    # SamplingParams.prompt_logprobs)
    prompt_logprobs: TokenLogprobs | None = None


@dataclass(frozen=True)
class Release:
    """State an executor should free: the target's KV, and/or one drafter replica's."""

    request_id: str
    target: bool
    draft: tuple[str, str] | None = None  # (model, replica)


def request_history(request: RequestState, eos_token_ids: Sequence[int]) -> TokenHistory | None:
    """What the request's processors and seeded noise read this step (None: nothing)."""
    return token_history(request.params, request.prompt, request.output, eos_token_ids)


@dataclass(frozen=True)
class OtherLoad:
    """A verification step apart from one request's tree: the other requests' nodes and the
    prompt tokens beside them, the step's typical context and its number of requests."""

    nodes: int
    context: int
    members: int


@dataclass(frozen=True)
class PendingCounterfactual:
    """A model-free tree proposed for a request but not run as its draft, waiting for enough
    committed tokens to settle how many of its tokens the target would have accepted."""

    model: str
    tree: TokenTree
    start: int  # index (in the request's tokens) of the first token committed after its root
    step_ms: float
    others: OtherLoad | None  # the step beside this request's tree (None: no cost model)


def draft_request(
    request: RequestState, plan: DraftPlan, eos_token_ids: Sequence[int] = ()
) -> DraftRequest:
    """The drafter's job for one request (in process, or on the wire)."""
    return DraftRequest(
        request_id=request.request_id,
        step=request.step,
        base_len=plan.base_len,
        new_tokens=plan.new_tokens,
        method=plan.method,
        sampling=request.params,
        seed=request.seed + (plan.stream << SEED_BITS),
        max_nodes=plan.max_nodes,
        max_depth=plan.max_depth,
        features=plan.features,
        history=request_history(request, eos_token_ids),
        app=request.app,
    )


def token_paths(tree: TokenTree) -> list[tuple[int, ...]]:
    """Each node's draft tokens from the root (the root's own token excluded)."""
    paths: list[tuple[int, ...]] = [()]
    for i in range(1, tree.num_nodes):  # topological order: a parent's path is already there
        paths.append((*paths[int(tree.parents[i])], int(tree.tokens[i])))
    return paths


def own_part(verified: TokenTree, own: TokenTree, accepted: Sequence[int]) -> tuple[TokenTree, int]:
    """A merged tree's part that the request's own drafter proposed (the verified nodes whose
    token path is one of `own`'s), and how many of the `accepted` draft tokens that part holds:
    what the current draft model achieved, for its statistics."""
    own_paths = set(token_paths(own))
    keep = [i for i, path in enumerate(token_paths(verified)) if path in own_paths]
    num_accepted = 0
    while num_accepted < len(accepted) and tuple(accepted[: num_accepted + 1]) in own_paths:
        num_accepted += 1
    return verified.subtree(keep), num_accepted


def tree_capacity_with(method: DraftMethod | None, config: CoreConfig) -> int:
    """Most nodes (root included) of a request's tree under `method`, a model-free draft's tree
    and the union of the two (merged) included, where the core has model-free drafts."""
    capacity = tree_capacity(method)
    if config.model_free_drafts and method is not None:
        capacity += tree_capacity(config.model_free_method) - 1
    return capacity


def mean_context(requests: Sequence[RequestState]) -> int:
    """The typical per-request context of a forward over `requests`, as costs are looked up."""
    return sum(r.num_tokens for r in requests) // len(requests) if requests else 0


def root_only(request: RequestState) -> TokenTree:
    return TokenTree.root_only(int(request.all_tokens[-1]))
