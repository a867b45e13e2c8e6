"""Tree attention for CPUs: the reference's math, planned once per forward.

Same contract as `tree_attention_reference` (and the Triton kernel). The reference rebuilds each
request's KV gather and mask in every layer and calls `scaled_dot_product_attention`, whose
fixed cost per call dominates at serving sizes on a CPU: a query of 1-17 rows against a few
hundred keys costs 50-130 us in SDPA and 20-75 us as two batched matmuls and a softmax
(2-core Xeon, 9 query heads over 3 KV heads of 64). Here a forward's metadata is turned once
into a plan per request, which every layer reuses:

- the request's KV is a view of the paged cache when its blocks are consecutive (the allocator
  hands them out in ascending order, so a request that never had to share the pool gets a
  view), else an index for `index_select`;
- its mask is additive (0 or -inf), already laid out for grouped-query rows, or None when the
  request has a single new token (which sees its whole context).

Scores are materialized per request ([Hkv, group * n, num_kv]); a request whose scores would
exceed `max_scores` elements (a long prompt chunk) goes through SDPA with the same mask instead.
Computation is in fp32 whatever the cache dtype, as in the reference's tests.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels.attention_metadata import AttentionMetadata, unpack_mask_bits


@dataclass(frozen=True)
class _RequestPlan:
    q_lo: int
    q_hi: int
    num_kv: int
    num_blocks: int
    first_block: int | None  # consecutive blocks start here: the cache slice is a view
    blocks: torch.Tensor | None  # otherwise the blocks to gather, int64
    mask: torch.Tensor | None  # [group * n, num_kv] fp32 additive; None: sees everything


class CpuTreeAttention:
    """One per model runner; callable as an `AttentionFn`. It remembers the plan of the last
    forward's metadata (by identity: the runner builds new metadata for every forward)."""

    def __init__(self, max_scores: int = 1 << 22) -> None:
        self.max_scores = max_scores
        self._meta: AttentionMetadata | None = None
        self._group = 0
        self._plans: list[_RequestPlan] = []

    def __call__(
        self,
        q: torch.Tensor,  # [T, Hq, D]
        k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
        v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [T, Hq, D]
        num_tokens, num_heads, dim = q.shape
        num_kv_heads = k_cache.shape[2]
        group = num_heads // num_kv_heads
        if meta is not self._meta or group != self._group:
            self._plans = plan_requests(meta, k_cache.shape[1], group)
            self._meta, self._group = meta, group
        out = torch.empty_like(q)
        for plan in self._plans:
            n = plan.q_hi - plan.q_lo
            k = _request_kv(k_cache, plan)  # [S, Hkv, D]
            v = _request_kv(v_cache, plan)
            rows = (
                q[plan.q_lo : plan.q_hi]
                .view(n, num_kv_heads, group, dim)
                .permute(1, 2, 0, 3)
                .reshape(num_kv_heads, group * n, dim)
                .float()
            )  # [Hkv, group * n, D]
            keys = k.permute(1, 2, 0).float()  # [Hkv, D, S]
            values = v.transpose(0, 1).float()  # [Hkv, S, D]
            if num_kv_heads * group * n * plan.num_kv > self.max_scores:
                o = F.scaled_dot_product_attention(
                    rows,
                    keys.transpose(1, 2),
                    values,
                    attn_mask=None if plan.mask is None else plan.mask,
                    scale=scale,
                )
            elif plan.mask is None:
                o = torch.bmm(torch.bmm(rows, keys).mul_(scale).softmax(-1), values)
            else:
                scores = torch.bmm(rows, keys).mul_(scale).add_(plan.mask)
                o = torch.bmm(scores.softmax(-1), values)
            out[plan.q_lo : plan.q_hi] = (
                o.view(num_kv_heads, group, n, dim).permute(2, 0, 1, 3).reshape(n, num_heads, dim)
            )
        return out


def plan_requests(meta: AttentionMetadata, block_size: int, group: int) -> list[_RequestPlan]:
    """What every layer of one forward needs per request, computed once."""
    plans: list[_RequestPlan] = []
    qs = meta.query_start_host
    for r in range(meta.num_requests):
        q_lo, q_hi = qs[r], qs[r + 1]
        if q_hi == q_lo:
            continue
        prefix, tree = meta.prefix_lens_host[r], meta.tree_lens_host[r]
        num_kv = prefix + tree
        num_blocks = (num_kv + block_size - 1) // block_size
        table = meta.block_tables[r, :num_blocks].tolist()
        first = table[0] if table else 0
        is_consecutive = table == list(range(first, first + num_blocks))
        mask = None
        if tree > 1:
            visible = torch.ones(q_hi - q_lo, num_kv, dtype=torch.bool)
            visible[:, prefix:] = unpack_mask_bits(meta.tree_mask[q_lo:q_hi], tree).cpu()
            additive = torch.zeros(visible.shape).masked_fill_(~visible, float("-inf"))
            mask = additive.repeat(group, 1).to(meta.tree_mask.device)
        plans.append(
            _RequestPlan(
                q_lo=q_lo,
                q_hi=q_hi,
                num_kv=num_kv,
                num_blocks=num_blocks,
                first_block=first if is_consecutive else None,
                blocks=None
                if is_consecutive
                else torch.tensor(table, dtype=torch.int64, device=meta.block_tables.device),
                mask=mask,
            )
        )
    return plans


def _request_kv(cache: torch.Tensor, plan: _RequestPlan) -> torch.Tensor:  # [num_kv, Hkv, D]
    if plan.blocks is None:
        assert plan.first_block is not None
        blocks = cache[plan.first_block : plan.first_block + plan.num_blocks]
    else:
        blocks = cache.index_select(0, plan.blocks)
    return blocks.flatten(0, 1)[: plan.num_kv]
