"""PyTorch reference implementations: tree attention over a paged cache and the KV commit.

Readable and exact; used on CPU and as the oracle the Triton kernels are tested against.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.attention_metadata import AttentionMetadata


def gather_request_kv(
    cache: torch.Tensor, block_table: torch.Tensor, num_tokens: int
) -> torch.Tensor:
    """Paged cache [num_blocks, block_size, Hkv, D] -> one request's [num_tokens, Hkv, D]."""
    block_size = cache.shape[1]
    num_blocks = (num_tokens + block_size - 1) // block_size
    blocks = block_table[:num_blocks].long()
    return cache.index_select(0, blocks).flatten(0, 1)[:num_tokens]


def tree_attention_reference(
    q: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:  # [T, Hq, D]
    out = torch.empty_like(q)
    for r, q_lo, q_hi, prefix in meta.requests_with_queries():
        num_kv = prefix + meta.tree_lens_host[r]
        k = gather_request_kv(k_cache, meta.block_tables[r], num_kv)
        v = gather_request_kv(v_cache, meta.block_tables[r], num_kv)
        # a lone new token sees everything: no mask, the fast SDPA path
        out[q_lo:q_hi] = grouped_sdpa(q[q_lo:q_hi], k, v, meta.visible(r), scale)
    return out


def group_query_rows(q: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """GQA without repeating KV: q [n, Hq, D] -> [Hkv, group * n, D], the query heads sharing a
    KV head becoming extra query rows (query head h reads KV head h // group, as in
    transformers); row g * n + i is token i of the group's head g."""
    n, num_heads, dim = q.shape
    group = num_heads // num_kv_heads
    return q.view(n, num_kv_heads, group, dim).permute(1, 2, 0, 3).reshape(num_kv_heads, -1, dim)


def ungroup_query_rows(o: torch.Tensor, n: int) -> torch.Tensor:
    """The inverse of `group_query_rows`: [Hkv, group * n, D] -> [n, Hq, D]."""
    num_kv_heads, rows, dim = o.shape
    group = rows // n
    return o.view(num_kv_heads, group, n, dim).permute(2, 0, 1, 3).reshape(n, -1, dim)


def grouped_sdpa(
    q: torch.Tensor,  # [n, Hq, D]
    k: torch.Tensor,  # [S, Hkv, D]
    v: torch.Tensor,
    mask: torch.Tensor | None,  # [n, S] bool or None
    scale: float,
) -> torch.Tensor:  # [n, Hq, D]
    """SDPA over grouped query rows (`group_query_rows`), the mask repeated for each group."""
    n, num_heads, _ = q.shape
    group = num_heads // k.shape[1]
    o = F.scaled_dot_product_attention(
        group_query_rows(q, k.shape[1]),  # [Hkv, group * n, D]
        k.transpose(0, 1),  # [Hkv, S, D]
        v.transpose(0, 1),
        attn_mask=None if mask is None else mask.repeat(group, 1),
        scale=scale,
    )
    return ungroup_query_rows(o, n)


def commit_kv_reference(
    k_cache: torch.Tensor,  # [L, num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    src_slots: torch.Tensor,  # [N] int64
    dst_slots: torch.Tensor,  # [N] int64
) -> None:
    """Move KV of accepted tree nodes to their committed slots, in every layer.

    Within one request the accepted path's source slots never precede their destinations, and
    a slot may be both a destination and (earlier) another copy's source; gathering all sources
    before scattering makes the overlap harmless.
    """
    if src_slots.numel() == 0:
        return
    for cache in (k_cache, v_cache):
        flat = cache.flatten(1, 2)  # [L, slots, Hkv, D]
        flat[:, dst_slots] = flat[:, src_slots].clone()
