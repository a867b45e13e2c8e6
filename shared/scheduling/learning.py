"""Learning from outcomes: after a verified step, each decoding request's acceptance feeds the
planner's estimates, the selector's calibration and the draft chooser (a bandit, with each
request's share of the step's modeled cost), and a model-free tree proposed beside it is scored
by the tokens the target then commits (its counterfactual acceptance)."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping

from shared.scheduling.core_types import (
    MicroBatch,
    OtherLoad,
    PendingCounterfactual,
    StepResult,
    mean_context,
    own_part,
)
from shared.scheduling.draft_choice import DraftOutcome
from shared.scheduling.pool import RequestPool
from shared.scheduling.request import AcceptanceStats, RequestState
from shared.scheduling.speculation import CALIBRATION_CLIP, DECAY, RECENT_ESTIMATE_DECAY
from shared.values.tree import (
    STOP_LEAF,
    STOP_REJECTED,
    TokenTree,
    counterfactual_accepted,
    levels_accepted,
)


def depth_trial(
    drafted: TokenTree | None,
    verified: TokenTree,
    accepted: int,
    result: StepResult,
    asked_depth: int | None = None,
) -> tuple[int, int]:
    """(levels accepted, levels tried) for the planner's per-depth estimate. From the tree as
    drafted where it is known: the target's bonus token says whether the level below the
    accepted path would have been accepted too, had the selector kept it (exact for greedy
    verification; for sampled, the bonus is drawn from the target's distribution, which matches
    a drafted token no more often than verification would accept it). From the verified tree
    alone, a step whose every verified level was accepted counts no failure, and the selector
    cuts exactly where the draft is unsure: the estimate would run high and the planner draft
    deeper than pays. Where the accepted path ends at a leaf above `asked_depth` (the depth
    the planner asked for), the level below counts as a failure: the planner paid for it and
    it delivered nothing (censored there, a draft whose trees stop short reads as one that
    accepts deep, and is chosen over one that does)."""
    if drafted is None:
        return accepted, int(verified.depths().max())
    levels, stop = levels_accepted(drafted, result.tokens)
    if levels < accepted:  # the verified tree is not a subtree of the drafted one (a merge)
        return accepted, int(verified.depths().max())
    short = stop == STOP_LEAF and asked_depth is not None and levels < asked_depth
    return levels, levels + 1 if stop == STOP_REJECTED or short else levels


class Learner:
    def __init__(self, pool: RequestPool) -> None:
        self.pool = pool
        self.stats = AcceptanceStats()  # every verified decode step, as vLLM counts them
        # per model-free draft: its counterfactual acceptance on the steps it was not run
        self.counterfactual_stats: dict[str, AcceptanceStats] = {}
        self._load: tuple[int, int, int] | None = None  # (batch id, nodes, context): _step_load

    def learn_step(
        self,
        batch: MicroBatch,
        request: RequestState,
        result: StepResult,
        elapsed_ms: float,
        shares: Mapping[str, float],
    ) -> int:
        """Learn from a decoding request's verified step; returns the draft tokens verified."""
        rid = request.request_id
        tree = batch.trees.get(rid)
        drafted = tree.num_nodes - 1 if tree is not None else 0
        depth = 0
        if drafted:
            assert tree is not None and request.draft_model is not None
            depth = int(tree.depths().max())
            learned, accepted = tree, result.num_accepted
            if rid in batch.own_trees:  # merged: the current draft's part of it
                learned, accepted = own_part(
                    tree, batch.own_trees[rid], result.tokens[: result.num_accepted]
                )
            if learned.num_nodes > 1:
                plan = batch.drafts.get(rid)
                asked = plan.max_depth if plan is not None else None
                trial = depth_trial(batch.drafted_trees.get(rid), learned, accepted, result, asked)
                self._learn_state(request, request.draft_model, learned, trial, accepted)
            # the chooser judges what choosing the draft delivered: where a model-free draft's
            # tree was merged into it, the whole merged tree's acceptance (what the model-free
            # draft alone would give, the chooser learns from its counterfactuals)
            if rid in batch.own_trees and rid in batch.model_free_trees:
                learned, accepted = tree, result.num_accepted
            if learned.num_nodes > 1:
                self._observe(request, learned.num_nodes - 1, accepted, elapsed_ms, shares)
        elif request.draft_model in self.pool.config.model_free_drafts:
            # a model-free draft that found nothing to propose missed (the chooser hears of it)
            self._observe(request, 0, 0, elapsed_ms, shares)
        partner = batch.model_free_trees.get(rid)
        if partner is not None:
            self._note_model_free(batch, request, partner, tree, result, elapsed_ms)
        request.record_step(drafted, result.num_accepted, request.draft_model, depth)
        self.stats.record(drafted, result.num_accepted, depth)
        self.pool.step_shape.observe(1 + drafted, depth)
        return drafted

    def _observe(
        self,
        request: RequestState,
        nodes: int,
        accepted: int,
        elapsed_ms: float,
        shares: Mapping[str, float],
    ) -> None:
        assert request.draft_model is not None
        rid = request.request_id
        outcome = DraftOutcome(
            rid, request.draft_model, nodes, accepted, elapsed_ms, shares.get(rid)
        )
        self.pool.chooser.observe(outcome)

    def _learn_state(
        self,
        request: RequestState,
        model: str,
        tree: TokenTree,
        trial: tuple[int, int],
        num_accepted: int,
    ) -> None:
        """The planner's per-depth estimate of `model` from `trial` (levels accepted, levels
        tried), and the selector's calibration from the verified `tree`'s `num_accepted`."""
        state = self.pool.state(request, model)
        state.estimate.observe(*trial)
        self.pool.model_estimate(model).observe(*trial)
        predicted = float(sum(math.exp(x) for x in tree.path_logprob()[1:]))
        if predicted > 0:
            ratio = min(max(num_accepted / predicted, CALIBRATION_CLIP[0]), CALIBRATION_CLIP[1])
            state.calibration = DECAY * state.calibration + (1 - DECAY) * ratio

    # ---- model-free drafts' counterfactuals ----------------------------------------------------
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
        trial = None
        if partner.num_nodes == 1:  # nothing to copy here: the model beside it should draft
            trial = (0, 1)
        elif verified is not None and request.request_id in batch.own_trees:
            part, accepted = own_part(verified, partner, result.tokens[: result.num_accepted])
            if part.num_nodes > 1:
                trial = depth_trial(partner, part, accepted, result)
                self._learn_state(request, model, part, trial, accepted)
        if trial is not None:  # how far it is copying right now, as the planner reads it
            state = self.pool.state(request, model)
            if self.pool.config.model_beside_copy == "runs":
                self.pool.copy_estimate(model, state.runs.running).observe(*trial)
                state.runs.observe(*trial)
            else:
                state.recent.observe(*trial, decay=RECENT_ESTIMATE_DECAY)
        others = None
        if self.pool.cost is not None:
            nodes, context = self._step_load(batch)
            others = OtherLoad(
                nodes - verified_nodes(batch, request.request_id), context, len(batch.members)
            )
        self.pool.counterfactuals.setdefault(request.request_id, []).append(
            PendingCounterfactual(model, partner, request.num_tokens, step_ms, others)
        )

    def settle_counterfactuals(self, request: RequestState) -> None:
        """Report each pending model-free tree whose acceptance the committed tokens settle (all
        of them once the request is finished) to the chooser, as an outcome not run."""
        if request.request_id not in self.pool.counterfactuals:
            return
        tokens = request.all_tokens
        waiting = []
        for pending in self.pool.counterfactuals.pop(request.request_id):
            accepted, final = counterfactual_accepted(pending.tree, tokens[pending.start :])
            if not (final or request.is_finished):
                waiting.append(pending)
                continue
            drafted = pending.tree.num_nodes - 1
            self.counterfactual_stats.setdefault(pending.model, AcceptanceStats()).record(
                drafted, accepted
            )
            self.pool.chooser.observe(
                DraftOutcome(
                    request.request_id, pending.model, drafted, accepted, pending.step_ms,
                    self._counterfactual_share(pending, accepted),
                    counterfactual=True,
                )
            )  # fmt: skip
        if waiting:
            self.pool.counterfactuals[request.request_id] = waiting

    def _counterfactual_share(self, pending: PendingCounterfactual, accepted: int) -> float | None:
        """What the request's share of its step would have been had it verified the model-free
        tree instead of its own: the root, the accepted path and the node where it stopped (the
        selector keeps about that much of a calibrated tree) beside the other requests' nodes,
        priced as `cost_shares` prices a run step. Alone in its step a request pays the whole
        forward, which on a memory-bound target costs about as much for 2 nodes as for 16."""
        if pending.others is None or self.pool.cost is None:
            return None
        others = pending.others
        nodes = 2 + accepted
        total = others.nodes + nodes
        return self.pool.cost.verify_ms(total, others.context, others.members) * nodes / total

    def _step_load(self, batch: MicroBatch) -> tuple[int, int]:
        """The batch's verified nodes and prompt tokens, and its typical context: once per batch
        (every request with a model-free partner reads them)."""
        if self._load is None or self._load[0] != batch.id:
            nodes = sum(verified_nodes(batch, r.request_id) for r in batch.decode)
            self._load = (batch.id, nodes + batch.prefill_tokens, mean_context(batch.members))
        return self._load[1], self._load[2]

    # ---- cost shares ---------------------------------------------------------------------------
    def cost_shares(self, batch: MicroBatch) -> dict[str, float]:
        """Each decoding request's share of the step's modeled time: of the verifier's forward
        by the nodes it verified, and of its draft model's drafting by the nodes that model
        drafted for it. What one request's choice of draft costs, where the step's wall time is
        the same for every request in it."""
        cost = self.pool.cost
        if cost is None or not batch.decode or not self.pool.chooser.learns:
            return {}
        nodes = {r.request_id: verified_nodes(batch, r.request_id) for r in batch.decode}
        total = sum(nodes.values()) + batch.prefill_tokens
        context = mean_context(batch.members)
        verify_ms = cost.verify_ms(total, context, len(batch.members))
        shares = {rid: verify_ms * n / total for rid, n in nodes.items()}
        by_model: dict[str, list[RequestState]] = {}
        for r in batch.decode:
            if r.draft_model is not None and nodes[r.request_id] > 1:
                by_model.setdefault(r.draft_model, []).append(r)
        for model, requests in by_model.items():
            if not cost.has_draft(model):
                continue
            layers: Counter[int] = Counter()
            for r in requests:
                for depth in batch.trees[r.request_id].depths()[1:].tolist():
                    layers[int(depth)] += 1
            draft_ms = cost.draft_tree_ms(
                model, len(requests), [layers[d] for d in sorted(layers)], context, len(requests)
            )
            drafted = sum(layers.values())
            for r in requests:
                shares[r.request_id] += draft_ms * (nodes[r.request_id] - 1) / drafted
        return shares


def verified_nodes(batch: MicroBatch, request_id: str) -> int:
    tree = batch.trees.get(request_id)
    return tree.num_nodes if tree is not None else 1
