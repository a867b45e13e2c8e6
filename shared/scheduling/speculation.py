"""Speculation that pays: how deep each request drafts, and how many drafted nodes to verify.

Both decisions maximize the step's *goodput*, expected committed tokens per millisecond:

    G = sum_r (1 + E_r) / (T_draft + T_verify(N))

where E_r is request r's expected accepted draft tokens, N the tokens of the verifier's forward
(prompt chunks, one root per decoding request, the draft nodes) and T_* come from the cost model
measured on this machine. Zero draft tokens (plain decoding) is always a candidate, so a request
whose draft keeps failing stops paying for it, and one whose draft is accurate drafts deeper.

1. Before drafting (`plan_depths`), E_r(d) = sum_{j<=d} a_r^j with a_r the request's running
   per-depth acceptance estimate (`AcceptanceEstimate`, a decayed Beta posterior whose prior is
   the draft model's estimate over all requests). Depths grow one level at a time where the
   marginal expected token is largest; the best configuration seen is kept (the thesis's Alg. 1
   objective with verification cost as a term, under AdaServe's hardware budget B). A level
   costs the drafter a forward over its whole width, and the verifier about one node: the
   selection after drafting keeps only the nodes that pay. The first level also costs the
   drafter's root forward, whose backlog beyond one step's commit is spread over the
   request's remaining steps (`DepthQuery.root_tokens`).
2. After drafting (`select_by_goodput`), the drafted trees' own path probabilities f(i) (AdaServe
   Thm. 3.1: E[accepted] = sum f(i)), calibrated per request by how the target actually agreed,
   rank every node of the micro-batch; the verified prefix of that ranking is the one with the
   highest goodput. Drafting is spent by then, so only T_verify counts.

A model-free partner merged with the model's tree (a copy from the context) is free to draft;
the model's levels count only for what the partner is not expected to deliver, so inside a copy
the model does not draft and the step costs one forward. What the partner is expected to deliver
is its per-depth acceptance over mostly its latest step (a copy starts and ends abruptly) or,
with `model_beside_copy = "runs"`, its acceptance on the steps that followed a step like the
last one (`CopyRuns`): a copy that was still matching when the step's tokens ran out mostly goes
on; one the target left (or no match at all) is followed by a fresh match, on open text mostly
a poor one, so the model drafts.

A request planned at depth 0 probes again (depth 1) after an interval that doubles each time the
probe does not change the plan, so an estimate can recover without paying every step; and only
where a good draft (acceptance `OPTIMISTIC_RATE`) would pay in that step: in a step of many
requests on a steep cost curve no draft pays, and probing would only cost.
"""

from __future__ import annotations

import functools
import heapq
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from shared.scheduling.cost_model import CostModel
from shared.values.methods import DraftMethod
from shared.values.tree import DETERMINISTIC, TokenTree

PRIOR_RATE = 0.5  # a draft model's acceptance before anything is observed
PRIOR_WEIGHT = 4.0  # pseudo-observations of the prior in a request's estimate
DECAY = 0.9  # weight of older observations per step
CALIBRATION_CLIP = (0.25, 4.0)
FIRST_PROBE_INTERVAL = 4
MAX_PROBE_INTERVAL = 64
OPTIMISTIC_RATE = 0.9  # a probe is worth it only if a draft this good would pay in the step
# weight of older steps in a model-free partner's recent per-depth estimate (`recent`): a copy
# from the context starts and ends abruptly, and the model beside it should follow
RECENT_ESTIMATE_DECAY = 0.25
# a drafter's backlog is spread over the steps of at most this many of the request's tokens to
# come: `max_tokens` is only a bound on its length (a chat answer is typically shorter)
AMORTIZED_TOKENS = 128


@dataclass
class AcceptanceEstimate:
    """Per-depth acceptance as a decayed Beta posterior: each verified level is a trial that
    succeeds when the target accepts a token there; a step stops at its first failure."""

    successes: float = 0.0
    trials: float = 0.0

    def observe(self, num_accepted: int, depth: int, decay: float = DECAY) -> None:
        failed = 1 if num_accepted < depth else 0
        self.successes = decay * self.successes + num_accepted
        self.trials = decay * self.trials + num_accepted + failed

    def rate(self, prior: float = PRIOR_RATE, weight: float = PRIOR_WEIGHT) -> float:
        return (self.successes + prior * weight) / (self.trials + weight)


@dataclass
class CopyEstimate:
    """A model-free draft's reach as a run: a copy is on or off, so whether its first token is
    accepted (`first`) is estimated apart from each deeper level given the one before
    (`deeper`); its path reaches depth d with probability first * deeper^(d-1). One per-depth
    rate would read three copied tokens among junk steps as a fair chance at every level."""

    first: AcceptanceEstimate = field(default_factory=AcceptanceEstimate)
    deeper: AcceptanceEstimate = field(default_factory=AcceptanceEstimate)

    def observe(self, num_accepted: int, num_tried: int) -> None:
        """A verified step's trial (levels accepted, levels tried: one more where rejected)."""
        self.first.observe(min(num_accepted, 1), 1)
        if num_accepted >= 1 and num_tried > 1:
            self.deeper.observe(num_accepted - 1, num_tried - 1)

    def rates(self, prior: CopyEstimate | None = None, weight: float = 1.0) -> tuple[float, float]:
        """(first, deeper), each shrunk toward `prior`'s (the draft's over all requests)."""
        if prior is None:
            return self.first.rate(weight=weight), self.deeper.rate(weight=weight)
        first, deeper = prior.rates()
        return self.first.rate(first, weight), self.deeper.rate(deeper, weight)


@dataclass
class CopyRuns:
    """A model-free draft's `CopyEstimate` kept apart by how its previous verified step ended:
    `running` (its path still matched the target's tokens when they ran out: the copy goes on)
    or stopped (the target left the copy, or there was nothing to copy)."""

    after_running: CopyEstimate = field(default_factory=CopyEstimate)
    after_stopped: CopyEstimate = field(default_factory=CopyEstimate)
    running: bool = False

    def observe(self, num_accepted: int, num_tried: int) -> None:
        self.current().observe(num_accepted, num_tried)
        self.running = num_accepted > 0 and num_accepted == num_tried

    def current(self) -> CopyEstimate:
        """The estimate that speaks for the next step."""
        return self.after_running if self.running else self.after_stopped


@dataclass
class SpeculationState:
    """What the planner remembers of one request (on one draft model)."""

    estimate: AcceptanceEstimate
    # a model-free partner's per-depth acceptance mostly in its latest step
    # (`RECENT_ESTIMATE_DECAY`), which decides whether the model beside it drafts at all, or,
    # with `model_beside_copy = "runs"`, its reach by how its last step ended (one is kept)
    recent: AcceptanceEstimate = field(default_factory=AcceptanceEstimate)
    runs: CopyRuns = field(default_factory=CopyRuns)
    calibration: float = 1.0  # accepted / sum f(i) of what was verified, decayed
    idle_steps: int = 0  # steps planned at depth 0 since the last draft
    probe_interval: int = FIRST_PROBE_INTERVAL


@dataclass(frozen=True)
class DepthQuery:
    """One decoding request for the planner."""

    request_id: str
    draft_model: str
    method: DraftMethod
    max_depth: int  # tokens left and context room allow no deeper
    rate: float  # per-depth acceptance estimate
    new_tokens: int  # committed tokens the drafter has not seen (its root forward)
    tokens_left: int | None = None  # output tokens the request may still commit (None: unknown)
    # a model-free partner drafting beside the model (merged trees): its path reaches depth d
    # with probability partner_first * partner_rate^(d-1) (partner_first None: partner_rate^d),
    # up to its depth; the model's level d pays only where the partner falls short
    partner_rate: float = 0.0
    partner_depth: int = 0
    partner_first: float | None = None

    def partner_reach(self, depth: int) -> float:
        """The probability that the partner's path is accepted to `depth`."""
        if depth > self.partner_depth:
            return 0.0
        first = self.partner_rate if self.partner_first is None else self.partner_first
        return first * self.partner_rate ** (depth - 1)

    def partner_tokens(self) -> float:
        """The partner's expected accepted tokens: its reach summed over its depths."""
        return sum(self.partner_reach(d) for d in range(1, self.partner_depth + 1))

    def level_gains(self) -> list[float]:
        """Expected tokens the model's levels 1..max_depth add, each over the one before. With
        a partner whose path reaches depth d with probability p^d, the merged tree accepts
        max(model's, partner's): level d adds rate^d (1 - p^d). Those gains may rise with d (a
        partner sure of its first tokens), so rising runs are pooled into their mean: the
        planner takes a request's levels in order, best first, and the totals are unchanged."""
        depth = min(self.max_depth, self.method.num_layers)
        gains = [self.rate**d * (1.0 - self.partner_reach(d)) for d in range(1, depth + 1)]
        return _non_increasing(gains)

    def root_tokens(self) -> float:
        """The root forward's tokens this step is charged for. A drafter that drafted last
        step has at most a step's commit to catch up on (`max_depth + 1`); anything beyond is a
        backlog (a prompt it never saw, the steps it sat out) that drafting pays once and every
        later step of the request draws on, so it is spread over the steps the request still
        has. Charging it all to this step would keep a request that once stopped drafting from
        ever starting again, its backlog growing with every plain step."""
        steady = self.max_depth + 1
        backlog = self.new_tokens - steady
        if backlog <= 0 or self.tokens_left is None:
            return float(self.new_tokens)
        per_step = sum(self.rate**d for d in range(self.max_depth + 1))  # 1 + expected accepted
        steps_left = max(1.0, min(self.tokens_left, AMORTIZED_TOKENS) / per_step)
        return steady + backlog / steps_left


def verify_shares(
    cost: CostModel,
    prefill_tokens: int,
    first_tokens: int,
    count: int,
    context: int,
    num_requests: int | None,
) -> np.ndarray:
    """What the decoding part of verifier forwards of `first_tokens`, `first_tokens + 1`, ...
    (`count` sizes; `prefill_tokens` of each are prompt chunks) is worth charging: each the
    forward it would be without the prompt chunks. They are paid for whatever is speculated;
    charging them to speculation would make extra draft tokens look cheap next to a large step
    (or, on a flat curve, free)."""
    sizes = np.arange(first_tokens, first_tokens + count) - prefill_tokens
    return cost.verify_ms_many(np.maximum(sizes, 1), context, num_requests)


def plan_depths(
    queries: Sequence[DepthQuery],
    cost: CostModel,
    *,
    prefill_tokens: int,
    budget: int,
    context: int,
    num_requests: int | None = None,
) -> dict[str, int]:
    """The depth each request drafts to this step (0: plain decoding), by goodput.
    `num_requests`: requests in the verifier's forward, decoding and prefilling (None: the
    profile's spread layout).

    Levels are taken best marginal expected tokens first (request i's level d adds rate_i^d,
    less what a model-free partner drafting beside it covers: `DepthQuery.level_gains`; a
    request's levels come in order, as its gains fall with depth), each adding about one node
    to the verifier's forward (what the selector after drafting verifies) until the budget is
    spent. The plan is the prefix of that order with the most expected tokens per millisecond
    of drafting and verification; every prefix is priced at once.
    """
    depth = {q.request_id: 0 for q in queries}
    levels, goodput = _priced_prefixes(queries, cost, prefill_tokens, budget, context, num_requests)
    best = int(np.argmax(goodput))  # the first of equals
    for _, i, _ in levels[:best]:
        depth[queries[i].request_id] += 1
    return depth


def planned_goodput(
    queries: Sequence[DepthQuery],
    cost: CostModel,
    *,
    prefill_tokens: int,
    budget: int,
    context: int,
    num_requests: int | None = None,
) -> float:
    """Expected committed tokens per millisecond of `plan_depths`' plan for `queries`."""
    _, goodput = _priced_prefixes(queries, cost, prefill_tokens, budget, context, num_requests)
    return float(goodput.max())


def _priced_prefixes(
    queries: Sequence[DepthQuery],
    cost: CostModel,
    prefill_tokens: int,
    budget: int,
    context: int,
    num_requests: int | None,
) -> tuple[list[tuple[float, int, int]], np.ndarray]:
    """The levels best first (-gain, query, depth) within the budget, and [K + 1] the goodput
    of each prefix of them (prefix k takes levels[:k])."""
    first_nodes = len(queries) + prefill_tokens  # one root per decoding request
    levels = sorted(
        (-gain, i, d)
        for i, q in enumerate(queries)
        if q.rate > 0
        for d, gain in enumerate(q.level_gains(), start=1)
    )[: max(0, budget - first_nodes)]
    # expected tokens: the roots and what the model-free partners are expected to add whatever
    # the models draft, then each level's gain
    base = len(queries) + sum(q.partner_tokens() for q in queries)
    tokens = base - np.concatenate(([0.0], np.cumsum([g for g, _, _ in levels])))
    num_prefixes = len(levels) + 1
    step_ms = verify_shares(cost, prefill_tokens, first_nodes, num_prefixes, context, num_requests)
    for model in sorted({queries[i].draft_model for _, i, _ in levels}):
        if cost.has_draft(model):  # a draft without a profile is taken as free
            step_ms = step_ms + _drafting_ms(model, levels, queries, cost, context)
    return levels, tokens / step_ms


def _non_increasing(values: list[float]) -> list[float]:
    """The closest non-increasing sequence with the same sum over every pooled run: each run
    that rises is replaced by its mean (pool-adjacent-violators)."""
    blocks: list[tuple[float, int]] = []  # (mean, length)
    for v in values:
        total, count = v, 1
        while blocks and blocks[-1][0] < total / count:
            mean, length = blocks.pop()
            total, count = total + mean * length, count + length
        blocks.append((total / count, count))
    return [mean for mean, length in blocks for _ in range(length)]


@functools.cache
def layer_widths(method: DraftMethod) -> tuple[int, ...]:
    """Nodes a tree of `method` may add at each depth (index 0 unused): what a level costs."""
    limit = method.max_draft_tokens
    return (0, *(min(method.tokens_at_depth(d), limit) for d in range(1, method.num_layers + 1)))


def _drafting_ms(
    model: str,
    levels: Sequence[tuple[float, int, int]],
    queries: Sequence[DepthQuery],
    cost: CostModel,
    context: int,
) -> np.ndarray:
    """[K + 1] drafting time of `model` after each prefix of `levels`: its root chain forward
    (every drafting request's new tokens) and one forward per tree layer but the deepest, as
    `CostModel.draft_tree_ms` prices a tree, with the drafting requests counted at each prefix."""
    mine = np.array([queries[i].draft_model == model for _, i, _ in levels])
    level = np.array([d for _, _, d in levels]) * mine  # 0 where another model's level
    starts = level == 1  # a request's first level: it drafts, and its root forward grows
    roots = [q.root_tokens() for q in queries]  # once per request, not per level
    new_tokens = np.array([roots[i] for _, i, _ in levels]) * starts
    width = np.array([layer_widths(queries[i].method)[d] for _, i, d in levels])

    def prefix(values: np.ndarray) -> np.ndarray:
        return np.concatenate(([0], np.cumsum(values)))

    drafting = prefix(starts)  # requests drafting with this model
    deepest = np.concatenate(([0], np.maximum.accumulate(level)))  # layers of its trees
    forwards = [prefix(new_tokens)]  # the root chain
    for layer in range(1, int(deepest[-1])):  # layer d's nodes are forwarded once d+1 exists
        forwards.append(prefix(width * (level == layer)) * (deepest > layer))
    return sum(
        cost.draft_forward_ms_many(model, n, context, np.maximum(drafting, 1)) for n in forwards
    )


def node_scores(tree: TokenTree, max_depth: int) -> list[tuple[float, int, int]]:
    """(log path probability, depth, node) of the nodes a selector may take.

    A sampled node's inclusion may not depend on its own token (that would bias multi-step
    speculative sampling), so sampled siblings are scored by their parent's path probability.
    A certain node (path probability 1: tokens a grammar forces) is taken past `max_depth`.
    """
    if tree.num_nodes == 1:
        return []
    lp = tree.path_logprob()
    depth = tree.depths()
    out = []
    for node in range(1, tree.num_nodes):
        if depth[node] > max_depth and lp[node] < 0.0:
            continue
        sampled = tree.proposal_of[node] != DETERMINISTIC
        score = lp[tree.parents[node]] if sampled else lp[node]
        out.append((float(score), int(depth[node]), node))
    return out


def take_best_first(
    trees: Mapping[str, TokenTree],
    max_depth: Mapping[str, int],
    weight: Mapping[str, float],
    count: int | None,
) -> dict[str, list[int]]:
    """Nodes across all trees in order of weighted path probability, each after its parent, at
    most `count` of them (None: all); returns the kept nodes per request, root first."""
    heap: list[tuple[float, int, int, str]] = []
    for rid, tree in trees.items():
        shift = math.log(weight.get(rid, 1.0))
        for score, depth, node in node_scores(tree, max_depth.get(rid, 1 << 30)):
            # certain nodes (forced by a grammar) are not scaled by the draft's calibration
            heap.append((-(score + shift if score < 0.0 else 0.0), depth, node, rid))
    heapq.heapify(heap)
    kept: dict[str, list[int]] = {rid: [0] for rid in trees}
    taken: dict[str, set[int]] = {rid: {0} for rid in trees}
    left = len(heap) if count is None else count
    while left > 0 and heap:
        _, _, node, rid = heapq.heappop(heap)
        if int(trees[rid].parents[node]) in taken[rid]:
            taken[rid].add(node)
            kept[rid].append(node)
            left -= 1
    return kept


def select_by_goodput(
    trees: Mapping[str, TokenTree],
    max_depth: Mapping[str, int],
    calibration: Mapping[str, float],
    cost: CostModel,
    *,
    prefill_tokens: int,
    budget: int,
    context: int,
    num_requests: int | None = None,
) -> int:
    """How many draft nodes of the micro-batch to verify: the prefix of the calibrated ranking
    with the highest expected committed tokens per millisecond of verification."""
    probs: list[float] = []
    for rid, tree in trees.items():
        c = calibration.get(rid, 1.0)
        probs += [
            min(1.0, c * math.exp(s)) if s < 0.0 else 1.0
            for s, _, _ in node_scores(tree, max_depth[rid])
        ]
    probs.sort(reverse=True)
    roots = len(trees) + prefill_tokens
    room = max(0, budget - roots)
    taken = probs[:room]
    verify = verify_shares(cost, prefill_tokens, roots, len(taken) + 1, context, num_requests)
    goodput = (len(trees) + np.cumsum([0.0, *taken])) / verify  # verifying the first n nodes
    return int(np.argmax(goodput))  # the first of equals: no node that adds nothing
