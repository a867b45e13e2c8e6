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

With `exact_rows` (`ModelRunner(exact_attention=True)`, `AUGURY_ENGINE__EXACT_ATTENTION`), a
request of 2 to `EXACT_ROWS` new tokens attends row by row instead, each query against
exactly the keys it sees, in position order, and no request takes the fp32 matmuls. SDPA's
sums over keys round differently when a row's keys sit among masked ones (a longer key axis,
another blocking), and in bf16 that rounding can flip a near-tie between two tokens, as it can
in an int8 target, whose per-token activation scales turn a last-bit difference into a
quantization step; one row over its own keys is what plain decoding computes for that token,
so verification agrees with it bit for bit (with the batch-invariant linear kernels of
`shared/model/linear.py`, or the int8 target's exact integer products).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels.attention_metadata import AttentionMetadata
from kernels.reference import group_query_rows, grouped_sdpa, ungroup_query_rows

# With exact attention, requests of up to this many new tokens go row by row: the default
# step budget (`max_tokens_per_step`), so every tree does (a copy draft's can pass 64 nodes).
EXACT_ROWS = 512


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
    # row by row (exact, 2 to EXACT_ROWS new tokens), rows seeing equally many keys together:
    # (their query rows [r], the key positions each sees [r, keys])
    row_keys: tuple[tuple[torch.Tensor, torch.Tensor], ...] | None = None


class CpuTreeAttention:
    """One per model runner; callable as an `AttentionFn`. It remembers the plan of the last
    forward's metadata (by identity: the runner builds new metadata for every forward)."""

    def __init__(
        self, max_scores: int = 1 << 22, *, reads_views: bool = True, exact_rows: int = 0
    ) -> None:
        self.max_scores = max_scores
        self.exact_rows = exact_rows  # requests of up to this many new tokens: row by row
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
                exact_rows=self.exact_rows,
            )
            self._meta = meta
        out = torch.empty_like(q)
        for plan in self._plans:
            q_rows = q[plan.q_lo : plan.q_hi]  # [n, Hq, D]
            k = _request_kv(k_cache, plan)  # [S, Hkv, D]
            v = _request_kv(v_cache, plan)
            if plan.row_keys is not None:
                for rows, keys in plan.row_keys:
                    out[plan.q_lo + rows] = _rows_alone(q_rows[rows], k[keys], v[keys], scale)
                continue
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
    exact_rows: int = 0,
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
            dtype == torch.float32
            and not exact_rows  # exact: single tokens through SDPA too, as tree rows go
            and num_kv_heads * group * (q_hi - q_lo) * num_kv <= max_scores
        )
        mask = meta.visible(r)
        row_keys = None
        if mask is not None and len(mask) <= exact_rows:
            row_keys = _rows_by_key_count(mask)
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
                row_keys=row_keys,
            )
        )
    return plans


def _rows_by_key_count(mask: torch.Tensor) -> tuple[tuple[torch.Tensor, torch.Tensor], ...]:
    """Rows of a [n, num_kv] visibility mask grouped by how many keys they see (a tree's depth):
    per group, its row indices and each row's visible key positions in order."""
    counts = mask.sum(1)
    groups = []
    for count in counts.unique().tolist():
        rows = (counts == count).nonzero().squeeze(1)
        keys = mask[rows].nonzero()[:, 1].view(len(rows), count)
        groups.append((rows, keys))
    return tuple(groups)


def _rows_alone(
    q: torch.Tensor,  # [r, Hq, D]
    k: torch.Tensor,  # [r, S, Hkv, D]: each row's own keys
    v: torch.Tensor,
    scale: float,
) -> torch.Tensor:  # [r, Hq, D]
    """Each query row over its own keys, bitwise as `grouped_sdpa` attends one new token (no
    mask): the same 3-D SDPA call with (row, KV head) pairs as its leading dimension. (A 4-D
    call would take another kernel, which rounds differently.)"""
    r, num_heads, dim = q.shape
    num_kv_heads, keys = k.shape[2], k.shape[1]
    group = num_heads // num_kv_heads
    o = F.scaled_dot_product_attention(
        q.reshape(r * num_kv_heads, group, dim),
        k.transpose(1, 2).reshape(r * num_kv_heads, keys, dim),
        v.transpose(1, 2).reshape(r * num_kv_heads, keys, dim),
        scale=scale,
    )
    return o.view(r, num_heads, dim)


def _request_kv(cache: torch.Tensor, plan: _RequestPlan) -> torch.Tensor:  # [num_kv, Hkv, D]
    if plan.blocks is None:
        assert plan.first_block is not None
        blocks = cache[plan.first_block : plan.first_block + plan.num_blocks]
    else:
        blocks = cache.index_select(0, plan.blocks)
    return blocks.flatten(0, 1)[: plan.num_kv]
