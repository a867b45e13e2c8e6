"""Tree attention for CPUs: the reference's math, planned once per forward.

Same contract as `tree_attention_reference` (and the Triton kernel). The reference rebuilds each
request's KV gather and mask in every layer and calls `scaled_dot_product_attention`, whose
fixed cost per call dominates at serving sizes on a CPU (a query of 1-17 rows against a few
hundred keys). Here a forward's metadata is turned once into a plan per request, which every
layer reuses:

- the request's KV is a view of the paged cache when its blocks are consecutive (the allocator
  keeps each request's blocks in one run where it can, `shared/model/kv_cache.py`), else an
  index for `index_select`;
- its mask is built once: for fp32, additive (0 or -inf) and already laid out for the grouped
  query rows, or None when the request has a single new token (which sees its whole context).

fp32 requests are two batched matmuls and a softmax. A request whose scores would exceed
`max_scores` elements (a long prompt chunk) and every request in another dtype go through SDPA
as in the reference, with the boolean mask of the plan; then only that compact mask stays in
the plan between forwards.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.attention_metadata import AttentionMetadata
from kernels.reference import group_query_rows, grouped_sdpa, ungroup_query_rows


@dataclass(frozen=True)
class _RequestPlan:
    q_lo: int
    q_hi: int
    num_kv: int
    num_blocks: int
    first_block: int | None  # consecutive blocks start here: the cache slice is a view
    blocks: torch.Tensor | None  # otherwise the blocks to gather, int64
    is_matmul: bool  # fp32 and small enough: bmm / softmax / bmm; else SDPA
    # matmul: [group * n, num_kv] fp32 additive; SDPA: [n, num_kv] bool; None: the request's
    # one new token sees everything
    mask: torch.Tensor | None


class CpuTreeAttention:
    """One per model runner; callable as an `AttentionFn`. It remembers the plan of the last
    forward's metadata (by identity: the runner builds new metadata for every forward)."""

    def __init__(self, max_scores: int = 1 << 22, *, reads_views: bool = True) -> None:
        self.max_scores = max_scores
        self.reads_views = reads_views  # False: gather every request (to measure what views save)
        self._meta: AttentionMetadata | None = None
        self._plans: list[_RequestPlan] = []

    def __call__(
        self,
        q: torch.Tensor,  # [T, Hq, D]
        k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
        v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:  # [T, Hq, D]
        num_kv_heads = k_cache.shape[2]
        group = q.shape[1] // num_kv_heads
        if meta is not self._meta:
            self._plans = plan_requests(
                meta,
                block_size=k_cache.shape[1],
                num_kv_heads=num_kv_heads,
                group=group,
                dtype=q.dtype,
                max_scores=self.max_scores,
                reads_views=self.reads_views,
            )
            self._meta = meta
        out = torch.empty_like(q)
        for plan in self._plans:
            q_rows = q[plan.q_lo : plan.q_hi]  # [n, Hq, D]
            k = _request_kv(k_cache, plan)  # [S, Hkv, D]
            v = _request_kv(v_cache, plan)
            if not plan.is_matmul:
                out[plan.q_lo : plan.q_hi] = grouped_sdpa(q_rows, k, v, plan.mask, scale)
                continue
            rows = group_query_rows(q_rows, num_kv_heads)  # [Hkv, group * n, D]
            scores = torch.bmm(rows, k.permute(1, 2, 0)).mul_(scale)  # [Hkv, group * n, S]
            if plan.mask is not None:
                scores.add_(plan.mask)
            o = torch.bmm(scores.softmax(-1), v.transpose(0, 1))
            out[plan.q_lo : plan.q_hi] = ungroup_query_rows(o, len(q_rows))
        return out


def plan_requests(
    meta: AttentionMetadata,
    *,
    block_size: int,
    num_kv_heads: int,
    group: int,
    dtype: torch.dtype = torch.float32,
    max_scores: int = 1 << 22,
    reads_views: bool = True,
) -> list[_RequestPlan]:
    """What every layer of one forward needs per request, computed once."""
    plans: list[_RequestPlan] = []
    for r, q_lo, q_hi, prefix in meta.requests_with_queries():
        num_kv = prefix + meta.tree_lens_host[r]
        num_blocks = (num_kv + block_size - 1) // block_size
        table = meta.block_tables[r, :num_blocks].tolist()
        first = table[0] if table else 0
        is_consecutive = reads_views and table == list(range(first, first + num_blocks))
        is_matmul = (
            dtype == torch.float32 and num_kv_heads * group * (q_hi - q_lo) * num_kv <= max_scores
        )
        mask = meta.visible(r)
        if mask is not None and is_matmul:  # additive, one row per query head of a group
            mask = torch.where(mask, 0.0, float("-inf")).repeat(group, 1)
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
                is_matmul=is_matmul,
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
