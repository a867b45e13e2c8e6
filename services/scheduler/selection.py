"""Selecting each request's tree under the step's token budget.

The budget counts every node the verifier forwards, roots included. GlobalGreedy (AdaServe's
baseline) takes nodes across all requests in order of path probability f(i), each only after its
parent, until the budget is spent. A sampled node's inclusion may not depend on its own token
(that would bias multi-step speculative sampling), so sampled siblings are ranked by their
parent's path probability and taken in draw order.
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping
from typing import Protocol

from shared.engine.tree import DETERMINISTIC, TokenTree


class TreeSelector(Protocol):
    name: str

    def select(
        self, trees: Mapping[str, TokenTree], budget: int, max_depth: Mapping[str, int]
    ) -> dict[str, TokenTree]:
        """A subtree per request (root always kept), all nodes together within `budget`."""
        ...


class GlobalGreedy:
    name = "global_greedy"

    def select(
        self, trees: Mapping[str, TokenTree], budget: int, max_depth: Mapping[str, int]
    ) -> dict[str, TokenTree]:
        kept: dict[str, list[int]] = {rid: [0] for rid in trees}
        left = budget - len(trees)
        candidates: list[tuple[float, int, int, str]] = []
        for rid, tree in trees.items():
            if tree.num_nodes == 1:
                continue
            lp = tree.path_logprob()
            depth = tree.depths()
            limit = max_depth.get(rid, 1 << 30)
            for node in range(1, tree.num_nodes):
                if depth[node] > limit:
                    continue
                sampled = tree.proposal_of[node] != DETERMINISTIC
                score = lp[tree.parents[node]] if sampled else lp[node]
                candidates.append((-float(score), int(depth[node]), node, rid))
        heapq.heapify(candidates)
        taken: dict[str, set[int]] = {rid: {0} for rid in trees}
        while left > 0 and candidates:
            _, _, node, rid = heapq.heappop(candidates)
            if int(trees[rid].parents[node]) in taken[rid]:
                taken[rid].add(node)
                kept[rid].append(node)
                left -= 1
        return {
            rid: tree if len(kept[rid]) == tree.num_nodes else tree.subtree(kept[rid])
            for rid, tree in trees.items()
        }


SELECTORS: dict[str, type[TreeSelector]] = {"global_greedy": GlobalGreedy}


def make_selector(name: str) -> TreeSelector:
    try:
        return SELECTORS[name]()
    except KeyError:
        raise ValueError(f"unknown tree selection {name!r}; known: {sorted(SELECTORS)}") from None


def root_only(tokens: list[int]) -> TokenTree:
    return TokenTree.root_only(int(tokens[-1]))
