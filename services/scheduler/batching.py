"""Forming one micro-batch from the pool: who decodes, who prefills how much, who is admitted.

Running requests not already in flight come first (policy order), each taking a share of the
running set so that M micro-batches split it evenly; then prompt chunks of requests still
prefilling; then admissions while the running set has room. The step's token budget B covers
prompt chunks and trees together: decoding requests reserve room for their trees first.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from itertools import accumulate

from services.scheduler.request import PoolRequest
from shared.wire import BeamMethod, ChainMethod, DynamicTreeMethod, StaticTreeMethod
from shared.wire import DraftMethod as WireMethod


@dataclass
class MicroBatch:
    id: int
    decode: list[PoolRequest] = field(default_factory=list)
    prefill: list[tuple[PoolRequest, int]] = field(default_factory=list)  # request, chunk length

    @property
    def members(self) -> list[PoolRequest]:
        return self.decode + [r for r, _ in self.prefill]

    @property
    def prefill_tokens(self) -> int:
        return sum(n for _, n in self.prefill)


@dataclass(frozen=True)
class BatchLimits:
    token_budget: int  # B: tokens in one verifier forward
    max_running: int
    micro_batches: int  # M
    tree_nodes: int  # most nodes (root included) one request's tree may have


def tree_nodes(method: WireMethod | None) -> int:
    """Most nodes a drafted tree of this method has, its root included."""
    match method:
        case None:
            return 1
        case ChainMethod(length=length):
            return 1 + length
        case StaticTreeMethod(expansion=expansion):
            return 1 + sum(accumulate(expansion, lambda a, b: a * b))
        case BeamMethod(depth=depth, width=width):
            return 1 + depth * width
        case DynamicTreeMethod(max_nodes=nodes):
            return 1 + nodes
    raise TypeError(f"unknown drafting method {method!r}")


def form_batch(
    batch_id: int,
    running: list[PoolRequest],
    waiting: list[PoolRequest],
    limits: BatchLimits,
    admit: bool,
) -> tuple[MicroBatch, list[PoolRequest]]:
    """The next micro-batch from idle requests (policy-ordered lists); returns it and the
    waiting requests it admits (the caller moves them to the running set)."""
    batch = MicroBatch(batch_id)
    active = len(running) + (len(waiting) if admit else 0)
    share = max(1, math.ceil(active / limits.micro_batches))
    budget = limits.token_budget
    idle = [r for r in running if not r.in_flight]
    decoding = [r for r in idle if not r.is_prefilling][: min(share, budget)]
    batch.decode = decoding
    reserve = len(decoding) * limits.tree_nodes
    if any(r.is_prefilling for r in idle) or (admit and waiting):
        reserve = min(reserve, budget // 2)
    room = budget - max(reserve, len(decoding))
    count = len(decoding)
    for request in (r for r in idle if r.is_prefilling):
        if count >= share or room <= 0:
            break
        chunk = min(room, len(request.prefill_tokens) - request.num_prefilled)
        batch.prefill.append((request, chunk))
        room -= chunk
        count += 1
    admitted: list[PoolRequest] = []
    if admit:
        for request in waiting:
            if count >= share or room <= 0 or len(running) + len(admitted) >= limits.max_running:
                break
            chunk = min(room, len(request.prefill_tokens) - request.num_prefilled)
            batch.prefill.append((request, chunk))
            admitted.append(request)
            room -= chunk
            count += 1
    return batch, admitted
