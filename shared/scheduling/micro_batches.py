"""How many micro-batches to pipeline (Spin §V-B), from the cost profile.

With M micro-batches in flight, drafters work on one while the verifier checks another, so
drafting hides behind verification; but each forward covers only 1/M of the running set, which
uses a device less well. Spin raises M from 2 while the verifier's profiled throughput does not
drop noticeably. That presumes pipelining pays at M = 2, which it does not where a verifier
forward costs about the same for 1 request as for 64 (a GPU far from its limits, the committed
H100 profile): there two half-size forwards take twice as long as one, while the drafting they
hide is shorter. So the choice here starts from the pipeline's cycle as the profile predicts it.

For a running set of n requests split into M micro-batches of n/M, with D and V the time to draft
and to verify one micro-batch (each drafting `tokens_per_request` nodes per request, `depth`
levels deep), every request makes one step per cycle of

    separate devices:  max(M * V, M * D, D + V)   (the verifier's, the drafters' and one
                                                   micro-batch's own round trip)
    one shared device: M * (D + V)

and M is the smallest that brings the cycle within `max_drop` of the shortest one, from 1 to
`max_micro_batches` (fewer micro-batches: fewer requests waiting on each other's stragglers).
"""

from __future__ import annotations

import math

from shared.scheduling.cost_model import CostModel


def cycle_ms(
    cost: CostModel,
    draft: str | None,
    num_requests: int,
    num_micro_batches: int,
    tokens_per_request: int,
    depth: int,
    context: int,
    *,
    shared_device: bool,
) -> float:
    """One pipeline cycle: the time in which every request makes one step."""
    size = math.ceil(num_requests / num_micro_batches)
    verify = cost.verify_ms(size * tokens_per_request, context, size)
    drafting = 0.0
    if draft is not None and cost.has_draft(draft) and depth > 0:
        per_level = max(1, (tokens_per_request - 1) // depth) * size
        drafting = cost.draft_tree_ms(draft, size, [per_level] * depth, context, size)
    if shared_device:
        return num_micro_batches * (drafting + verify)
    return max(num_micro_batches * verify, num_micro_batches * drafting, drafting + verify)


def choose_micro_batches(
    cost: CostModel,
    draft: str | None,
    num_requests: int,
    tokens_per_request: int,
    depth: int,
    context: int,
    *,
    max_micro_batches: int,
    max_drop: float,
    shared_device: bool,
) -> int:
    """The fewest micro-batches whose predicted cycle is within `max_drop` of the shortest."""
    candidates = range(1, max(1, min(max_micro_batches, num_requests)) + 1)
    cycles = {
        m: cycle_ms(
            cost, draft, num_requests, m, tokens_per_request, depth, context,
            shared_device=shared_device,
        )
        for m in candidates
    }  # fmt: skip
    shortest = min(cycles.values())
    return min(m for m, c in cycles.items() if c <= shortest / (1 - max_drop))


class StepShape:
    """Running means of what a decoding request's step verifies (nodes, root included) and how
    deep it drafted: what the pipeline's forwards will hold, rather than the method's bound."""

    DECAY = 0.95

    def __init__(self) -> None:
        self.nodes: float | None = None
        self.depth: float | None = None

    def observe(self, nodes: int, depth: int) -> None:
        if self.nodes is None or self.depth is None:
            self.nodes, self.depth = float(nodes), float(depth)
            return
        self.nodes = self.DECAY * self.nodes + (1 - self.DECAY) * nodes
        self.depth = self.DECAY * self.depth + (1 - self.DECAY) * depth

    def typical(self, nodes: int, depth: int) -> tuple[int, int]:
        """The observed means, rounded (the given bounds before any step was observed)."""
        if self.nodes is None or self.depth is None:
            return nodes, depth
        return max(1, round(self.nodes)), round(self.depth)


def is_shared_device(cost: CostModel) -> bool:
    """Whether the profile was measured on a CPU, where every service shares the host."""
    return cost.profile.target.key.device.startswith("cpu")
