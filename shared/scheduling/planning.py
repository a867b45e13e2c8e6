"""The speculation planner: each decoding request's draft model, replica and depth this step
(the goodput planner sizes it from the cost model, zero included), the one-level probes that
re-estimate acceptance after depth 0, and the probes' place in the selected trees."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import replace

import numpy as np

from shared.scheduling.core_types import DraftPlan, MicroBatch, Release, mean_context
from shared.scheduling.pool import RequestPool
from shared.scheduling.request import RequestState, Standby
from shared.scheduling.speculation import (
    FIRST_PROBE_INTERVAL,
    MAX_PROBE_INTERVAL,
    OPTIMISTIC_RATE,
    DepthQuery,
    plan_depths,
    planned_goodput,
)
from shared.values.methods import DraftMethod
from shared.values.tree import DETERMINISTIC, TokenTree

# request id -> (draft model, replica, method) it was placed on this step
Placements = dict[str, tuple[str, str, DraftMethod]]


class DraftPlanner:
    def __init__(self, pool: RequestPool) -> None:
        self.pool = pool
        # draft-model switches: "warm" (to a standby in step, fast switching) and "cold", and
        # "<kind>_tokens", the committed tokens the new drafter still had to append at them
        self.switches: Counter[str] = Counter()

    def plan(self, batch: MicroBatch) -> None:
        """Fill `batch.drafts` (and `batch.probes`) for its decoding requests."""
        queries, placed = self._queries(batch)
        if not queries:
            return
        depths = self._depths(batch, queries)
        for q in queries:
            plan = None
            if depths[q.request_id] >= 1:
                plan = self._draft_plan(q, depths[q.request_id], placed[q.request_id])
            if plan is not None:
                batch.drafts[q.request_id] = plan
            elif q.partner_depth >= 1:
                batch.partner_only.add(q.request_id)

    def _queries(self, batch: MicroBatch) -> tuple[list[DepthQuery], Placements]:
        """Choose and place each decoding request's draft model; what the depth planner asks."""
        pool = self.pool
        methods = {}
        for request in batch.decode:
            method = pool.step_method(request, len(batch.decode))
            if method is not None and pool.drafters and pool.max_depth(request) >= 1:
                methods[request.request_id] = method
        live = sorted(pool.drafters)
        drafting = [r for r in batch.decode if r.request_id in methods]
        choice = pool.chooser.assign(drafting, live, pool.cost) if drafting else {}
        if pool.chooser.planned and pool.cost is not None:
            step = step_shape(batch, pool.config.token_budget)
            for request in drafting:
                choice[request.request_id] = self._planned_model(
                    step, request, methods[request.request_id], live
                )
        queries: list[DepthQuery] = []
        placed: Placements = {}
        for request in drafting:
            method = methods[request.request_id]
            if request.requested_draft in live:  # the client asked for this one
                model: str | None = request.requested_draft
            else:
                model = choice.get(request.request_id)
            if model is None:
                continue
            if model in pool.config.model_free_drafts:
                method = pool.config.model_free_method
            self.place(request, model)
            placed[request.request_id] = (model, request.drafter or "", method)
            queries.append(self._query(request, model, method, self.drafter_backlog(request)))
        return queries, placed

    def _query(
        self,
        request: RequestState,
        model: str,
        method: DraftMethod,
        backlog: int,
        prior: float | None = None,
    ) -> DepthQuery:
        """What the depth planner asks of the request drafting with `model` (`prior`: the
        model's acceptance before anything is observed, where not the planner's default)."""
        pool = self.pool
        population = pool.model_estimate(model)
        state = pool.state(request, model)
        query = DepthQuery(
            request.request_id,
            model,
            method,
            min(pool.max_depth(request), method.num_layers),
            state.estimate.rate(population.rate() if prior is None else population.rate(prior)),
            backlog,
            request.tokens_left,
        )
        return self._with_partner(query, request, model)

    def _planned_model(
        self, step: dict[str, int], request: RequestState, method: DraftMethod, live: list[str]
    ) -> str:
        """The draft (`PlannedChoice`) whose plan for the request alone in this step's shape
        promises the most committed tokens per millisecond, counting what it would have to
        catch up. A model-free draft is a candidate only where none merges beside the models
        (there, a model planned at depth 0 leaves the step to it). Each draft is taken at what
        it achieved shrunk toward `OPTIMISTIC_RATE` (`PRIOR_WEIGHT` pseudo-observations): one
        never observed at that rate, so each is tried; one whose first steps missed is tried
        again before its record rules it out (a single miss locked a draft out for good).
        The current draft's score counts `switch_margin` more: leaving it costs the next one
        a catch-up forward, and near ties would otherwise flip from step to step."""
        pool = self.pool
        assert pool.cost is not None
        free = pool.config.model_free_drafts
        merges = pool.config.merge_drafts == "model-free" and pool.first_live_model_free()
        candidates = [m for m in live if not (merges and m in free)] or live
        scores = {}
        for model in candidates:
            own = pool.config.model_free_method if model in free else method
            backlog = self._backlog_on(request, model)
            query = self._query(request, model, own, backlog, OPTIMISTIC_RATE)
            scores[model] = planned_goodput([query], pool.cost, **step)
        current = request.draft_model
        if current in scores:
            scores[current] *= 1.0 + pool.config.switch_margin
        return max(candidates, key=lambda m: (scores[m], m == current, m))

    def _backlog_on(self, request: RequestState, model: str) -> int:
        """`drafter_backlog` of a drafter of `model`: its current one, a standby or a parked
        one, else one new to the request."""
        if model == request.draft_model:
            return self.drafter_backlog(request)
        keeping = (request.standby, request.parked.get(model))
        held = max((s.num_seen for s in keeping if s is not None and s.model == model), default=0)
        return self.drafter_backlog(request, held)

    def _with_partner(
        self, query: DepthQuery, request: RequestState, model: str | None = None
    ) -> DepthQuery:
        """The query with its model-free partner's expected acceptance, where one merges
        beside the request's model draft (`model`, where not its current one; `merge_drafts`
        "model-free"; `StandbyPlanner`): in its last few steps or, with `model_beside_copy`
        "runs", after steps that ended as its last one did (`CopyRuns`)."""
        pool = self.pool
        partner = pool.model_free_partner(request, model)
        if partner is None:
            return query
        state = pool.state(request, partner)
        depth = pool.model_free_depth(request)
        if pool.config.model_beside_copy != "runs":
            rate = state.recent.rate(pool.model_estimate(partner).rate(), weight=1.0)
            return replace(query, partner_rate=rate, partner_depth=depth)
        prior = pool.copy_estimate(partner, state.runs.running)
        first, deeper = state.runs.current().rates(prior)
        return replace(query, partner_rate=deeper, partner_depth=depth, partner_first=first)

    def _depths(self, batch: MicroBatch, queries: list[DepthQuery]) -> dict[str, int]:
        """Each query's depth: the goodput planner's (a probe of one level where one is due and
        a good draft would pay), else the full depth."""
        pool = self.pool
        if pool.config.planner != "goodput" or pool.cost is None or not pool.selector.plans_depth:
            return {q.request_id: q.max_depth for q in queries}
        step = step_shape(batch, pool.config.token_budget)
        depths = plan_depths(queries, pool.cost, **step)
        due = [q for q in queries if self._probe_due(q.request_id, depths[q.request_id])]
        if due:  # probe only where a good draft would pay: a step of many requests may not
            hopeful = [replace(q, rate=max(q.rate, OPTIMISTIC_RATE)) for q in queries]
            would = plan_depths(hopeful, pool.cost, **step)
            for q in due:
                if would[q.request_id] > 0:
                    depths[q.request_id] = 1
                    batch.probes.add(q.request_id)
        return depths

    def _draft_plan(
        self, q: DepthQuery, depth: int, placed: tuple[str, str, DraftMethod]
    ) -> DraftPlan | None:
        """The drafter's job for a request planned at `depth` (None: a feature-level draft whose
        features were never computed, so this step verifies the root alone)."""
        request = self.pool.requests[q.request_id]
        model, replica, method = placed
        base = request.num_seen_by_drafter
        tokens = request.all_tokens
        if base >= len(tokens):  # nothing new to root a tree at: start that drafter over
            base = 0
        features = None
        if model in self.pool.config.feature_drafts:
            planned = self._plan_features(request, base)
            if planned is None:
                return None
            base, features = planned
        nodes = sum(method.tokens_at_depth(d) for d in range(1, depth + 1))
        return DraftPlan(
            model,
            replica,
            method,
            base,
            tuple(tokens[base:]),
            depth,
            min(nodes, method.max_draft_tokens),
            features,
        )

    def _plan_features(self, request: RequestState, base: int) -> tuple[int, np.ndarray] | None:
        """(base, features) for a feature-level draft of the request: the features before each
        token it appends, from `base` or, if those are not held, from 0; None if neither is."""
        log = self.pool.features.get(request.request_id)
        end = request.num_tokens - 1  # the root's feature is not computed yet
        for start in (base, 0):
            lo = max(start, 1) - 1
            if log is not None and log.covers(lo, end):
                return start, log.take(lo, end)
        return None

    def drafter_backlog(self, request: RequestState, held: int | None = None) -> int:
        """Committed tokens the drafter must still forward: those it has not seen (`held`: what
        it holds, where not the request's current drafter), less, for a drafter new to the
        request, the prompt prefix the target found cached (a draft's prefix cache names the
        same blocks for the same requests: most likely it holds them too)."""
        held = request.num_seen_by_drafter if held is None else held
        unseen = request.num_tokens - held
        if held == 0:
            unseen -= request.num_cached_prompt_tokens
        return unseen

    def place(self, request: RequestState, model: str) -> None:
        """Draft the request on a replica of `model` (its current one while it lives; a warm
        standby or a parked replica of `model` when it switches to it)."""
        pool = self.pool
        replicas = pool.drafters[model]
        if model != request.draft_model:
            resumed = self._resumable(request, model)
            if request.draft_model is not None:  # a switch: what the new drafter must catch up
                kind = "warm" if resumed is not None else "cold"
                self.switches[kind] += 1
                self.switches[f"{kind}_tokens"] += request.num_tokens - (
                    resumed.num_seen if resumed is not None else 0
                )
            pool.leave_current(request)
            if resumed is not None:
                replica = pool.matcher.place(request.request_id, resumed.replica, replicas)
                request.draft_model, request.drafter = model, replica
                if replica == resumed.replica:
                    request.num_seen_by_drafter = resumed.num_seen
                else:  # placed elsewhere after all: that replica starts from the first token
                    release = Release(request.request_id, False, (model, resumed.replica))
                    pool.releases.append(release)
                return
            pool.release_standby(request)
        replica = pool.matcher.place(request.request_id, request.drafter, replicas)
        if replica != request.drafter:
            if request.drafter is not None and request.draft_model == model:
                pool.releases.append(Release(request.request_id, False, (model, request.drafter)))
            request.num_seen_by_drafter = 0  # a new replica starts from the first token
        request.draft_model, request.drafter = model, replica

    def _resumable(self, request: RequestState, model: str) -> Standby | None:
        """A replica of `model` that holds some of the request's committed tokens: its standby
        (fast switching) or a drafter it switched away from (parked); taken from there."""
        standby = request.standby
        if (
            standby is not None
            and standby.model == model
            and standby.replica in self.pool.drafters[model]
            and standby.num_seen > 0
        ):
            request.standby = None
            return standby
        return self.pool.take_parked(request, model)

    def _probe_due(self, request_id: str, depth: int) -> bool:
        """Whether a request planned at `depth` is due a one-level probe: after planned depth 0
        for an interval of steps that doubles with every probe (reset when it drafts again)."""
        request = self.pool.requests[request_id]
        assert request.draft_model is not None
        state = self.pool.state(request, request.draft_model)
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


def step_shape(batch: MicroBatch, budget: int) -> dict[str, int]:
    """The step the depth planner prices (`plan_depths`' keywords): planned before prompt
    chunks, which do not weigh on it."""
    return {
        "prefill_tokens": 0,
        "budget": budget,
        "context": mean_context(batch.decode),
        "num_requests": len(batch.decode),
    }


def keep_probes(batch: MicroBatch, drafted: Mapping[str, TokenTree], room: int) -> None:
    """A probe is verified, or it would teach nothing: where the selector kept only a probed
    request's root, its drafted tree's best first node goes in, while the verifier's forward
    has `room` for it (a probe may not push it past the budget B)."""
    for rid in sorted(batch.probes):
        drafted_tree = drafted[rid]
        if room > 0 and batch.trees[rid].num_nodes == 1 and drafted_tree.num_nodes > 1:
            room -= 1
            kids = drafted_tree.children()[0]
            # sampled siblings go in draw order: choosing by token would bias sampling
            sampled = drafted_tree.proposal_of[kids[0]] != DETERMINISTIC
            best = kids[0] if sampled else max(kids, key=lambda n: drafted_tree.logq[n])
            batch.trees[rid] = drafted_tree.subtree([0, best])
