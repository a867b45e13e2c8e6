"""The scheduler core: every decision of a step, with no I/O, no tensors and no clock of its own.

Executors drive it the same way, the in-process engine (`shared.engine.spec_engine`) and the
scheduler service (`services.scheduler`) alike; a simulator can drive it on a virtual clock:

    batch = core.next_batch(now, kv)          # who runs, who is preempted, drafts to make
    ... executor: apply preemptions, draft `batch.drafts` ...
    trees = core.select_trees(batch, drafted, now)   # each request's tree under the budget
    ... executor: verify prompt chunks and trees ...
    outputs = core.observe(batch, results, now)      # commit tokens, learn, finish
    ... executor: free what `core.take_releases()` names ...

The core owns the request pool (`RequestState`s) and four policies, each chosen by a setting:
ordering/admission/preemption (`ordering`), draft-model choice with feedback (`draft_choice`),
replica matching (`replicas`) and tree selection (`tree_selection`); and the goodput planner
(`speculation`) that sizes every request's speculation from the cost model, zero included.
Several micro-batches can be in flight at once (one per executor lane): `next_batch` only takes
requests that are not in flight.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Literal, Protocol

import numpy as np

from shared.errors import ContextLengthError, InvalidRequestError
from shared.scheduling.cost_model import TYPICAL_CONTEXT, CostModel
from shared.scheduling.draft_choice import DraftChooser, DraftOutcome, FixedDraftModel
from shared.scheduling.features import FeatureLog
from shared.scheduling.micro_batches import StepShape, choose_micro_batches, is_shared_device
from shared.scheduling.ordering import FCFS, PolicyContext, SchedulingPolicy
from shared.scheduling.prefix_index import PrefixIndex
from shared.scheduling.replicas import LeastLoadedSticky, ReplicaMatcher
from shared.scheduling.request import (
    AcceptanceStats,
    FinishReason,
    RequestState,
    Standby,
    append_tokens,
)
from shared.scheduling.speculation import (
    CALIBRATION_CLIP,
    DECAY,
    FIRST_PROBE_INTERVAL,
    MAX_PROBE_INTERVAL,
    OPTIMISTIC_RATE,
    AcceptanceEstimate,
    DepthQuery,
    SpeculationState,
    plan_depths,
)
from shared.scheduling.tree_selection import Goodput, SelectionContext, TreeSelector
from shared.values.logprobs import EMPTY, TokenLogprobs
from shared.values.methods import MODEL_FREE_METHOD, DraftMethod, tree_capacity
from shared.values.sampling import SEED_BITS, TokenHistory, token_history
from shared.values.steps import GRAMMAR_DEAD_END, DraftRequest
from shared.values.tree import DETERMINISTIC, TokenTree, counterfactual_accepted, merge_trees

SpeculationPlanner = Literal["goodput", "fixed"]
# Which requests the standby drafter also drafts a tree for, merged with the current drafter's
# (SpecInfer's merge-based trees): none, every request with a standby, or requests with a TPOT
# objective that they are not meeting; "model-free": every request drafting with a model also
# gets the first live model-free draft's tree (`CoreConfig.model_free_drafts`), merged
MergePolicy = Literal["off", "standby", "at-risk", "model-free"]
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
    # Draft models that read the target's features (EAGLE-style), and the features' width: the
    # core then asks the verifier for features and keeps them per request (`features.py`).
    feature_drafts: frozenset[str] = frozenset()
    feature_size: int = 0
    # Spin's fast switching: keep each drafting request's KV in step on the model the chooser
    # expects it to move to next (`MicroBatch.warm`), so that the switch costs no prefill
    fast_switching: bool = False
    merge_drafts: MergePolicy = "off"
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
    trees: dict[str, TokenTree] = field(default_factory=dict)  # the selected trees
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
class PendingCounterfactual:
    """A model-free tree proposed for a request but not run as its draft, waiting for enough
    committed tokens to settle how many of its tokens the target would have accepted."""

    model: str
    tree: TokenTree
    start: int  # index (in the request's tokens) of the first token committed after its root
    step_ms: float
    node_ms: float | None  # the step's verification time per node (None: no cost model)


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


class SchedulerCore:
    def __init__(
        self,
        config: CoreConfig,
        *,
        policy: SchedulingPolicy | None = None,
        chooser: DraftChooser | None = None,
        matcher: ReplicaMatcher | None = None,
        selector: TreeSelector | None = None,
        cost: CostModel | None = None,
        first_batch_id: int = 1,
        prefix_index: PrefixIndex | None = None,
    ) -> None:
        self.config = config
        # the verifier's cached and pending blocks as the core sees them: what a chunk is
        # charged (where the KV view cannot attach prefixes: the scheduler service), and which
        # requests wait for a shared prefix that a chunk in flight computes
        self.prefix_index = prefix_index
        self.policy = policy or FCFS()
        self.chooser = chooser or FixedDraftModel()
        self.matcher = matcher or LeastLoadedSticky()
        self.selector = selector or Goodput()
        self.cost = cost
        self._batches_in_flight = 0  # returned by next_batch, not yet observed or abandoned
        self._micro_batch_choice: dict[tuple[int, int, int, int], int] = {}
        self._step_shape = StepShape()  # what a decoding request's steps verify, on average
        self.requests: dict[str, RequestState] = {}
        self.running: list[RequestState] = []  # admission order
        self.waiting: list[RequestState] = []
        self.drafters: dict[str, list[str]] = {}  # live draft model -> its replicas
        # what the planner remembers, per request and draft model
        self._speculation: dict[str, dict[str, SpeculationState]] = {}
        self._model_estimates: dict[str, AcceptanceEstimate] = {}
        self._releases: list[Release] = []
        self.stats = AcceptanceStats()  # every verified decode step, as vLLM counts them
        self.preemptions: Counter[str] = Counter()  # by kind: kept, swapped, recomputed
        # draft-model switches: "warm" (to a standby in step, fast switching) and "cold", and
        # "<kind>_tokens", the committed tokens the new drafter still had to append at them
        self.switches: Counter[str] = Counter()
        self.num_merged_trees = 0  # trees verified as the union of two drafters' (merge_drafts)
        self._arrivals = itertools.count()
        self._batch_ids = itertools.count(first_batch_id)
        self._kv_full = False  # without a KV view: the verifier refused, admit nobody new
        self._features: dict[str, FeatureLog] = {}  # feature-level drafts: the target's
        self._counterfactuals: dict[str, list[PendingCounterfactual]] = {}
        # per model-free draft: its counterfactual acceptance on the steps it was not run
        self.counterfactual_stats: dict[str, AcceptanceStats] = {}

    # ---- the pool ------------------------------------------------------------------------------
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

    def cancel(self, request_id: str) -> bool:
        """Abort a request now, or when its micro-batch comes back; False if unknown."""
        request = self.requests.get(request_id)
        if request is None:
            return False
        request.cancelled = True
        if not request.in_flight:
            self._finish(request, "abort")
        return True

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def set_drafters(self, replicas: Mapping[str, Sequence[str]]) -> None:
        """The live draft models and their replicas (the executor's view of its drafters)."""
        self.drafters = {model: list(names) for model, names in replicas.items() if names}

    def wants_features(self, request: RequestState) -> bool:
        """Whether the verifier should return the target's features for this request."""
        return bool(self.config.feature_drafts) and request.speculate

    def _plan_features(self, request: RequestState, base: int) -> tuple[int, np.ndarray] | None:
        """(base, features) for a feature-level draft of the request: the features before each
        token it appends, from `base` or, if those are not held, from 0; None if neither is."""
        log = self._features.get(request.request_id)
        end = request.num_tokens - 1  # the root's feature is not computed yet
        for start in (base, 0):
            lo = max(start, 1) - 1
            if log is not None and log.covers(lo, end):
                return start, log.take(lo, end)
        return None

    def take_releases(self) -> list[Release]:
        releases, self._releases = self._releases, []
        return releases

    # ---- 1. schedule ---------------------------------------------------------------------------
    def next_batch(self, now: float, kv: KVView | None = None) -> MicroBatch | None:
        """The next micro-batch from requests not in flight, or None when there is nothing (or
        as many micro-batches as the core pipelines are in flight)."""
        num_micro_batches = self.num_micro_batches(len(self.running) + len(self.waiting))
        # with a fixed M the executor runs M lanes; with auto it runs the most and M gates them
        if self.config.auto_micro_batches and self._batches_in_flight >= num_micro_batches:
            return None
        batch = MicroBatch(next(self._batch_ids), now)
        ctx = PolicyContext(now, self.cost, self.config.max_running)
        idle = [r for r in self.running if not r.in_flight]
        # a request the policy preempts keeps its KV in the cache (it resumes at no cost);
        # memory pressure moves a kept request's KV out later (`_evict_kept`)
        for victim in self.policy.preempt(idle, self.waiting, ctx):
            self._preempt(victim, batch, kv, keep=True)
        self._resume_kept(ctx)
        running = self.policy.order([r for r in self.running if not r.in_flight], ctx)
        waiting = self.policy.order(self.waiting, ctx)
        admit = not self._kv_full or not self.running
        active = len(self.running) + (len(waiting) if admit else 0)
        share = max(1, math.ceil(active / num_micro_batches))
        budget = self.config.token_budget

        free = kv.num_free_blocks() if kv is not None else 0
        decoding = [r for r in running if not r.is_prefilling]
        for request in self._pick_decoding(decoding, min(share, budget), num_micro_batches):
            if request not in self.running:  # preempted for an older one
                continue
            if kv is not None:
                need = kv.blocks_needed(request.request_id, self._tree_capacity(request))
                while need > free:
                    released = self._evict_kept(request, batch, kv, ctx)
                    released = released or self._preempt_after(request, batch, kv, ctx)
                    if not released:
                        break
                    free += released
                if need > free:
                    if len(self.running) == 1:  # alone in the cache and still too big
                        message = "KV cache exhausted by a single request"
                        batch.failed.append(self._finished_output(request, "error", message))
                    else:  # older requests hold the memory: wait for them
                        free += self._preempt(request, batch, kv)
                    continue
                free -= need
            batch.decode.append(request)

        # speculation is planned before prompt chunks take the rest of the budget: a request
        # reserves its root and about a node per planned level (what the planner charges)
        self._plan_drafts(batch)
        reserve = sum(
            1 + (batch.drafts[r.request_id].max_depth if r.request_id in batch.drafts else 0)
            for r in batch.decode
        )
        pending = any(r.is_prefilling for r in running) or (admit and waiting)
        if pending:
            reserve = min(reserve, budget // 2)
        room = budget - max(reserve, len(batch.decode))
        count = len(batch.decode)
        candidates = [r for r in running if r.is_prefilling and r in self.running]
        candidates += waiting if admit else []
        for request in candidates:
            if count >= share or room <= 0:
                break
            if any(request is r for r in batch.drop + batch.swap_out):
                continue  # preempted for an older request's chunk in this very batch
            is_new = request not in self.running
            if is_new and len(self.running) >= self.config.max_running:
                break
            if request.kv == "kept":  # resumed where it stopped: it decodes from the next batch
                request.kv = "resident"
                self._admit(request)
                continue
            if request.kv == "swapped":
                assert kv is not None
                need = kv.blocks_needed(
                    request.request_id, request.num_tokens + self._tree_capacity(request)
                )
                while need > free:
                    released = self._evict_kept(request, batch, kv, ctx)
                    if not released:
                        break
                    free += released
                if need > free:
                    break
                free -= need
                request.kv = "resident"
                batch.swap_in.append(request)
                self._admit(request)
                continue  # it decodes from the next micro-batch on
            cached = self._expected_hit(request, kv)
            if cached is None:  # its next blocks are being computed: it reuses them next step
                continue
            self._attach_prefix(request, kv)
            chunk = min(room + cached, len(request.prefill_tokens) - request.num_prefilled)
            if kv is not None:
                need = kv.blocks_needed(request.request_id, chunk)
                # an admitted request's next chunk may preempt later admissions (else partial
                # prefills could hold every block and none could finish); a new one only moves
                # out the KV of kept requests the policy puts after it
                while need > free:
                    released = self._evict_kept(request, batch, kv, ctx)
                    if not released and not is_new:
                        released = self._preempt_after(request, batch, kv, ctx)
                    if not released:
                        break
                    free += released
                if need > free:
                    break
                free -= need
            request.kv = "resident"
            batch.prefill.append((request, chunk))
            self._expect_blocks(batch, request, chunk, cached)
            room -= chunk - cached
            count += 1
            if is_new:
                self._admit(request)

        for request in batch.members:
            request.in_flight = True
        if batch.is_empty and not (batch.swap_out or batch.drop or batch.swap_in or batch.failed):
            return None
        self._batches_in_flight += 1
        return batch

    def _attach_prefix(self, request: RequestState, kv: KVView | None) -> None:
        """Before a request's first chunk: what of it the executor's prefix cache holds counts
        as prefilled (budget and KV need only the rest). Not for requests whose feature-level
        drafts need the target's features of every position (those are not cached)."""
        if request.prefix_looked_up or request.num_prefilled or self.wants_features(request):
            return
        if request.params.prompt_logprobs is not None:  # needs every prompt position's logits
            return
        attach = getattr(kv, "attach_prefix", None)
        if attach is None:
            return
        request.prefix_looked_up = True
        hit = attach(request.request_id, request.prefill_tokens)
        request.num_prefilled = hit
        if not request.output:
            request.num_cached_prompt_tokens = hit

    def _expected_hit(self, request: RequestState, kv: KVView | None) -> int | None:
        """The tokens of a request's next chunk the verifier should find cached (by the prefix
        index; 0 where the KV view attaches prefixes itself, or the verifier looks nothing up);
        None when the block after them is in a chunk in flight, so that a prefix shared by
        requests arriving together is computed once."""
        index = self.prefix_index
        if index is None:
            return 0
        tokens, start = request.prefill_tokens, request.num_prefilled
        hit = 0
        looks_up = not self.wants_features(request) and request.params.prompt_logprobs is None
        if looks_up and getattr(kv, "attach_prefix", None) is None:
            hit = index.cached_tokens(tokens, start, len(tokens))
        return None if index.pending_at(tokens, start + hit) else hit

    def _expect_blocks(
        self, batch: MicroBatch, request: RequestState, chunk: int, cached: int
    ) -> None:
        if self.prefix_index is None:
            return
        start = request.num_prefilled
        if cached:
            batch.prefill_cached[request.request_id] = cached
        self.prefix_index.mark_pending(
            batch.id, request.prefill_tokens, start + cached, start + chunk
        )

    def _pick_decoding(
        self, decoding: list[RequestState], limit: int, num_micro_batches: int
    ) -> list[RequestState]:
        """Up to `limit` of the idle decoding requests (in the policy's order) for the next
        micro-batch; with the per-draft split, at most 1/M of each draft model's decoding
        requests (idle or in flight; a request counts under the model it drafted with last)."""
        if self.config.micro_batch_split == "policy" or num_micro_batches == 1:
            return decoding[:limit]
        counts = Counter(r.draft_model for r in self.running if not r.is_prefilling)
        taken: Counter[str | None] = Counter()
        picked: list[RequestState] = []
        for request in decoding:
            if len(picked) >= limit:
                break
            model = request.draft_model
            if taken[model] < math.ceil(counts[model] / num_micro_batches):
                taken[model] += 1
                picked.append(request)
        return picked

    def num_micro_batches(self, num_requests: int) -> int:
        """How many micro-batches to keep in flight for a running set of `num_requests`."""
        config = self.config
        if not config.auto_micro_batches or self.cost is None or config.method is None:
            return config.micro_batches
        nodes, depth = self._step_shape.typical(
            tree_capacity(config.method), config.method.num_layers
        )
        key = (num_requests, nodes, depth, id(self.cost))
        chosen = self._micro_batch_choice.get(key)
        if chosen is None:
            chosen = choose_micro_batches(
                self.cost,
                self._slowest_draft(),
                num_requests,
                nodes,
                depth,
                mean_context(self.running) or TYPICAL_CONTEXT,
                max_micro_batches=config.micro_batches,
                max_drop=config.micro_batch_drop,
                shared_device=is_shared_device(self.cost),
            )
            self._micro_batch_choice = {key: chosen}  # re-chosen when the set changes size
        return chosen

    def _admit(self, request: RequestState) -> None:
        if request in self.waiting:
            self.waiting.remove(request)
            self.running.append(request)

    def _preempt_after(
        self, keep: RequestState, batch: MicroBatch, kv: KVView, ctx: PolicyContext
    ) -> int:
        """Preempt the last idle request that the policy orders after `keep` (for FCFS: the
        most recent arrival); returns the blocks released, 0 when there is none."""
        for victim in reversed(self.policy.order(self.running, ctx)):
            if victim is keep:
                return 0  # only requests the policy puts after `keep` may be preempted for it
            in_batch = victim in batch.decode or any(victim is r for r, _ in batch.prefill)
            if not victim.in_flight and not in_batch and victim.kv == "resident":
                return self._preempt(victim, batch, kv)
        return 0

    def _preempt(
        self, victim: RequestState, batch: MicroBatch, kv: KVView | None, *, keep: bool = False
    ) -> int:
        """Move a running request back to the front of the queue. With `keep` (and its prompt
        prefilled) its KV, the verifier's and the drafter's, stays where it is; otherwise it is
        moved out (`_move_out`). Returns the target blocks released."""
        if victim in self.running:
            self.running.remove(victim)
        self.waiting.insert(0, victim)
        if keep and not victim.is_prefilling:
            victim.kv = "kept"
            self.preemptions["kept"] += 1
            return 0
        self._release_draft(victim)
        return self._move_out(victim, batch, kv)

    def _move_out(self, victim: RequestState, batch: MicroBatch, kv: KVView | None) -> int:
        """Free a preempted request's target KV: swap where the executor can (and the KV is
        whole), recompute otherwise; returns the target blocks released."""
        released = kv.blocks_held(victim.request_id) if kv is not None else 0
        if kv is not None and kv.can_swap and not victim.is_prefilling:
            victim.kv = "swapped"
            batch.swap_out.append(victim)
            self.preemptions["swapped"] += 1
        else:
            victim.drop_kv()
            batch.drop.append(victim)
            self._releases.append(Release(victim.request_id, True))
            self.preemptions["recomputed"] += 1
        return released

    def _resume_kept(self, ctx: PolicyContext) -> None:
        """Kept requests rejoin the running set in the policy's order while there is room,
        up to the first waiting request that must be prefilled or swapped in first."""
        for request in self.policy.order(self.waiting, ctx):
            if request.kv != "kept" or len(self.running) >= self.config.max_running:
                break
            request.kv = "resident"
            self._admit(request)

    def _evict_kept(
        self, keep: RequestState, batch: MicroBatch, kv: KVView, ctx: PolicyContext
    ) -> int:
        """Move out the KV of the kept request the policy orders last: for a running request,
        whichever that is (what runs must progress, or kept requests could hold every block
        while it waits); for a waiting one, only if it comes after `keep`. Returns the blocks
        released, 0 when there is none."""
        kept = [r for r in self.waiting if r.kv == "kept"]
        if not kept:
            return 0
        is_running = keep in self.running
        victim = self.policy.order(kept if is_running else [*kept, keep], ctx)[-1]
        if victim is keep:
            return 0
        self._release_draft(victim)
        return self._move_out(victim, batch, kv)

    def _drop_kept(self) -> None:
        """The verifier ran out of memory: every kept request's KV goes (recomputed later)."""
        for request in [r for r in self.waiting if r.kv == "kept"]:
            self._release_draft(request)
            request.drop_kv()
            self._releases.append(Release(request.request_id, True))
            self.preemptions["recomputed"] += 1

    def _tree_capacity(self, request: RequestState) -> int:
        """Nodes (root included) the request's tree may take this step."""
        method = self._method(request)
        if request.method is None:  # the selector may resize the configured method per step
            method = self.selector.method_bound(method)
        return tree_capacity_with(method, self.config)

    def tree_capacity_bound(self) -> int:
        """Most nodes (root included) any request's tree may have: what its KV must allow."""
        return tree_capacity_with(self.selector.method_bound(self.config.method), self.config)

    def _step_method(self, request: RequestState, num_requests: int) -> DraftMethod | None:
        """This step's drafting method: the request's own, else the selector's choice for a
        step of `num_requests` under the hardware budget."""
        method = self._method(request)
        if request.method is not None:
            return method
        budget = self.config.token_budget
        if self.cost is not None:
            budget = min(budget, self.cost.hardware_budget())
        return self.selector.draft_method(method, num_requests, budget)

    def _method(self, request: RequestState) -> DraftMethod | None:
        if not request.speculate or request.tokens_left <= 1:
            return None
        return request.method or self.config.method

    def max_depth(self, request: RequestState) -> int:
        room = self.config.max_context - request.num_tokens
        return max(0, min(request.tokens_left - 1, room))

    # ---- 2. speculation plan -------------------------------------------------------------------
    def _plan_drafts(self, batch: MicroBatch) -> None:
        queries: list[DepthQuery] = []
        placed: dict[str, tuple[str, str, DraftMethod]] = {}
        methods = {}
        for request in batch.decode:
            method = self._step_method(request, len(batch.decode))
            if method is not None and self.drafters and self.max_depth(request) >= 1:
                methods[request.request_id] = method
        live = sorted(self.drafters)
        drafting = [r for r in batch.decode if r.request_id in methods]
        choice = self.chooser.assign(drafting, live, self.cost) if drafting else {}
        for request in drafting:
            method = methods[request.request_id]
            if request.requested_draft in live:  # the client asked for this one
                model: str | None = request.requested_draft
            else:
                model = choice.get(request.request_id)
            if model is None:
                continue
            if model in self.config.model_free_drafts:
                method = self.config.model_free_method
            self._place(request, model)
            state = self._state(request, model)
            prior = self._model_estimate(model).rate()
            placed[request.request_id] = (model, request.drafter or "", method)
            queries.append(
                DepthQuery(
                    request.request_id,
                    model,
                    method,
                    min(self.max_depth(request), method.num_layers),
                    state.estimate.rate(prior),
                    self._drafter_backlog(request, model),
                    request.tokens_left,
                )
            )
        if not queries:
            return
        if self.config.planner == "goodput" and self.cost is not None and self.selector.plans_depth:
            step = {
                "prefill_tokens": 0,  # planned before prompt chunks (they do not weigh on it)
                "budget": self.config.token_budget,
                "context": mean_context(batch.decode),
                "num_requests": len(batch.decode),
            }
            depths = plan_depths(queries, self.cost, **step)
            due = [q for q in queries if self._probe_due(q.request_id, depths[q.request_id])]
            if due:  # probe only where a good draft would pay: a step of many requests may not
                hopeful = [replace(q, rate=max(q.rate, OPTIMISTIC_RATE)) for q in queries]
                would = plan_depths(hopeful, self.cost, **step)
                for q in due:
                    if would[q.request_id] > 0:
                        depths[q.request_id] = 1
                        batch.probes.add(q.request_id)
        else:
            depths = {q.request_id: q.max_depth for q in queries}
        for q in queries:
            depth = depths[q.request_id]
            if depth < 1:
                continue
            request = self.requests[q.request_id]
            model, replica, method = placed[q.request_id]
            base = request.num_seen_by_drafter
            tokens = request.all_tokens
            if base >= len(tokens):  # nothing new to root a tree at: start that drafter over
                base = 0
            features = None
            if model in self.config.feature_drafts:
                planned = self._plan_features(request, base)
                if planned is None:  # never computed: this step verifies the root alone
                    continue
                base, features = planned
            nodes = sum(method.tokens_at_depth(d) for d in range(1, depth + 1))
            batch.drafts[q.request_id] = DraftPlan(
                model,
                replica,
                method,
                base,
                tuple(tokens[base:]),
                depth,
                min(nodes, method.max_draft_tokens),
                features,
            )
        config = self.config
        if config.fast_switching or config.merge_drafts != "off" or self.scores_model_free:
            for rid in batch.drafts:
                self._plan_standby(self.requests[rid], batch)

    @property
    def scores_model_free(self) -> bool:
        """Whether every request drafting with a model also gets a model-free draft's tree, to
        merge (`merge_drafts = model-free`) or to score (a chooser that reads counterfactuals)."""
        reads = getattr(self.chooser, "counterfactual", False)
        config = self.config
        return bool(config.model_free_drafts) and (config.merge_drafts == "model-free" or reads)

    def _drafter_backlog(self, request: RequestState, model: str) -> int:
        """Committed tokens the drafter must still forward: those it has not seen, less, for a
        drafter new to the request, the prompt prefix the target found cached (a token-level
        draft's prefix cache names the same blocks for the same requests: most likely it holds
        them too; a feature-level draft's target computed every position, so no count)."""
        unseen = request.num_tokens - request.num_seen_by_drafter
        if request.num_seen_by_drafter == 0 and model not in self.config.feature_drafts:
            unseen -= request.num_cached_prompt_tokens
        return unseen

    def _place(self, request: RequestState, model: str) -> None:
        """Draft the request on a replica of `model` (its current one while it lives; a warm
        standby replica of `model` when it switches to it)."""
        replicas = self.drafters[model]
        if model != request.draft_model:
            standby = request.standby
            if standby is not None and not (
                standby.model == model and standby.replica in replicas and standby.num_seen > 0
            ):
                standby = None  # not a standby of this model that holds anything
            if request.draft_model is not None:  # a switch: what the new drafter must catch up
                kind = "warm" if standby is not None else "cold"
                self.switches[kind] += 1
                self.switches[f"{kind}_tokens"] += request.num_tokens - (
                    standby.num_seen if standby is not None else 0
                )
            if standby is not None:
                self._release_current(request)
                request.standby = None
                replica = self.matcher.place(request.request_id, standby.replica, replicas)
                request.draft_model, request.drafter = model, replica
                request.num_seen_by_drafter = standby.num_seen
                return
            self._release_draft(request)
        replica = self.matcher.place(request.request_id, request.drafter, replicas)
        if replica != request.drafter:
            if request.drafter is not None and request.draft_model == model:
                self._releases.append(Release(request.request_id, False, (model, request.drafter)))
            request.num_seen_by_drafter = 0  # a new replica starts from the first token
        request.draft_model, request.drafter = model, replica

    def _merges(self, request: RequestState) -> bool:
        """Whether the request's standby drafts a tree to merge this step (`merge_drafts`)."""
        match self.config.merge_drafts:
            case "standby":
                return True
            case "at-risk":
                return request.tpot_slo_ms is not None and request.is_on_track is False
        return False

    def _plan_standby(self, request: RequestState, batch: MicroBatch) -> None:
        """Fast switching (Spin §IV-C): keep a replica of the model the chooser expects the
        request to move to next in step with its committed tokens (`batch.warm`). With merged
        trees, that replica drafts a tree of its own for the request instead (`batch.merge`)."""
        if self.scores_model_free and request.draft_model not in self.config.model_free_drafts:
            self._plan_model_free_partner(request, batch)
            return
        merges = self._merges(request)
        if not (merges or self.config.fast_switching):
            if self.config.merge_drafts != "at-risk":
                self._release_standby(request)
            # at-risk: a request back on track keeps its standby, which catches up with what it
            # missed when the request falls behind again instead of prefilling the whole context
            return
        target = self.chooser.next_model(request, sorted(self.drafters))
        if target is None and merges:  # no switch foreseen: merge with the cheapest other draft
            target = self._cheapest_other(request)
        if (
            target is None
            or target == request.draft_model
            or target not in self.drafters
            or target in self.config.feature_drafts  # it needs the target's features to warm
        ):
            self._release_standby(request)
            return
        standby = request.standby
        if standby is not None and (
            standby.model != target or standby.replica not in self.drafters[target]
        ):
            self._release_standby(request)
            standby = None
        if standby is None:
            load = self.matcher.load()
            replica = min(self.drafters[target], key=lambda r: (load.get(r, 0), r))
            standby = request.standby = Standby(target, replica)
        tokens = request.all_tokens
        if standby.num_seen >= len(tokens):
            return  # in step already
        own = batch.drafts[request.request_id]
        if merges:
            batch.merge[request.request_id] = replace(
                own,
                model=target,
                replica=standby.replica,
                base_len=standby.num_seen,
                new_tokens=tuple(tokens[standby.num_seen :]),
                stream=1,
            )
            return
        batch.warm[request.request_id] = DraftPlan(
            target,
            standby.replica,
            WARM_METHOD,
            standby.num_seen,
            tuple(tokens[standby.num_seen :]),
            max_depth=1,
            max_nodes=1,
        )

    def _plan_model_free_partner(self, request: RequestState, batch: MicroBatch) -> None:
        """The first live model-free draft drafts beside the request's model (`batch.merge`),
        from a standby kept in step like fast switching's, as deep as its own method allows."""
        live = [m for m in self.config.model_free_drafts if m in self.drafters]
        if not live:
            self._release_standby(request)
            return
        target = live[0]
        standby = request.standby
        if standby is not None and (
            standby.model != target or standby.replica not in self.drafters[target]
        ):
            self._release_standby(request)
            standby = None
        if standby is None:
            load = self.matcher.load()
            replica = min(self.drafters[target], key=lambda r: (load.get(r, 0), r))
            standby = request.standby = Standby(target, replica)
        tokens = request.all_tokens
        if standby.num_seen >= len(tokens):
            return
        method = self.config.model_free_method
        batch.merge[request.request_id] = DraftPlan(
            target,
            standby.replica,
            method,
            standby.num_seen,
            tuple(tokens[standby.num_seen :]),
            max_depth=min(method.num_layers, self.max_depth(request)),
            max_nodes=method.max_draft_tokens,
            stream=1,
        )

    def _cheapest_other(self, request: RequestState) -> str | None:
        """The live draft model other than the request's current one that costs least per
        drafted token (by name without a cost model); None if there is none."""
        others = [
            m
            for m in sorted(self.drafters)
            if m != request.draft_model and m not in self.config.feature_drafts
        ]
        cost = self.cost
        if cost is not None and all(cost.has_draft(m) for m in others):
            return min(others, key=cost.draft_cost_per_token_ms, default=None)
        return min(others, default=None)

    def note_warmed(self, request_id: str, plan: DraftPlan, ok: bool) -> None:
        """A standby drafter answered a warm-up (`MicroBatch.warm`): ok, it holds the plan's
        tokens; not ok (or no answer), its state is unknown and the next warm-up starts over."""
        request = self.requests.get(request_id)
        standby = request.standby if request is not None else None
        if standby is not None and (standby.model, standby.replica) == (plan.model, plan.replica):
            standby.num_seen = plan.base_len + len(plan.new_tokens) if ok else 0

    def _release_standby(self, request: RequestState) -> None:
        standby = request.standby
        if standby is not None:
            self._releases.append(
                Release(request.request_id, False, (standby.model, standby.replica))
            )
            request.standby = None

    def _release_draft(self, request: RequestState) -> None:
        """Leave the request's drafters, current and standby (their state is to be freed)."""
        self._release_current(request)
        self._release_standby(request)

    def _release_current(self, request: RequestState) -> None:
        """Leave the request's current drafter (its state there is to be freed)."""
        if request.draft_model is not None and request.drafter is not None:
            self._releases.append(
                Release(request.request_id, False, (request.draft_model, request.drafter))
            )
        self.matcher.release(request.request_id)
        request.draft_model = request.drafter = None
        request.num_seen_by_drafter = 0

    def _state(self, request: RequestState, model: str) -> SpeculationState:
        per_model = self._speculation.setdefault(request.request_id, {})
        state = per_model.get(model)
        if state is None:
            state = per_model[model] = SpeculationState(AcceptanceEstimate())
        return state

    def _model_estimate(self, model: str) -> AcceptanceEstimate:
        return self._model_estimates.setdefault(model, AcceptanceEstimate())

    def _probe_due(self, request_id: str, depth: int) -> bool:
        """Whether a request planned at `depth` is due a one-level probe: after planned depth 0
        for an interval of steps that doubles with every probe (reset when it drafts again)."""
        request = self.requests[request_id]
        assert request.draft_model is not None
        state = self._state(request, request.draft_model)
        if depth > 0:
            state.idle_steps = 0
            state.probe_interval = FIRST_PROBE_INTERVAL
            return False
        state.idle_steps += 1
        if state.idle_steps < state.probe_interval:
            return False
        state.idle_steps = 0
        state.probe_interval = min(2 * state.probe_interval, MAX_PROBE_INTERVAL)
        return True

    # ---- 3. tree selection ---------------------------------------------------------------------
    def note_drafted(self, request_id: str, ok: bool) -> None:
        """The executor's drafter answered for this request (ok: it now holds every committed
        token), or did not (its draft state is unknown: start it over next time)."""
        request = self.requests.get(request_id)
        if request is not None:
            request.num_seen_by_drafter = request.num_tokens if ok else 0

    def select_trees(
        self,
        batch: MicroBatch,
        drafted: Mapping[str, TokenTree],
        now: float,
        partners: Mapping[str, TokenTree] | None = None,
    ) -> dict[str, TokenTree]:
        """Each decoding request's tree to verify (root only where nothing was drafted).
        `partners`: the trees `batch.merge`'s drafters answered, merged with the request's own
        (SpecInfer's merge: the union of their paths) before selection."""
        trees = {r.request_id: drafted.get(r.request_id) or root_only(r) for r in batch.decode}
        for rid, partner in (partners or {}).items():
            if rid in trees and partner.root_token == trees[rid].root_token:
                plan = batch.merge.get(rid)
                if plan is not None and plan.model in self.config.model_free_drafts:
                    batch.model_free_trees[rid] = partner
                    if self.config.merge_drafts != "model-free":
                        continue  # only scored, after verification
                    partner = self._recalibrated(self.requests[rid], partner, plan.model)
                batch.own_trees[rid] = trees[rid]
                trees[rid] = merge_trees([trees[rid], partner])
                self.num_merged_trees += 1
        calibration = {}
        for r in batch.decode:
            if r.draft_model is not None:
                calibration[r.request_id] = self._state(r, r.draft_model).calibration
        ctx = SelectionContext(
            requests={r.request_id: r for r in batch.decode},
            budget=self.config.token_budget - batch.prefill_tokens,
            prefill_tokens=batch.prefill_tokens,
            max_depth={r.request_id: self.max_depth(r) for r in batch.decode},
            calibration=calibration,
            cost=self.cost,
            context=mean_context(batch.decode),
            num_requests=len(batch.decode) + len(batch.prefill),
            now=now,
        )
        batch.trees = self.selector.select(trees, ctx) if trees else {}
        # room left in the verifier's forward: a probe may not push it past the budget B
        room = ctx.budget - sum(t.num_nodes for t in batch.trees.values())
        for rid in sorted(batch.probes):  # a probe is verified, or it would teach nothing
            drafted_tree = trees[rid]
            if room > 0 and batch.trees[rid].num_nodes == 1 and drafted_tree.num_nodes > 1:
                room -= 1
                kids = drafted_tree.children()[0]
                # sampled siblings go in draw order: choosing by token would bias sampling
                sampled = drafted_tree.proposal_of[kids[0]] != DETERMINISTIC
                best = kids[0] if sampled else max(kids, key=lambda n: drafted_tree.logq[n])
                batch.trees[rid] = drafted_tree.subtree([0, best])
        return batch.trees

    def _recalibrated(self, request: RequestState, tree: TokenTree, model: str) -> TokenTree:
        """A merge partner's tree with its path probabilities scaled by its own calibration over
        the request's model's, which the selector applies to the whole merged tree: each part
        is then priced by how its own draft has fared. Only deterministic nodes' logq change,
        which verification does not read."""
        own = self._state(request, request.draft_model).calibration if request.draft_model else 1.0
        ratio = self._state(request, model).calibration / own
        if ratio == 1.0 or (tree.proposal_of != DETERMINISTIC).any():
            return tree
        logq = tree.logq.copy()
        logq[1:][tree.parents[1:] == 0] += math.log(ratio)
        return TokenTree(tree.tokens, tree.parents, logq, tree.proposal_of, tree.proposals)

    # ---- 4. observe ----------------------------------------------------------------------------
    def observe(
        self, batch: MicroBatch, results: Mapping[str, StepResult], now: float
    ) -> list[StepOutput]:
        """Commit a verified micro-batch: tokens, stops, statistics, feedback to the policies."""
        chunks = {r.request_id: n for r, n in batch.prefill}
        elapsed_ms = 1000 * (now - batch.started)
        if self.prefix_index is not None:
            self.prefix_index.clear_pending(batch.id)
        shares = self._cost_shares(batch)
        outputs: list[StepOutput] = []
        self._end_batch(batch)
        for request in batch.members:
            request.in_flight = False
            rid = request.request_id
            if request.cancelled:
                outputs.append(self._finished_output(request, "abort"))
                continue
            result = results.get(rid)
            if result is None or result.step != request.step:
                result = StepResult(rid, request.step, error="out_of_sync")
            if result.error is not None:
                output = self._failed(request, result.error)
                if output is not None:
                    outputs.append(output)
                continue
            request.step += 1
            request.attained_service_ms += elapsed_ms
            if result.features is not None and self.config.feature_drafts:
                first = request.num_prefilled if rid in chunks else request.num_tokens - 1
                log = self._features.setdefault(rid, FeatureLog(self.config.feature_size))
                log.put(first, result.features)
            drafted = 0
            if rid in chunks:
                if not request.output and result.prompt_logprobs is not None:
                    before = request.prompt_logprobs if request.num_prefilled else EMPTY
                    request.prompt_logprobs = (before or EMPTY) + result.prompt_logprobs
                request.num_prefilled += chunks[rid]
                if not request.output:  # a verifier that found the chunk's start cached
                    request.num_cached_prompt_tokens += result.cached_tokens
                if self.prefix_index is not None:  # the verifier named the chunk's blocks
                    self.prefix_index.insert(request.prefill_tokens, request.num_prefilled)
            else:
                tree = batch.trees.get(rid)
                drafted = tree.num_nodes - 1 if tree is not None else 0
                depth = 0
                if drafted:
                    depth = int(tree.depths().max())
                    learned, accepted = tree, result.num_accepted
                    if rid in batch.own_trees:  # merged: the current draft's part of it
                        learned, accepted = own_part(
                            tree, batch.own_trees[rid], result.tokens[: result.num_accepted]
                        )
                    if learned.num_nodes > 1:
                        self._learn(
                            request,
                            learned,
                            int(learned.depths().max()),
                            accepted,
                            elapsed_ms,
                            shares.get(rid),
                        )
                partner = batch.model_free_trees.get(rid)
                if partner is not None:
                    self._note_model_free(batch, request, partner, tree, result, elapsed_ms)
                request.record_step(drafted, result.num_accepted, request.draft_model, depth)
                self.stats.record(drafted, result.num_accepted, depth)
                self._step_shape.observe(1 + drafted, depth)
            new = append_tokens(request, result.tokens, self.config.eos_token_ids)
            logprobs = None
            if result.logprobs is not None:  # the appended tokens are a prefix of the result's
                logprobs = result.logprobs.head(len(new))
                request.logprobs = (request.logprobs or EMPTY) + logprobs
            if rid in self._counterfactuals:
                self._settle_counterfactuals(request)
            if new:
                request.first_token_time = request.first_token_time or now
                request.last_token_time = now
            if new or request.is_finished:
                outputs.append(
                    StepOutput(
                        rid,
                        result.step,
                        len(request.output) - len(new),
                        new,
                        request.finish_reason,
                        drafted,
                        result.num_accepted if drafted else 0,
                        request.draft_model if drafted else None,
                        logprobs=logprobs,
                        prompt_logprobs=(
                            request.prompt_logprobs
                            if new and len(request.output) == len(new)
                            else None
                        ),
                    )
                )
            if request.is_finished:
                self._finish(request, request.finish_reason or "stop")
        return outputs

    def _note_model_free(
        self,
        batch: MicroBatch,
        request: RequestState,
        partner: TokenTree,
        verified: TokenTree | None,
        result: StepResult,
        step_ms: float,
    ) -> None:
        """A model-free partner's tree: learn from its verified part where it was merged, and
        wait for the tokens that settle its counterfactual acceptance."""
        model = batch.merge[request.request_id].model
        if verified is not None and request.request_id in batch.own_trees:
            part, accepted = own_part(verified, partner, result.tokens[: result.num_accepted])
            if part.num_nodes > 1:
                self._learn_state(request, model, part, int(part.depths().max()), accepted)
        node_ms = None
        if self.cost is not None:
            nodes = sum(self._verified_nodes(batch, r.request_id) for r in batch.decode)
            nodes += batch.prefill_tokens
            node_ms = self.cost.verify_ms(nodes, mean_context(batch.members), len(batch.members))
            node_ms /= nodes
        self._counterfactuals.setdefault(request.request_id, []).append(
            PendingCounterfactual(
                model,
                partner,
                request.num_tokens,
                step_ms,
                node_ms,
            )
        )

    def _settle_counterfactuals(self, request: RequestState) -> None:
        """Report each pending model-free tree whose acceptance the committed tokens settle (all
        of them once the request is finished) to the chooser, as an outcome not run."""
        tokens = request.all_tokens
        waiting = []
        for pending in self._counterfactuals.pop(request.request_id):
            accepted, final = counterfactual_accepted(pending.tree, tokens[pending.start :])
            if not (final or request.is_finished):
                waiting.append(pending)
                continue
            drafted = pending.tree.num_nodes - 1
            self.counterfactual_stats.setdefault(pending.model, AcceptanceStats()).record(
                drafted, accepted
            )
            # what verifying it would have cost: the root, the accepted path and the node
            # where it stopped (the selector keeps about that much of a calibrated tree)
            share = None if pending.node_ms is None else pending.node_ms * (2 + accepted)
            self.chooser.observe(
                DraftOutcome(
                    request.request_id, pending.model, drafted, accepted, pending.step_ms, share,
                    counterfactual=True,
                )
            )  # fmt: skip
        if waiting:
            self._counterfactuals[request.request_id] = waiting

    def abandon(self, batch: MicroBatch) -> None:
        """The executor could not finish this micro-batch: its requests are free to be scheduled
        again as they are (nothing was committed). After `observe` this does nothing: by then
        its requests may already be in flight in another micro-batch."""
        if not batch.is_observed:
            self._end_batch(batch)
            if self.prefix_index is not None:
                self.prefix_index.clear_pending(batch.id)
            for request in batch.members:
                request.in_flight = False

    def _slowest_draft(self) -> str | None:
        """The live draft model whose forward costs most: a step's drafting waits for it."""
        assert self.cost is not None
        priced = [m for m in self.drafters if self.cost.has_draft(m)]
        return max(priced, key=self.cost.draft_cost_per_token_ms, default=None)

    def _end_batch(self, batch: MicroBatch) -> None:
        if not batch.is_observed:
            batch.is_observed = True
            self._batches_in_flight = max(0, self._batches_in_flight - 1)

    def _learn(
        self,
        request: RequestState,
        tree: TokenTree,
        depth: int,
        num_accepted: int,
        elapsed_ms: float,
        share_ms: float | None = None,
    ) -> None:
        assert request.draft_model is not None
        self._learn_state(request, request.draft_model, tree, depth, num_accepted)
        self.chooser.observe(
            DraftOutcome(
                request.request_id, request.draft_model, tree.num_nodes - 1, num_accepted,
                elapsed_ms, share_ms,
            )
        )  # fmt: skip

    def _learn_state(
        self, request: RequestState, model: str, tree: TokenTree, depth: int, num_accepted: int
    ) -> None:
        """The planner's acceptance estimate and the selector's calibration of `model`."""
        state = self._state(request, model)
        state.estimate.observe(num_accepted, depth)
        self._model_estimate(model).observe(num_accepted, depth)
        predicted = float(sum(math.exp(x) for x in tree.path_logprob()[1:]))
        if predicted > 0:
            ratio = min(max(num_accepted / predicted, CALIBRATION_CLIP[0]), CALIBRATION_CLIP[1])
            state.calibration = DECAY * state.calibration + (1 - DECAY) * ratio

    def _cost_shares(self, batch: MicroBatch) -> dict[str, float]:
        """Each decoding request's share of the step's modeled time: of the verifier's forward
        by the nodes it verified, and of its draft model's drafting by the nodes that model
        drafted for it. What one request's choice of draft costs, where the step's wall time is
        the same for every request in it."""
        if self.cost is None or not batch.decode or not self.chooser.learns:
            return {}
        nodes = {r.request_id: self._verified_nodes(batch, r.request_id) for r in batch.decode}
        total = sum(nodes.values()) + batch.prefill_tokens
        context = mean_context(batch.members)
        verify_ms = self.cost.verify_ms(total, context, len(batch.members))
        shares = {rid: verify_ms * n / total for rid, n in nodes.items()}
        by_model: dict[str, list[RequestState]] = {}
        for r in batch.decode:
            if r.draft_model is not None and nodes[r.request_id] > 1:
                by_model.setdefault(r.draft_model, []).append(r)
        for model, requests in by_model.items():
            if not self.cost.has_draft(model):
                continue
            layers: Counter[int] = Counter()
            for r in requests:
                for depth in batch.trees[r.request_id].depths()[1:].tolist():
                    layers[int(depth)] += 1
            draft_ms = self.cost.draft_tree_ms(
                model, len(requests), [layers[d] for d in sorted(layers)], context, len(requests)
            )
            drafted = sum(layers.values())
            for r in requests:
                shares[r.request_id] += draft_ms * (nodes[r.request_id] - 1) / drafted
        return shares

    @staticmethod
    def _verified_nodes(batch: MicroBatch, request_id: str) -> int:
        tree = batch.trees.get(request_id)
        return tree.num_nodes if tree is not None else 1

    def _failed(self, request: RequestState, error: str) -> StepOutput | None:
        """Out of KV or out of sync: recompute later. Anything else fails the request."""
        kind = error.split(":")[0]
        if kind == GRAMMAR_DEAD_END:  # the output so far is kept; nothing may follow it
            return self._finished_output(request, "abort", error, GRAMMAR_DEAD_END)
        if kind == "out_of_kv_memory" and self.running == [request]:
            message = "the request needs more KV memory than the verifier has, even alone"
            return self._finished_output(request, "abort", message, "context_length_exceeded")
        if kind in ("out_of_kv_memory", "out_of_sync", "verify_timeout"):
            if kind == "out_of_kv_memory":
                self._kv_full = True
                self._drop_kept()
                self.preemptions["recomputed"] += 1
            request.drop_kv()
            self._releases.append(Release(request.request_id, True))
            if request in self.running:
                self.running.remove(request)
            self.waiting.insert(0, request)
            return None
        return self._finished_output(
            request, "abort", f"verification failed: {kind}", "internal_error"
        )

    def _finished_output(
        self,
        request: RequestState,
        reason: FinishReason,
        error: str | None = None,
        error_type: str | None = None,
    ) -> StepOutput:
        self._finish(request, reason, error)
        return StepOutput(
            request.request_id,
            request.step,
            len(request.output),
            [],
            reason,
            error=error,
            error_type=error_type,
        )

    def _finish(
        self, request: RequestState, reason: FinishReason, error: str | None = None
    ) -> None:
        """Drop the request from the pool; its target and draft state are to be released."""
        request.finish_reason = reason
        request.error = error
        rid = request.request_id
        self.requests.pop(rid, None)
        if request in self.running:
            self.running.remove(request)
        if request in self.waiting:
            self.waiting.remove(request)
        self._kv_full = False
        if self.prefix_index is not None and error is None and not request.is_prefilling:
            # the verifier keeps its committed tokens' blocks (all but the last one emitted)
            self.prefix_index.insert(request.all_tokens, request.num_tokens - 1)
        self._releases.append(Release(rid, True))
        self._release_draft(request)
        self.chooser.forget(rid)
        self.policy.forget(rid)
        self._speculation.pop(rid, None)
        self._features.pop(rid, None)
        self._counterfactuals.pop(rid, None)
