"""Triton kernels for the verifier: tree attention over a packed, paged batch, and the KV commit.

Tree attention (`tree_attention_triton`, same contract as `tree_attention_reference`):

- One program per *work item* and KV head. A work item is one tile of a request's queries and one
  chunk of its KV. The tile packs `BLOCK_Q` query tokens times the `GROUP` query heads that share
  the KV head (GQA), so every K/V tile is read once per group, not once per query head.
- Request decomposition (Spin §V-A, Eq. 13): a long prefix is cut into chunks that run in separate
  programs, so a batch holding one long request still fills the GPU. Each chunk writes its
  normalized partial output and log-sum-exp; a second small kernel merges the chunks of a query
  by log-sum-exp, which restores the request-wide softmax denominator of Eq. 13. Requests that fit
  in one chunk skip the merge and write the output directly.
- Inside a program: online softmax over the chunk's prefix tiles (visible to every query), then
  over the tree region's tiles, masked by the per-node ancestor bitmask (int64 words, any number
  of nodes). The last chunk of a request carries the tree region, so every chunk has at least one
  visible key for every real query.

KV commit (`commit_kv_triton`, same contract as `commit_kv_reference`): one program per layer and
slice of the Hkv*D features gathers every source slot of its slice into a scratch buffer, waits
on a barrier, then scatters to the destinations. This is exactly gather-all-then-scatter, so a
destination that is also another pair's source is harmless whatever the order of the pairs.
"""

from __future__ import annotations

import math
import os
import weakref
from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl

from kernels.attention_metadata import MASK_WORD_BITS, AttentionMetadata, FixedLaunch

LOG2E = 1.4426950408889634
MIN_KV_CHUNK = 256  # shorter chunks cost more in the merge than they win in parallelism
PROGRAMS_PER_SM = 2
MAX_BLOCK_M = 128  # a 128-node tree reads each KV tile once
DEFAULT_BLOCK_N = 64
COMMIT_BLOCK_F = 1024

# One work item, a row of the int32 work table (read by position in the kernel):
#   request, first packed query token of the tile, end of the request's packed queries,
#   first and end prefix token of the chunk, the request's prefix length (its tree's start),
#   end of the tree tokens the tile can see (== prefix length when the chunk has no tree),
#   split flag (1: write a partial for the merge), partial row base (row = base + query token).
NUM_WORK_FIELDS = 9


def interpreting() -> bool:
    """True under TRITON_INTERPRET=1, where kernels run on CPU through numpy."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


# ---- the attention kernel -------------------------------------------------------------------


@triton.jit
def _load_kv_tile(
    cache_ptr,
    block_tables_ptr,
    req,
    kv_head,
    cols,  # [BLOCK_N] logical token indices of the request
    col_ok,
    dims,
    dim_ok,
    stride_bt,
    stride_cb,
    stride_cs,
    stride_ch,
    CACHE_BLOCK: tl.constexpr,
):  # -> [BLOCK_N, HEAD_DIM_PAD]
    block = tl.load(block_tables_ptr + req * stride_bt + cols // CACHE_BLOCK, mask=col_ok, other=0)
    slot_base = block.to(tl.int64) * stride_cb + (cols % CACHE_BLOCK).to(tl.int64) * stride_cs
    ptrs = cache_ptr + slot_base[:, None] + kv_head * stride_ch + dims[None, :]
    return tl.load(ptrs, mask=col_ok[:, None] & dim_ok[None, :], other=0.0)


@triton.jit
def _online_softmax_step(
    acc,  # [BLOCK_M, HEAD_DIM_PAD] fp32
    m_i,  # [BLOCK_M] fp32, running max in the log2 domain
    l_i,  # [BLOCK_M] fp32, running denominator
    q,  # [BLOCK_M, HEAD_DIM_PAD]
    k,  # [BLOCK_N, HEAD_DIM_PAD]
    v,  # [BLOCK_N, HEAD_DIM_PAD]
    visible,  # broadcastable to [BLOCK_M, BLOCK_N]
    qk_scale,
    DOT_PRECISION: tl.constexpr,
):
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
    s = tl.where(visible, s, float("-inf"))
    # m_i starts finite, so a row with nothing visible yet keeps alpha = 1 and p = 0 (no NaN).
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.math.exp2(m_i - m_new)
    p = tl.math.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    pv = tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return acc * alpha[:, None] + pv, m_new, l_i


@triton.jit
def _tree_attention_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    part_o_ptr,
    part_lse_ptr,
    block_tables_ptr,
    tree_mask_ptr,
    work_ptr,
    qk_scale,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_ks,
    stride_kh,
    stride_vb,
    stride_vs,
    stride_vh,
    stride_ot,
    stride_oh,
    stride_pt,
    stride_ph,
    stride_lt,
    stride_bt,
    stride_mt,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    CACHE_BLOCK: tl.constexpr,
    NUM_FIELDS: tl.constexpr,
    WORD_BITS: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    work = work_ptr + tl.program_id(0) * NUM_FIELDS
    kv_head = tl.program_id(1)
    req = tl.load(work + 0)
    q_lo = tl.load(work + 1)
    q_hi = tl.load(work + 2)
    kv_lo = tl.load(work + 3)
    prefix_hi = tl.load(work + 4)
    prefix_len = tl.load(work + 5)
    tree_hi = tl.load(work + 6)
    split = tl.load(work + 7)
    part_base = tl.load(work + 8)

    # Row r of the tile is query token q_lo + r // GROUP_PAD, head r % GROUP_PAD of the group.
    rows = tl.arange(0, BLOCK_M)
    tok = q_lo + rows // GROUP_PAD
    head = kv_head * GROUP + rows % GROUP_PAD
    row_ok = (tok < q_hi) & (rows % GROUP_PAD < GROUP)
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_ok = dims < HEAD_DIM
    tok64 = tok.to(tl.int64)

    q_ptrs = q_ptr + tok64[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :]
    q = tl.load(q_ptrs, mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)

    # Prefix tiles: every query sees every committed token.
    for start in range(kv_lo, prefix_hi, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        col_ok = cols < prefix_hi
        k = _load_kv_tile(
            k_ptr, block_tables_ptr, req, kv_head, cols, col_ok, dims, dim_ok,
            stride_bt, stride_kb, stride_ks, stride_kh, CACHE_BLOCK,
        )  # fmt: skip
        v = _load_kv_tile(
            v_ptr, block_tables_ptr, req, kv_head, cols, col_ok, dims, dim_ok,
            stride_bt, stride_vb, stride_vs, stride_vh, CACHE_BLOCK,
        )  # fmt: skip
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        acc, m_i, l_i = _online_softmax_step(
            acc, m_i, l_i, q, k, v, col_ok[None, :], qk_scale, DOT_PRECISION
        )

    # Tree tiles: bit j of a query's mask words says whether it sees tree node j.
    for start in range(prefix_len, tree_hi, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        col_ok = cols < tree_hi
        node = cols - prefix_len
        word_ptrs = tree_mask_ptr + tok64[:, None] * stride_mt + (node // WORD_BITS)[None, :]
        words = tl.load(word_ptrs, mask=row_ok[:, None] & col_ok[None, :], other=0)
        bits = (words >> (node % WORD_BITS).to(tl.int64)[None, :]) & 1
        k = _load_kv_tile(
            k_ptr, block_tables_ptr, req, kv_head, cols, col_ok, dims, dim_ok,
            stride_bt, stride_kb, stride_ks, stride_kh, CACHE_BLOCK,
        )  # fmt: skip
        v = _load_kv_tile(
            v_ptr, block_tables_ptr, req, kv_head, cols, col_ok, dims, dim_ok,
            stride_bt, stride_vb, stride_vs, stride_vh, CACHE_BLOCK,
        )  # fmt: skip
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        acc, m_i, l_i = _online_softmax_step(
            acc, m_i, l_i, q, k, v, bits != 0, qk_scale, DOT_PRECISION
        )

    l_safe = tl.where(l_i > 0.0, l_i, 1.0)  # padding rows only
    o = acc / l_safe[:, None]
    io_mask = row_ok[:, None] & dim_ok[None, :]
    if split != 0:
        prow = (part_base + tok).to(tl.int64)
        po_ptrs = part_o_ptr + prow[:, None] * stride_pt + head[:, None] * stride_ph + dims[None, :]
        tl.store(po_ptrs, o, mask=io_mask)
        tl.store(part_lse_ptr + prow * stride_lt + head, m_i + tl.math.log2(l_safe), mask=row_ok)
    else:
        o_ptrs = out_ptr + tok64[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :]
        tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=io_mask)


@triton.jit
def _merge_partials_kernel(
    out_ptr,
    part_o_ptr,
    part_lse_ptr,
    merge_ptr,
    stride_ot,
    stride_oh,
    stride_pt,
    stride_ph,
    stride_lt,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """Eq. 13: combine one query token's chunk partials by log-sum-exp (log2 domain)."""
    entry = merge_ptr + tl.program_id(0) * 4
    tok = tl.load(entry + 0).to(tl.int64)
    row0 = tl.load(entry + 1)
    num_splits = tl.load(entry + 2)
    split_stride = tl.load(entry + 3)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    head_ok = heads < NUM_HEADS
    dims = tl.arange(0, HEAD_DIM_PAD)
    io_mask = head_ok[:, None] & (dims < HEAD_DIM)[None, :]

    m = tl.full([BLOCK_H], -1.0e30, dtype=tl.float32)
    denom = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, HEAD_DIM_PAD], dtype=tl.float32)
    for s in range(num_splits):
        row = (row0 + s * split_stride).to(tl.int64)
        lse = tl.load(part_lse_ptr + row * stride_lt + heads, mask=head_ok, other=-1.0e30)
        o_ptrs = part_o_ptr + row * stride_pt + heads[:, None] * stride_ph + dims[None, :]
        o = tl.load(o_ptrs, mask=io_mask, other=0.0)
        m_new = tl.maximum(m, lse)
        alpha = tl.math.exp2(m - m_new)
        beta = tl.math.exp2(lse - m_new)
        acc = acc * alpha[:, None] + o * beta[:, None]
        denom = denom * alpha + beta
        m = m_new
    out = acc / denom[:, None]
    o_ptrs = out_ptr + tok * stride_ot + heads[:, None] * stride_oh + dims[None, :]
    tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty), mask=io_mask)


# ---- host side: launch configuration and the work plan --------------------------------------


@dataclass(frozen=True)
class LaunchConfig:
    group: int  # query heads per KV head
    group_pad: int  # group rounded up to a power of two
    block_m: int  # tile rows: block_m // group_pad query tokens times group_pad heads
    block_n: int  # KV tokens per inner-loop tile
    kv_chunk: int  # prefix tokens per chunk (a multiple of block_n); 0 = never split

    @property
    def block_q(self) -> int:
        return self.block_m // self.group_pad


@dataclass(frozen=True)
class WorkPlan:
    items: torch.Tensor  # [num_items, NUM_WORK_FIELDS] int32
    merges: torch.Tensor  # [num_merges, 4] int32: token, first partial row, splits, row stride
    num_partial_rows: int

    @property
    def num_items(self) -> int:
        return self.items.shape[0]

    @property
    def num_merges(self) -> int:
        return self.merges.shape[0]


def choose_kv_chunk(
    query_lens: list[int],
    kv_lens: list[int],
    *,
    block_q: int,
    block_n: int,
    num_kv_heads: int,
    target_programs: int,
    min_chunk: int = MIN_KV_CHUNK,
) -> int:
    """Prefix chunk length so the batch's KV reads spread over about `target_programs` programs.

    The total KV work (tokens read per KV head, summed over query tiles) divided by the target
    bounds the work of one program; a request longer than that is decomposed, the rest are not.
    Returns 0 when nothing needs splitting.
    """
    work = sum(
        math.ceil(n / block_q) * kv for n, kv in zip(query_lens, kv_lens, strict=True) if n > 0
    )
    per_program = math.ceil(work * num_kv_heads / max(1, target_programs))
    chunk = max(min_chunk, math.ceil(per_program / block_n) * block_n)
    longest = max((kv for n, kv in zip(query_lens, kv_lens, strict=True) if n > 0), default=0)
    return chunk if chunk < longest else 0


def _target_programs(device: torch.device) -> int:
    if device.type == "cuda":
        return PROGRAMS_PER_SM * torch.cuda.get_device_properties(device).multi_processor_count
    return 1  # the interpreter runs programs one after another: splitting only adds work


def launch_config(
    meta: AttentionMetadata,
    num_heads: int,
    num_kv_heads: int,
    device: torch.device,
    *,
    block_n: int | None = None,
    kv_chunk: int | None = None,
) -> LaunchConfig:
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads are not a multiple of {num_kv_heads} KV heads")
    group = num_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    qs = meta.query_start_host
    query_lens = [qs[r + 1] - qs[r] for r in range(meta.num_requests)]
    rows = triton.next_power_of_2(max(query_lens) * group_pad)
    block_m = max(group_pad, min(MAX_BLOCK_M, max(16, rows)))
    block_n = block_n or DEFAULT_BLOCK_N
    if block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"block_n must be a power of two >= 16, got {block_n}")
    if kv_chunk is None:
        kv_chunk = choose_kv_chunk(
            query_lens,
            [p + t for p, t in zip(meta.prefix_lens_host, meta.tree_lens_host, strict=True)],
            block_q=block_m // group_pad,
            block_n=block_n,
            num_kv_heads=num_kv_heads,
            target_programs=_target_programs(device),
        )
    elif kv_chunk % block_n:
        raise ValueError(f"kv_chunk {kv_chunk} is not a multiple of block_n {block_n}")
    return LaunchConfig(group, group_pad, block_m, block_n, kv_chunk)


def _prefix_chunks(prefix_len: int, kv_chunk: int) -> list[tuple[int, int]]:
    """[lo, hi) prefix ranges of a request's chunks; the last one also carries the tree."""
    if kv_chunk <= 0 or prefix_len <= kv_chunk:
        return [(0, prefix_len)]
    return [(lo, min(lo + kv_chunk, prefix_len)) for lo in range(0, prefix_len, kv_chunk)]


def fixed_block_m(max_tokens: int, num_heads: int, num_kv_heads: int) -> int:
    """Tile rows of a fixed launch for forwards of up to `max_tokens` tokens, whatever their
    split over requests: 64 rows, that is 64 / (the GQA group rounded up to a power of two) query
    tokens a tile (16 with groups of 3-4, 64 without GQA), fewer for smaller forwards. A request's
    queries read its KV once per tile; a tile of one request's single query wastes rows, not
    memory traffic."""
    group_pad = triton.next_power_of_2(num_heads // num_kv_heads)
    block_q = min(triton.next_power_of_2(max_tokens), max(1, 64 // group_pad))
    return max(16, group_pad, block_q * group_pad)


def fixed_launch_config(block_m: int, num_heads: int, num_kv_heads: int) -> LaunchConfig:
    """The launch of a fixed work table: tiles of `block_m` rows, no prefix decomposition."""
    group = num_heads // num_kv_heads
    return LaunchConfig(group, triton.next_power_of_2(group), block_m, DEFAULT_BLOCK_N, 0)


def fixed_work_rows(
    max_tokens: int, max_requests: int, block_m: int, num_heads: int, num_kv_heads: int
) -> int:
    """Rows a fixed launch's work table needs for any batch of up to `max_tokens` tokens over up
    to `max_requests` requests: each request's tiles, at most ceil(tokens / tile) plus one per
    request (every spare row is still a program per KV head, so the table is kept short)."""
    block_q = fixed_launch_config(block_m, num_heads, num_kv_heads).block_q
    return min(max_tokens, -(-max_tokens // block_q) + max_requests)


def fixed_work_items(meta: AttentionMetadata, block_m: int, num_heads: int, num_kv_heads: int):
    """The work table of a fixed launch for this batch (host lists only): [num_items,
    NUM_WORK_FIELDS] int32, at most `fixed_work_rows` rows. Rows past it are zeros: a tile of
    no queries and no keys, which writes nothing."""
    cfg = fixed_launch_config(block_m, num_heads, num_kv_heads)
    items, _, _ = _work_items(meta, cfg)
    return np.asarray(items, dtype=np.int32).reshape(-1, NUM_WORK_FIELDS)


def build_work_plan(meta: AttentionMetadata, cfg: LaunchConfig, device: torch.device) -> WorkPlan:
    """Decompose the batch into (query tile, KV chunk) work items and the merges they need."""
    items, merges, part_rows = _work_items(meta, cfg)
    item_t = torch.tensor(items, dtype=torch.int32).reshape(-1, NUM_WORK_FIELDS)
    merge_t = torch.tensor(merges, dtype=torch.int32).reshape(-1, 4)
    return WorkPlan(item_t.to(device), merge_t.to(device), part_rows)


def _work_items(
    meta: AttentionMetadata, cfg: LaunchConfig
) -> tuple[list[list[int]], list[list[int]], int]:
    items: list[list[int]] = []
    merges: list[list[int]] = []
    part_rows = 0
    qs = meta.query_start_host
    for r in range(meta.num_requests):
        q_start, q_end = qs[r], qs[r + 1]
        n = q_end - q_start
        if n == 0:
            continue
        prefix, tree = meta.prefix_lens_host[r], meta.tree_lens_host[r]
        chunks = _prefix_chunks(prefix, cfg.kv_chunk)
        split = len(chunks) > 1
        first_query_node = tree - n  # queries are the last n nodes of the tree region
        for tile_lo in range(0, n, cfg.block_q):
            # A query never sees a later node, so the tile reads the tree up to its last query.
            tree_hi = prefix + first_query_node + min(n, tile_lo + cfg.block_q)
            for c, (lo, hi) in enumerate(chunks):
                last = c == len(chunks) - 1
                part_base = part_rows + c * n - q_start if split else 0
                items.append(
                    [r, q_start + tile_lo, q_end, lo, hi, prefix]
                    + [tree_hi if last else prefix, int(split), part_base]
                )
        if split:
            merges.extend([q_start + i, part_rows + i, len(chunks), n] for i in range(n))
            part_rows += len(chunks) * n
    return items, merges, part_rows


# The model calls attention once per layer with the same metadata: plan once per forward.
_plan_cache: list[tuple[weakref.ReferenceType[AttentionMetadata], LaunchConfig, WorkPlan]] = []


def _cached_plan(meta: AttentionMetadata, cfg: LaunchConfig, device: torch.device) -> WorkPlan:
    if _plan_cache:
        ref, cached_cfg, plan = _plan_cache[0]
        if ref() is meta and cached_cfg == cfg and plan.items.device == device:
            return plan
    plan = build_work_plan(meta, cfg, device)
    _plan_cache[:] = [(weakref.ref(meta), cfg, plan)]
    return plan


def _fixed_plan(
    fixed: FixedLaunch, num_heads: int, num_kv_heads: int
) -> tuple[LaunchConfig, WorkPlan]:
    cfg = fixed_launch_config(fixed.block_m, num_heads, num_kv_heads)
    no_merges = torch.empty(0, 4, dtype=torch.int32, device=fixed.items.device)
    return cfg, WorkPlan(fixed.items, no_merges, 0)


def _check_last_dim_contiguous(**tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        if t.stride(-1) != 1:
            raise ValueError(f"{name} must be contiguous in its last dimension")


def tree_attention_triton(
    q: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    meta: AttentionMetadata,
    scale: float,
    *,
    block_n: int | None = None,
    kv_chunk: int | None = None,
) -> torch.Tensor:  # [T, Hq, D]
    """Tree attention over a packed batch; `kv_chunk` forces the prefix decomposition."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    out = torch.empty_like(q)
    if num_tokens == 0:
        return out
    _check_last_dim_contiguous(q=q, k_cache=k_cache, v_cache=v_cache)
    if meta.fixed_launch is not None:
        cfg, plan = _fixed_plan(meta.fixed_launch, num_heads, num_kv_heads)
    else:
        cfg = launch_config(
            meta, num_heads, num_kv_heads, q.device, block_n=block_n, kv_chunk=kv_chunk
        )
        plan = _cached_plan(meta, cfg, q.device)
    part_o = torch.empty(
        plan.num_partial_rows, num_heads, head_dim, dtype=torch.float32, device=q.device
    )
    part_lse = torch.empty(plan.num_partial_rows, num_heads, dtype=torch.float32, device=q.device)
    # The interpreter mishandles bf16 tl.dot: compute in fp32 there. fp32 inputs get exact
    # (non-TF32) products so they match the reference closely.
    upcast = interpreting() and q.dtype == torch.bfloat16
    precision = "ieee" if upcast or q.dtype == torch.float32 else "tf32"
    head_dim_pad = max(16, triton.next_power_of_2(head_dim))
    tree_mask = meta.tree_mask
    block_tables = meta.block_tables
    _tree_attention_kernel[(plan.num_items, num_kv_heads)](
        q, k_cache, v_cache, out, part_o, part_lse, block_tables, tree_mask, plan.items,
        scale * LOG2E,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        out.stride(0), out.stride(1),
        part_o.stride(0), part_o.stride(1), part_lse.stride(0),
        block_tables.stride(0), tree_mask.stride(0),
        HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad,
        GROUP=cfg.group, GROUP_PAD=cfg.group_pad,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, CACHE_BLOCK=k_cache.shape[1],
        NUM_FIELDS=NUM_WORK_FIELDS, WORD_BITS=MASK_WORD_BITS,
        UPCAST=upcast, DOT_PRECISION=precision,
        num_warps=8 if cfg.block_m >= 128 else 4,
    )  # fmt: skip
    if plan.num_merges:
        block_h = min(16, triton.next_power_of_2(num_heads))
        _merge_partials_kernel[(plan.num_merges, triton.cdiv(num_heads, block_h))](
            out, part_o, part_lse, plan.merges,
            out.stride(0), out.stride(1), part_o.stride(0), part_o.stride(1), part_lse.stride(0),
            NUM_HEADS=num_heads, HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad, BLOCK_H=block_h,
        )  # fmt: skip
    return out


# ---- the KV commit --------------------------------------------------------------------------


@triton.jit
def _commit_kv_kernel(
    k_ptr,
    v_ptr,
    scratch_ptr,
    src_ptr,
    dst_ptr,
    num_pairs,
    stride_layer,
    stride_slot,
    FEATURES: tl.constexpr,
    BLOCK_F: tl.constexpr,
):
    layer = tl.program_id(0).to(tl.int64)
    feats = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
    ok = feats < FEATURES
    k_layer = k_ptr + layer * stride_layer
    v_layer = v_ptr + layer * stride_layer
    scratch = scratch_ptr + layer * 2 * num_pairs * FEATURES
    for i in range(num_pairs):
        src = tl.load(src_ptr + i) * stride_slot
        tl.store(scratch + i * FEATURES + feats, tl.load(k_layer + src + feats, mask=ok), mask=ok)
        v = tl.load(v_layer + src + feats, mask=ok)
        tl.store(scratch + (num_pairs + i) * FEATURES + feats, v, mask=ok)
    # Every source of this feature slice is saved before any destination is written.
    tl.debug_barrier()
    for i in range(num_pairs):
        dst = tl.load(dst_ptr + i) * stride_slot
        k = tl.load(scratch + i * FEATURES + feats, mask=ok)
        tl.store(k_layer + dst + feats, k, mask=ok)
        v = tl.load(scratch + (num_pairs + i) * FEATURES + feats, mask=ok)
        tl.store(v_layer + dst + feats, v, mask=ok)


def _check_cache_layout(cache: torch.Tensor) -> None:
    _, _, block_size, num_kv_heads, head_dim = cache.shape
    if not (
        cache.stride(4) == 1
        and cache.stride(3) == head_dim
        and cache.stride(2) == num_kv_heads * head_dim
        and cache.stride(1) == block_size * cache.stride(2)
    ):
        raise ValueError("the KV cache must be contiguous past its layer dimension")


def commit_kv_triton(
    k_cache: torch.Tensor,  # [L, num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    src_slots: torch.Tensor,  # [N] int64
    dst_slots: torch.Tensor,  # [N] int64
) -> None:
    """Move the accepted nodes' KV to their committed slots in every layer, gather-then-scatter."""
    num_pairs = src_slots.numel()
    if num_pairs == 0:
        return
    if k_cache.shape != v_cache.shape or k_cache.stride() != v_cache.stride():
        raise ValueError("k_cache and v_cache must share shape and layout")
    _check_cache_layout(k_cache)
    num_layers = k_cache.shape[0]
    features = k_cache.shape[3] * k_cache.shape[4]
    scratch = torch.empty(
        num_layers, 2, num_pairs, features, dtype=k_cache.dtype, device=k_cache.device
    )
    block_f = min(COMMIT_BLOCK_F, triton.next_power_of_2(features))
    _commit_kv_kernel[(num_layers, triton.cdiv(features, block_f))](
        k_cache, v_cache, scratch,
        src_slots.to(torch.int64).contiguous(), dst_slots.to(torch.int64).contiguous(),
        num_pairs, k_cache.stride(0), k_cache.stride(2),
        FEATURES=features, BLOCK_F=block_f,
    )  # fmt: skip
