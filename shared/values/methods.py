"""How a drafter grows a candidate tree: the one drafting-method type of the whole system.

The scheduler core plans with it, the in-process engine and the drafter service draft with it, and
the wire codec (`shared.wire.values`) carries it between processes. It holds no tensors.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from itertools import accumulate
from typing import Literal

DraftKind = Literal["chain", "static", "beam", "dynamic"]


@dataclass(frozen=True)
class DraftMethod:
    kind: DraftKind = "chain"
    k: int = 4  # chain length
    expansion: tuple[int, ...] = (2, 2, 1, 1)  # static <k1..km>
    depth: int = 4  # beam depth d
    width: int = 2  # beam width w
    budget: int = 32  # dynamic: draft tokens across the batch
    max_size: int = 16  # dynamic: draft tokens per tree
    max_depth: int = 6  # dynamic
    max_width: int = 4  # dynamic: nodes per layer
    top_children: int = 4  # dynamic: children proposed per leaf (the thesis uses 4)
    proposal_top_k: int = 32  # sampled children come from this renormalized top-k
    # Cost-aware speculation: a node whose path probability (the draft's estimate that the
    # target accepts it) is below this is not drafted, so the verifier does not pay for it.
    min_path_prob: float = 0.0

    def __post_init__(self) -> None:
        limits = [self.k, self.depth, self.width, self.budget, self.max_size, self.max_depth]
        limits += [self.max_width, self.top_children, self.proposal_top_k, *self.expansion]
        if min(limits) < 1 or not self.expansion:
            raise ValueError(f"draft method {self} has a non-positive limit")
        if not 0.0 <= self.min_path_prob < 1.0:
            raise ValueError(f"min_path_prob must be in [0, 1), got {self.min_path_prob}")

    @property
    def min_path_logprob(self) -> float:
        return math.log(self.min_path_prob) if self.min_path_prob > 0 else -math.inf

    @property
    def num_layers(self) -> int:
        """Tree depth: forwards of the draft model after the root's."""
        match self.kind:
            case "chain":
                return self.k
            case "static":
                return len(self.expansion)
            case "beam":
                return self.depth
            case _:
                return self.max_depth

    @property
    def max_draft_tokens(self) -> int:
        """Most draft tokens (root excluded) one request's tree of this method can have."""
        match self.kind:
            case "chain":
                return self.k
            case "static":
                return sum(accumulate(self.expansion, lambda a, b: a * b))
            case "beam":
                return self.depth * self.width
            case _:
                return min(self.max_size, self.budget)

    def tokens_at_depth(self, depth: int) -> int:
        """Most nodes of a tree of this method at `depth` (1 = the root's children)."""
        if not 1 <= depth <= self.num_layers:
            return 0
        match self.kind:
            case "chain":
                return 1
            case "static":
                return math.prod(self.expansion[:depth])
            case "beam":
                return self.width
            case _:
                return self.max_width

    def for_batch(self, num_requests: int) -> DraftMethod:
        """The dynamic tree's node limit is per request; its budget spans the whole batch."""
        if self.kind != "dynamic":
            return self
        return replace(self, budget=self.max_size * max(num_requests, 1))


def tree_capacity(method: DraftMethod | None) -> int:
    """Most nodes (root included) a tree of this method can have; 1 without speculation."""
    return 1 if method is None else 1 + method.max_draft_tokens


# How a model-free draft grows its trees by default: deep (copies run long) and with no path
# probability floor (drafting is free; the goodput selector keeps only the nodes that pay).
MODEL_FREE_METHOD = DraftMethod(
    "dynamic", budget=32, max_size=32, max_depth=16, max_width=4, top_children=3
)
