"""SLO-customized tree selection: AdaServe's (§4.3, Alg. 2) and the CMU thesis's Alg. 2, with the
baselines both compare against.

Every selector sees each request's candidate tree (what its drafter proposed) and keeps a subtree
per request, roots always kept, all nodes together within the step's budget B. A node's value is
its path probability f(v): the product of the draft's probabilities from the root, scaled by the
request's observed calibration (accepted / predicted, the same correction the goodput selector
uses), so that sum_v f(v) over a tree, root included, is the tokens the step is expected to
commit for that request (AdaServe's Theorem 3.1).

A request with a TPOT objective t_TPOT needs, for its TPOT to stay within it after this step,

    A(r) = (l + t_spec) / t_TPOT - o

tokens committed now, where l is the time since its first token, o the tokens it has emitted
since then and t_spec what is left of this step: selection runs once the trees are drafted (the
clock it is given is after drafting, which l therefore includes), so t_spec is the verification
of a full budget, from the cost model.

- `adaserve`: candidates by a beam of depth d and width w sized by the load (Eq. 8-9), w nodes
  at every layer whatever their path probability (the paper's beam: no `min_path_prob`); then
  SLO-customized selection (requests in order of urgency, each grows by its best nodes until
  sum f reaches min(A(r), d + 1), at most n_max nodes each); then throughput-optimized selection
  (the best remaining nodes of all requests until B is spent, or, with `slo.throughput_phase =
  goodput`, only as many as raise expected committed tokens per millisecond of verification).
- `thesis-slo`: candidates by the thesis's dynamic tree (Alg. 1); then one node at a time to the
  request with the highest importance: the next node's f, plus 1 while the request's sum f is
  short of its target A(r) + lambda (the slack).
- `equal-greedy`: B split evenly; each request takes its best nodes within its share.
- `static`: SpecInfer's fixed expansion <1,1,3,1,1,1,1,1>, verified whole (no budget).
- `incremental`: no speculation at all.

The budget of the budget-aware selectors is the hardware budget of the verifier's cost profile
(`CostModel.hardware_budget`), within `engine.max_tokens_per_step`.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np

from shared.scheduling.cost_model import CostModel
from shared.scheduling.request import RequestState
from shared.scheduling.speculation import node_scores, verify_shares
from shared.scheduling.tree_selection import SelectionContext, SelectorDrafting
from shared.settings import SloSettings
from shared.values.methods import DraftMethod
from shared.values.tree import TokenTree

# SpecInfer's default expansion in AdaServe's evaluation (§6.1)
SPECINFER_EXPANSION = (1, 1, 3, 1, 1, 1, 1, 1)


# ---- the quantities of the papers ------------------------------------------------------------
def acceptance_target(request: RequestState, now: float, step_ms: float | None) -> float | None:
    """A(r): tokens this step must commit for the request's TPOT to meet its objective once the
    step ends (None: no objective, or no first token yet). Without a step estimate (no cost
    model) a step is taken to last one objective."""
    slo = request.tpot_slo_ms
    if slo is None or request.first_token_time is None or not request.output:
        return None
    if step_ms is None:
        step_ms = slo
    elapsed_ms = 1000.0 * (now - request.first_token_time)
    emitted = len(request.output) - 1  # tokens after the first: what TPOT divides by
    return (elapsed_ms + step_ms) / slo - emitted


def beam_shape(budget: int, num_requests: int, max_depth: int, max_width: int) -> tuple[int, int]:
    """AdaServe's Eq. 8-9: the candidate beam's depth d and width w for n requests under B."""
    n = max(1, num_requests)
    depth = max(1, min(max_depth, math.ceil(budget / n)))
    width = max(1, min(max_width, budget // n))
    return depth, width


def step_budget(
    ctx_budget: int, prefill_tokens: int, num_trees: int, cost: CostModel | None
) -> int:
    """Nodes the trees may use: the hardware budget less prompt chunks, within the step's
    budget, and never below one root per request."""
    budget = ctx_budget
    if cost is not None:
        budget = min(budget, cost.hardware_budget() - prefill_tokens)
    return max(num_trees, budget)


def estimated_step_ms(
    cost: CostModel | None, budget: int, prefill_tokens: int, context: int, num_trees: int
) -> float | None:
    """t_spec: what is left of the step once its trees are drafted, verifying a full budget,
    from the cost model (None without one). Drafting is not in it: the selectors' clock is read
    after drafting, so the time since the first token already holds it."""
    if cost is None:
        return None
    return cost.verify_ms(budget + prefill_tokens, context, num_trees or None)


# ---- path probabilities and growth -----------------------------------------------------------
@dataclass
class _Growing:
    """One request's subtree being selected: kept nodes and the frontier of candidates (nodes
    whose parent is kept), best first."""

    tree: TokenTree
    probs: dict[int, float]  # node -> calibrated f(v), nodes within the depth limit
    depths: dict[int, int]  # node -> its depth, the same nodes
    children: list[list[int]]
    kept: list[int]
    expected: float  # sum of f over kept nodes, root's 1 included
    frontier: list[tuple[float, int, int]]  # (-f, depth, node)

    @classmethod
    def start(cls, tree: TokenTree, max_depth: int, calibration: float) -> _Growing:
        scores = node_scores(tree, max_depth)
        probs = {node: min(1.0, calibration * math.exp(score)) for score, _, node in scores}
        depths = {node: depth for _, depth, node in scores}
        grown = cls(tree, probs, depths, tree.children(), [0], 1.0, [])
        grown._open(0)
        return grown

    def _open(self, node: int) -> None:
        for child in self.children[node]:
            if child in self.probs:
                heapq.heappush(self.frontier, (-self.probs[child], self.depths[child], child))

    @property
    def best(self) -> float | None:
        return -self.frontier[0][0] if self.frontier else None

    def take(self) -> None:
        _, _, node = heapq.heappop(self.frontier)
        self.kept.append(node)
        self.expected += self.probs[node]
        self._open(node)

    def remaining(self) -> list[float]:
        """f of the candidate nodes not kept."""
        kept = set(self.kept)
        return [p for node, p in self.probs.items() if node not in kept]

    @property
    def depth(self) -> int:
        """The candidate tree's depth within the limit: the most tokens it can commit, less 1."""
        return max(self.depths.values(), default=0)


def _grow_all(
    trees: Mapping[str, TokenTree],
    max_depth: Mapping[str, int],
    calibration: Mapping[str, float],
) -> dict[str, _Growing]:
    return {
        rid: _Growing.start(tree, max_depth.get(rid, 1 << 30), calibration.get(rid, 1.0))
        for rid, tree in trees.items()
    }


def _subtrees(grown: Mapping[str, _Growing]) -> dict[str, TokenTree]:
    return {
        rid: g.tree if len(g.kept) == g.tree.num_nodes else g.tree.subtree(g.kept)
        for rid, g in grown.items()
    }


def take_globally(grown: Iterable[tuple[str, _Growing]], count: int) -> int:
    """Throughput-optimized selection: the best frontier node across all requests, `count`
    times (fewer when the candidates run out); returns how many were taken."""
    by_rid = dict(grown)
    heap = [(-g.best, rid) for rid, g in by_rid.items() if g.best is not None]
    heapq.heapify(heap)
    taken = 0
    while taken < count and heap:
        _, rid = heapq.heappop(heap)
        g = by_rid[rid]
        g.take()
        taken += 1
        if g.best is not None:
            heapq.heappush(heap, (-g.best, rid))
    return taken


def paying_nodes(grown: Mapping[str, _Growing], ctx: SelectionContext, room: int) -> int:
    """How many of the best remaining nodes (at most `room`) to add so that expected committed
    tokens per millisecond of verification is highest: the throughput phase where extra tokens
    are not free (on a CPU every token of a forward costs)."""
    assert ctx.cost is not None
    taken = sum(len(g.kept) for g in grown.values())  # roots and SLO-phase nodes
    expected = sum(g.expected for g in grown.values())
    remaining = sorted((p for g in grown.values() for p in g.remaining()), reverse=True)[:room]
    verify = verify_shares(
        ctx.cost, ctx.prefill_tokens, ctx.prefill_tokens + taken, len(remaining) + 1,
        ctx.context, ctx.num_requests,
    )  # fmt: skip
    goodput = (expected + np.cumsum([0.0, *remaining])) / verify
    return int(np.argmax(goodput))


# ---- the selectors ---------------------------------------------------------------------------
class AdaServe(SelectorDrafting):
    name = "adaserve"
    plans_depth = False

    def __init__(self, slo: SloSettings | None = None) -> None:
        self.slo = slo or SloSettings()
        self.at_risk: set[str] = set()  # requests whose objective this step could not reach

    def draft_method(
        self, configured: DraftMethod | None, num_requests: int, budget: int
    ) -> DraftMethod | None:
        if configured is None:
            return None
        depth, width = beam_shape(budget, num_requests, self.slo.max_depth, self.slo.max_width)
        # the paper's beam keeps w nodes at every layer: the configured method's path-probability
        # cut-off (for dynamic trees) does not apply
        return DraftMethod("beam", depth=depth, width=width, min_path_prob=0.0)

    def method_bound(self, configured: DraftMethod | None) -> DraftMethod | None:
        if configured is None:
            return None
        return DraftMethod("beam", depth=self.slo.max_depth, width=self.slo.max_width)

    def select(self, trees: Mapping[str, TokenTree], ctx: SelectionContext) -> dict[str, TokenTree]:
        budget = step_budget(ctx.budget, ctx.prefill_tokens, len(trees), ctx.cost)
        grown = _grow_all(trees, ctx.max_depth, ctx.calibration)
        step_ms = estimated_step_ms(ctx.cost, budget, ctx.prefill_tokens, ctx.context, len(trees))
        left = budget - len(trees)
        self.at_risk = set()
        for rid, target in self._by_urgency(grown, ctx, step_ms):
            g = grown[rid]
            cap = min(target, g.depth + 1)
            while g.expected < cap and len(g.kept) < self.slo.max_slo_nodes and left > 0:
                if g.best is None:
                    break
                g.take()
                left -= 1
            if g.expected < target:
                self.at_risk.add(rid)
        if self.slo.throughput_phase == "goodput" and ctx.cost is not None:
            left = paying_nodes(grown, ctx, left)
        take_globally(grown.items(), left)
        return _subtrees(grown)

    def _by_urgency(
        self, grown: Mapping[str, _Growing], ctx: SelectionContext, step_ms: float | None
    ) -> list[tuple[str, float]]:
        """Requests with an objective and their A(r), in the order the admission setting
        serves them: urgent-first by A(r) descending (AdaServe); feasible-first puts those whose
        A(r) a tree of their depth can still meet ahead of the rest."""
        targets = []
        for rid in grown:
            target = acceptance_target(ctx.requests[rid], ctx.now, step_ms)
            if target is not None and target > 1.0:  # the root alone meets at most 1
                targets.append((rid, target))
        if self.slo.admission == "feasible-first":
            return sorted(targets, key=lambda t: (t[1] > grown[t[0]].depth + 1, -t[1]))
        return sorted(targets, key=lambda t: -t[1])


class ThesisSlo(SelectorDrafting):
    name = "thesis-slo"
    plans_depth = False

    def __init__(self, slo: SloSettings | None = None) -> None:
        self.slo = slo or SloSettings()

    def draft_method(
        self, configured: DraftMethod | None, num_requests: int, budget: int
    ) -> DraftMethod | None:
        """Alg. 1's dynamic tree, each at least as large as the whole budget could use."""
        if configured is None:
            return None
        # one request could take the whole budget, but a tree holds at most depth x width nodes
        size = max(1, min(budget - num_requests, self.slo.max_depth * self.slo.max_width))
        return DraftMethod(
            "dynamic",
            budget=size * max(1, num_requests),
            max_size=size,
            max_depth=self.slo.max_depth,
            max_width=self.slo.max_width,
            min_path_prob=configured.min_path_prob,
        )

    def method_bound(self, configured: DraftMethod | None) -> DraftMethod | None:
        if configured is None:
            return None
        return DraftMethod(
            "dynamic",
            max_size=self.slo.max_depth * self.slo.max_width,
            max_depth=self.slo.max_depth,
            max_width=self.slo.max_width,
        )

    def select(self, trees: Mapping[str, TokenTree], ctx: SelectionContext) -> dict[str, TokenTree]:
        budget = step_budget(ctx.budget, ctx.prefill_tokens, len(trees), ctx.cost)
        grown = _grow_all(trees, ctx.max_depth, ctx.calibration)
        step_ms = estimated_step_ms(ctx.cost, budget, ctx.prefill_tokens, ctx.context, len(trees))
        targets: dict[str, float] = {}
        for rid, g in grown.items():
            target = acceptance_target(ctx.requests[rid], ctx.now, step_ms)
            if target is not None:
                targets[rid] = min(target + self.slo.slack, g.depth + 1)
        left = budget - len(trees)
        while left > 0:
            best_rid, best_score = None, -1.0
            for rid, g in grown.items():
                f = g.best
                if f is None:
                    continue
                score = f + 1.0 if g.expected < targets.get(rid, 0.0) else f
                if score > best_score:
                    best_rid, best_score = rid, score
            if best_rid is None:
                break
            grown[best_rid].take()
            left -= 1
        return _subtrees(grown)


class EqualGreedy(SelectorDrafting):
    name = "equal-greedy"

    def select(self, trees: Mapping[str, TokenTree], ctx: SelectionContext) -> dict[str, TokenTree]:
        budget = step_budget(ctx.budget, ctx.prefill_tokens, len(trees), ctx.cost)
        share = budget // max(1, len(trees))  # nodes per request, root included
        grown = _grow_all(trees, ctx.max_depth, ctx.calibration)
        for g in grown.values():
            while len(g.kept) < share and g.best is not None:
                g.take()
        return _subtrees(grown)


class StaticTree(SelectorDrafting):
    """SpecInfer as AdaServe runs it: a fixed expansion, every drafted node verified."""

    name = "static"
    plans_depth = False

    def draft_method(
        self, configured: DraftMethod | None, num_requests: int, budget: int
    ) -> DraftMethod | None:
        return self.method_bound(configured)

    def method_bound(self, configured: DraftMethod | None) -> DraftMethod | None:
        if configured is None:
            return None
        return DraftMethod("static", expansion=SPECINFER_EXPANSION)

    def select(self, trees: Mapping[str, TokenTree], ctx: SelectionContext) -> dict[str, TokenTree]:
        grown = _grow_all(trees, ctx.max_depth, {})
        take_globally(grown.items(), sum(t.num_nodes for t in trees.values()))
        return _subtrees(grown)


class Incremental(SelectorDrafting):
    """Plain decoding: nothing drafted, one token per request per step."""

    name = "incremental"
    plans_depth = False

    def draft_method(
        self, configured: DraftMethod | None, num_requests: int, budget: int
    ) -> DraftMethod | None:
        return None

    def method_bound(self, configured: DraftMethod | None) -> DraftMethod | None:
        return None

    def select(self, trees: Mapping[str, TokenTree], ctx: SelectionContext) -> dict[str, TokenTree]:
        return {
            rid: tree.subtree([0]) if tree.num_nodes > 1 else tree for rid, tree in trees.items()
        }
