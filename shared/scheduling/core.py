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

The core is a facade over parts that share one request pool (`pool.py`): admission with KV and
preemption (`admission.py`), the speculation planner and its probes (`planning.py`), standby
drafts and merged trees (`standby.py`), committing a verified step (`commit.py`) and learning
from it (`learning.py`); its data types live in `core_types.py` and are importable from here.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Mapping, Sequence

from shared.scheduling.admission import Admission
from shared.scheduling.commit import Committer
from shared.scheduling.core_types import (
    WARM_METHOD,
    CoreConfig,
    DraftPlan,
    KVView,
    MergePolicy,
    MicroBatch,
    MicroBatchSplit,
    ModelBesideCopy,
    PendingCounterfactual,
    PrefixKVView,
    Release,
    SpeculationPlanner,
    StepOutput,
    StepResult,
    draft_request,
    mean_context,
    own_part,
    request_history,
    root_only,
    token_paths,
    tree_capacity_with,
)
from shared.scheduling.cost_calibration import DraftTiming, note_step_costs
from shared.scheduling.cost_model import CostModel
from shared.scheduling.draft_choice import DraftChooser, FixedDraftModel
from shared.scheduling.features import FeatureLog
from shared.scheduling.learning import Learner
from shared.scheduling.ordering import FCFS, SchedulingPolicy
from shared.scheduling.planning import DraftPlanner, keep_probes
from shared.scheduling.pool import RequestPool
from shared.scheduling.prefix_index import PrefixIndex
from shared.scheduling.replicas import LeastLoadedSticky, ReplicaMatcher
from shared.scheduling.request import AcceptanceStats, RequestState
from shared.scheduling.standby import StandbyPlanner
from shared.scheduling.tree_selection import Goodput, SelectionContext, TreeSelector
from shared.values.tree import TokenTree

__all__ = [
    "WARM_METHOD",
    "CoreConfig",
    "DraftPlan",
    "DraftTiming",
    "KVView",
    "MergePolicy",
    "ModelBesideCopy",
    "MicroBatch",
    "MicroBatchSplit",
    "PendingCounterfactual",
    "PrefixKVView",
    "Release",
    "SchedulerCore",
    "SpeculationPlanner",
    "StepOutput",
    "StepResult",
    "draft_request",
    "mean_context",
    "own_part",
    "request_history",
    "root_only",
    "token_paths",
    "tree_capacity_with",
]


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
        self.pool = RequestPool(
            config,
            policy or FCFS(),
            chooser or FixedDraftModel(),
            matcher or LeastLoadedSticky(),
            selector or Goodput(),
            cost,
            prefix_index,
        )
        self.admission = Admission(self.pool)
        self.planner = DraftPlanner(self.pool)
        self.standby = StandbyPlanner(self.pool)
        self.learner = Learner(self.pool)
        self.committer = Committer(self.pool, self.learner)
        self._batches_in_flight = 0  # returned by next_batch, not yet observed or abandoned
        self._batch_ids = itertools.count(first_batch_id)

    # ---- the pool and the policies, as executors and reports read them ------------------------
    @property
    def config(self) -> CoreConfig:
        return self.pool.config

    @property
    def requests(self) -> dict[str, RequestState]:
        return self.pool.requests

    @property
    def running(self) -> list[RequestState]:
        return self.pool.running

    @property
    def waiting(self) -> list[RequestState]:
        return self.pool.waiting

    @property
    def drafters(self) -> dict[str, list[str]]:
        return self.pool.drafters

    @property
    def prefix_index(self) -> PrefixIndex | None:
        return self.pool.prefix_index

    @property
    def policy(self) -> SchedulingPolicy:
        return self.pool.policy

    @policy.setter
    def policy(self, policy: SchedulingPolicy) -> None:
        self.pool.policy = policy

    @property
    def chooser(self) -> DraftChooser:
        return self.pool.chooser

    @chooser.setter
    def chooser(self, chooser: DraftChooser) -> None:
        self.pool.chooser = chooser

    @property
    def matcher(self) -> ReplicaMatcher:
        return self.pool.matcher

    @property
    def selector(self) -> TreeSelector:
        return self.pool.selector

    @property
    def cost(self) -> CostModel | None:
        return self.pool.cost

    @cost.setter
    def cost(self, cost: CostModel | None) -> None:  # the executor measured its profile later
        self.pool.cost = cost

    @property
    def stats(self) -> AcceptanceStats:
        """Every verified decode step, as vLLM counts them."""
        return self.learner.stats

    @stats.setter
    def stats(self, stats: AcceptanceStats) -> None:
        self.learner.stats = stats

    @property
    def counterfactual_stats(self) -> dict[str, AcceptanceStats]:
        """Per model-free draft: its counterfactual acceptance on the steps it was not run."""
        return self.learner.counterfactual_stats

    @property
    def preemptions(self) -> Counter[str]:
        """By kind: kept, swapped, recomputed."""
        return self.pool.preemptions

    @property
    def switches(self) -> Counter[str]:
        """Draft-model switches: "warm" (to a standby in step) and "cold", and "<kind>_tokens",
        the committed tokens the new drafter still had to append at them."""
        return self.planner.switches

    @property
    def num_merged_trees(self) -> int:
        """Trees verified as the union of two drafters' (`merge_drafts`)."""
        return self.standby.num_merged_trees

    @property
    def scores_model_free(self) -> bool:
        return self.pool.scores_model_free

    @property
    def features(self) -> dict[str, FeatureLog]:
        """Feature-level drafts: the target's features kept per request."""
        return self.pool.features

    # ---- the pool ------------------------------------------------------------------------------
    def check(self, prompt: Sequence[int], max_tokens: int) -> None:
        """Refuse what no schedule can serve (raises `InvalidRequestError` subclasses)."""
        self.pool.check(prompt, max_tokens)

    def add(self, request: RequestState) -> None:
        self.pool.add(request)

    def cancel(self, request_id: str) -> bool:
        """Abort a request now, or when its micro-batch comes back; False if unknown."""
        request = self.pool.requests.get(request_id)
        if request is None:
            return False
        request.cancelled = True
        if not request.in_flight:
            self.pool.finish(request, "abort")
        return True

    def has_unfinished(self) -> bool:
        return bool(self.pool.requests)

    def set_drafters(self, replicas: Mapping[str, Sequence[str]]) -> None:
        """The live draft models and their replicas (the executor's view of its drafters)."""
        self.pool.drafters = {model: list(names) for model, names in replicas.items() if names}

    def wants_features(self, request: RequestState) -> bool:
        """Whether the verifier should return the target's features for this request."""
        return self.pool.wants_features(request)

    def take_releases(self) -> list[Release]:
        releases, self.pool.releases = self.pool.releases, []
        return releases

    def max_depth(self, request: RequestState) -> int:
        return self.pool.max_depth(request)

    def tree_capacity_bound(self) -> int:
        """Most nodes (root included) any request's tree may have: what its KV must allow."""
        return tree_capacity_with(self.selector.method_bound(self.config.method), self.config)

    def num_micro_batches(self, num_requests: int) -> int:
        """How many micro-batches to keep in flight for a running set of `num_requests`."""
        return self.admission.num_micro_batches(num_requests)

    # ---- 1. schedule ---------------------------------------------------------------------------
    def next_batch(self, now: float, kv: KVView | None = None) -> MicroBatch | None:
        """The next micro-batch from requests not in flight, or None when there is nothing (or
        as many micro-batches as the core pipelines are in flight)."""
        num_micro_batches = self.num_micro_batches(len(self.running) + len(self.waiting))
        # with a fixed M the executor runs M lanes; with auto it runs the most and M gates them
        if self.config.auto_micro_batches and self._batches_in_flight >= num_micro_batches:
            return None
        batch = MicroBatch(next(self._batch_ids), now)
        intake = self.admission.start(batch, now, kv, num_micro_batches)
        self.admission.take_decoding(batch, intake)
        # speculation is planned before prompt chunks take the rest of the budget
        self.planner.plan(batch)
        self.standby.plan(batch)
        self.admission.take_prompts(batch, intake)
        for request in batch.members:
            request.in_flight = True
        if batch.is_empty and not (batch.swap_out or batch.drop or batch.swap_in or batch.failed):
            return None
        self._batches_in_flight += 1
        return batch

    # ---- 2. standby drafters -------------------------------------------------------------------
    def note_warmed(self, request_id: str, plan: DraftPlan, ok: bool) -> None:
        """A standby drafter answered a warm-up (`MicroBatch.warm`): ok, it holds the plan's
        tokens; not ok (or no answer), its state is unknown and the next warm-up starts over."""
        self.standby.note_warmed(request_id, plan, ok)

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
        batch.drafted_trees = {rid: t for rid, t in trees.items() if t.num_nodes > 1}
        self.standby.merge_partners(batch, trees, partners or {})
        calibration = {}
        for r in batch.decode:
            if r.draft_model is not None:
                calibration[r.request_id] = self.pool.state(r, r.draft_model).calibration
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
        room = ctx.budget - sum(t.num_nodes for t in batch.trees.values())
        keep_probes(batch, trees, room)
        return batch.trees

    # ---- 4. observe ----------------------------------------------------------------------------
    def observe(
        self, batch: MicroBatch, results: Mapping[str, StepResult], now: float
    ) -> list[StepOutput]:
        """Commit a verified micro-batch: tokens, stops, statistics, feedback to the policies."""
        if self.prefix_index is not None:
            self.prefix_index.clear_pending(batch.id)
        shares = self.learner.cost_shares(batch)
        self._end_batch(batch)
        return self.committer.commit(batch, results, now, shares)

    @property
    def calibrating(self) -> bool:
        """Whether `note_costs` reads anything: executors measure their calls only then."""
        return self.cost is not None and self.config.calibrate_costs

    def note_costs(
        self, batch: MicroBatch, drafting: Sequence[DraftTiming], verify_ms: float | None
    ) -> None:
        """What the micro-batch's drafter calls and verification (`verify_ms`; None: not
        measured) took: calibrates the cost model (`cost_calibration`), where configured."""
        if self.calibrating:
            assert self.cost is not None
            note_step_costs(self.cost, batch, drafting, verify_ms)

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

    def _end_batch(self, batch: MicroBatch) -> None:
        if not batch.is_observed:
            batch.is_observed = True
            self._batches_in_flight = max(0, self._batches_in_flight - 1)
