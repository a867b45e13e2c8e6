"""Selecting each request's tree under the step's token budget.

The budget counts every node the verifier forwards, roots included. A selector sees the
micro-batch's requests, their drafted trees, the budget left after prompt chunks and the cost
model. GlobalGreedy (AdaServe's baseline) takes nodes across all requests in order of path
probability f(i), each only after its parent, until the budget is spent. Goodput (the default)
takes the same ranking, calibrated per request, only as far as it raises expected committed
tokens per millisecond of verification (`speculation.select_by_goodput`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol, get_args

from shared.scheduling.cost_model import CostModel
from shared.scheduling.request import RequestState
from shared.scheduling.speculation import select_by_goodput, take_best_first
from shared.settings import TreeSelection
from shared.values.methods import DraftMethod
from shared.values.tree import TokenTree


@dataclass(frozen=True)
class SelectionContext:
    requests: Mapping[str, RequestState]
    budget: int  # nodes the trees may use together, roots included
    prefill_tokens: int  # prompt tokens in the same forward
    max_depth: Mapping[str, int]  # no deeper than this per request
    calibration: Mapping[str, float]  # observed accepted / predicted, per request
    cost: CostModel | None
    context: int  # typical per-request context length
    now: float
    num_requests: int | None = None  # requests in the verifier's forward (None: unknown)


class TreeSelector(Protocol):
    name: str
    plans_depth: bool  # False: every request drafts its method's whole tree (no goodput planner)

    def draft_method(
        self, configured: DraftMethod | None, num_requests: int, budget: int
    ) -> DraftMethod | None:
        """The drafting method for a step of `num_requests` decoding requests under `budget`."""
        ...

    def method_bound(self, configured: DraftMethod | None) -> DraftMethod | None:
        """The largest method `draft_method` can return: what a request's KV must allow for."""
        ...

    def select(self, trees: Mapping[str, TokenTree], ctx: SelectionContext) -> dict[str, TokenTree]:
        """A subtree per request (root always kept), all nodes together within the budget."""
        ...


class SelectorDrafting:
    """What a selector asks of the drafters: by default the configured method, sized by the
    goodput planner where that is on (GlobalGreedy, Goodput)."""

    plans_depth = True  # False: every request drafts its method's whole tree

    def draft_method(
        self, configured: DraftMethod | None, num_requests: int, budget: int
    ) -> DraftMethod | None:
        return configured

    def method_bound(self, configured: DraftMethod | None) -> DraftMethod | None:
        return configured


def _subtrees(
    trees: Mapping[str, TokenTree], kept: Mapping[str, list[int]]
) -> dict[str, TokenTree]:
    return {
        rid: tree if len(kept[rid]) == tree.num_nodes else tree.subtree(kept[rid])
        for rid, tree in trees.items()
    }


class GlobalGreedy(SelectorDrafting):
    name = "global-greedy"

    def select(self, trees: Mapping[str, TokenTree], ctx: SelectionContext) -> dict[str, TokenTree]:
        count = max(0, ctx.budget - len(trees))
        return _subtrees(trees, take_best_first(trees, ctx.max_depth, {}, count))


class Goodput(SelectorDrafting):
    name = "goodput"

    def select(self, trees: Mapping[str, TokenTree], ctx: SelectionContext) -> dict[str, TokenTree]:
        if ctx.cost is None:  # nothing to weigh costs with: spend the budget
            return GlobalGreedy().select(trees, ctx)
        count = select_by_goodput(
            trees,
            ctx.max_depth,
            ctx.calibration,
            ctx.cost,
            prefill_tokens=ctx.prefill_tokens,
            budget=ctx.prefill_tokens + ctx.budget,
            context=ctx.context,
            num_requests=ctx.num_requests,
        )
        kept = take_best_first(trees, ctx.max_depth, ctx.calibration, count)
        return _subtrees(trees, kept)


SELECTORS: tuple[str, ...] = get_args(TreeSelection)
