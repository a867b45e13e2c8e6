"""Standby drafts and merged trees: a second drafter per request, kept in step with its committed
tokens so that a switch to it costs no prefill (Spin's fast switching, `MicroBatch.warm`), or
drafting a tree of its own that is merged with the request's (SpecInfer's merge-based trees,
`MicroBatch.merge`), a model-free draft's included (merged, or only scored afterwards)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import replace

from shared.scheduling.core_types import WARM_METHOD, DraftPlan, MicroBatch
from shared.scheduling.pool import RequestPool
from shared.scheduling.request import RequestState, Standby
from shared.values.tree import DETERMINISTIC, TokenTree, merge_trees


class StandbyPlanner:
    def __init__(self, pool: RequestPool) -> None:
        self.pool = pool
        self.num_merged_trees = 0  # trees verified as the union of two drafters' (merge_drafts)

    def plan(self, batch: MicroBatch) -> None:
        """Each drafting request's standby job this step, if any (`batch.warm`, `batch.merge`)."""
        config = self.pool.config
        if config.fast_switching or config.merge_drafts != "off" or self.pool.scores_model_free:
            for rid in batch.drafts:
                self._plan_standby(self.pool.requests[rid], batch)
        # a model-free partner drafts whether the model does or not: inside a copy the planner
        # leaves the model out (`DepthQuery.level_gains`) and the partner's tree is the step's
        for rid in sorted(batch.partner_only):
            self._plan_model_free_partner(self.pool.requests[rid], batch)

    def merges(self, request: RequestState) -> bool:
        """Whether the request's standby drafts a tree to merge this step (`merge_drafts`)."""
        match self.pool.config.merge_drafts:
            case "standby":
                return True
            case "at-risk":
                return request.tpot_slo_ms is not None and request.is_on_track is False
        return False

    def _plan_standby(self, request: RequestState, batch: MicroBatch) -> None:
        """Fast switching (Spin §IV-C): keep a replica of the model the chooser expects the
        request to move to next in step with its committed tokens (`batch.warm`). With merged
        trees, that replica drafts a tree of its own for the request instead (`batch.merge`)."""
        pool = self.pool
        if pool.scores_model_free and request.draft_model not in pool.config.model_free_drafts:
            self._plan_model_free_partner(request, batch)
            return
        merges = self.merges(request)
        if not (merges or pool.config.fast_switching):
            if pool.config.merge_drafts != "at-risk":
                pool.release_standby(request)
            # at-risk: a request back on track keeps its standby, which catches up with what it
            # missed when the request falls behind again instead of prefilling the whole context
            return
        target = pool.chooser.next_model(request, sorted(pool.drafters))
        if target is None and merges:  # no switch foreseen: merge with the cheapest other draft
            target = self._cheapest_other(request)
        if (
            target is None
            or target == request.draft_model
            or target not in pool.drafters
            or target in pool.config.feature_drafts  # it needs the target's features to warm
        ):
            pool.release_standby(request)
            return
        standby = self._standby_on(request, target)
        tokens = request.all_tokens
        if standby.num_seen >= len(tokens):
            return  # in step already
        new_tokens = tuple(tokens[standby.num_seen :])
        if merges:
            own = batch.drafts[request.request_id]
            batch.merge[request.request_id] = replace(
                own,
                model=target,
                replica=standby.replica,
                base_len=standby.num_seen,
                new_tokens=new_tokens,
                stream=1,
            )
            return
        batch.warm[request.request_id] = DraftPlan(
            target,
            standby.replica,
            WARM_METHOD,
            standby.num_seen,
            new_tokens,
            max_depth=1,
            max_nodes=1,
        )

    def _plan_model_free_partner(self, request: RequestState, batch: MicroBatch) -> None:
        """The first live model-free draft drafts beside the request's model (`batch.merge`),
        from a standby kept in step like fast switching's, as deep as its own method allows."""
        pool = self.pool
        model = pool.first_live_model_free()
        depth = pool.model_free_depth(request)
        if model is None or depth < 1:
            pool.release_standby(request)
            return
        standby = self._standby_on(request, model)
        tokens = request.all_tokens
        if standby.num_seen >= len(tokens):
            return
        method = pool.config.model_free_method
        batch.merge[request.request_id] = DraftPlan(
            standby.model,
            standby.replica,
            method,
            standby.num_seen,
            tuple(tokens[standby.num_seen :]),
            max_depth=depth,
            max_nodes=method.max_draft_tokens,
            stream=1,
        )

    def _standby_on(self, request: RequestState, target: str) -> Standby:
        """The request's standby on a live replica of `target`: the one it has, else a new one
        on the least loaded replica (a standby elsewhere is released)."""
        pool = self.pool
        standby = request.standby
        if standby is not None and (
            standby.model != target or standby.replica not in pool.drafters[target]
        ):
            pool.release_standby(request)
            standby = None
        if standby is None:
            load = pool.matcher.load()
            replica = min(pool.drafters[target], key=lambda r: (load.get(r, 0), r))
            standby = request.standby = Standby(target, replica)
        return standby

    def _cheapest_other(self, request: RequestState) -> str | None:
        """The live draft model other than the request's current one that costs least per
        drafted token (by name without a cost model); None if there is none."""
        pool = self.pool
        others = [
            m
            for m in sorted(pool.drafters)
            if m != request.draft_model and m not in pool.config.feature_drafts
        ]
        cost = pool.cost
        if cost is not None and all(cost.has_draft(m) for m in others):
            return min(others, key=cost.draft_cost_per_token_ms, default=None)
        return min(others, default=None)

    def note_warmed(self, request_id: str, plan: DraftPlan, ok: bool) -> None:
        """A standby drafter answered a warm-up (`MicroBatch.warm`): ok, it holds the plan's
        tokens; not ok (or no answer), its state is unknown and the next warm-up starts over."""
        request = self.pool.requests.get(request_id)
        standby = request.standby if request is not None else None
        if standby is not None and (standby.model, standby.replica) == (plan.model, plan.replica):
            standby.num_seen = plan.base_len + len(plan.new_tokens) if ok else 0

    # ---- merging -------------------------------------------------------------------------------
    def merge_partners(
        self, batch: MicroBatch, trees: dict[str, TokenTree], partners: Mapping[str, TokenTree]
    ) -> None:
        """Merge each request's tree in `trees` with the tree its `batch.merge` drafter answered
        (SpecInfer's merge: the union of their paths); a model-free partner is kept in
        `batch.model_free_trees`, and only scored after verification unless it merges."""
        config = self.pool.config
        for rid, partner in partners.items():
            if rid in trees and partner.root_token == trees[rid].root_token:
                plan = batch.merge.get(rid)
                if plan is not None and plan.model in config.model_free_drafts:
                    batch.model_free_trees[rid] = partner
                    if config.merge_drafts != "model-free":
                        continue  # only scored, after verification
                    partner = self._recalibrated(self.pool.requests[rid], partner, plan.model)
                batch.own_trees[rid] = trees[rid]
                trees[rid] = merge_trees([trees[rid], partner])
                self.num_merged_trees += 1

    def _recalibrated(self, request: RequestState, tree: TokenTree, model: str) -> TokenTree:
        """A merge partner's tree with its path probabilities scaled by its own calibration over
        the request's model's, which the selector applies to the whole merged tree: each part
        is then priced by how its own draft has fared. Only deterministic nodes' logq change,
        which verification does not read."""
        pool = self.pool
        own = pool.state(request, request.draft_model).calibration if request.draft_model else 1.0
        ratio = pool.state(request, model).calibration / own
        if ratio == 1.0 or (tree.proposal_of != DETERMINISTIC).any():
            return tree
        logq = tree.logq.copy()
        logq[1:][tree.parents[1:] == 0] += math.log(ratio)
        return TokenTree(tree.tokens, tree.parents, logq, tree.proposal_of, tree.proposals)
