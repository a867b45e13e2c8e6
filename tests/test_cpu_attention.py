"""The planned CPU tree attention against the PyTorch reference, and its plan's reuse."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch

from kernels.cpu_tree_attention import EXACT_ROWS, CpuTreeAttention, _request_kv, plan_requests
from kernels.reference import tree_attention_reference
from kernels.synthetic import PagedBatch, RequestSpec, chain, make_paged_batch, random_tree, star

TOLERANCES = {
    torch.float32: {"atol": 2e-5, "rtol": 1e-4},
    torch.bfloat16: {"atol": 1.6e-2, "rtol": 1.6e-2},
}


def batch(
    specs: list[RequestSpec],
    *,
    heads: tuple[int, int] = (9, 3),
    head_dim: int = 16,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    consecutive: bool = False,
) -> PagedBatch:
    b = make_paged_batch(
        specs,
        num_heads=heads[0],
        num_kv_heads=heads[1],
        head_dim=head_dim,
        block_size=16,
        dtype=dtype,
        seed=seed,
    )
    if consecutive:  # what the runner's allocator gives a request that had the pool to itself
        tables, start = b.meta.block_tables.clone(), 0
        for r in range(tables.shape[0]):
            n = int((tables[r] >= 0).sum())
            tables[r, :n] = torch.arange(start, start + n, dtype=torch.int32)
            start += n
        b = replace(b, meta=replace(b.meta, block_tables=tables))
    return b


def run(b: PagedBatch, attention: CpuTreeAttention | None = None) -> torch.Tensor:
    attention = attention or CpuTreeAttention()
    return attention(b.q, b.k_cache, b.v_cache, b.meta, b.q.shape[-1] ** -0.5)


def attention_like(attention: CpuTreeAttention) -> CpuTreeAttention:
    """A fresh attention with the same settings (plain decoding's runner)."""
    return CpuTreeAttention(attention.max_scores, exact_rows=attention.exact_rows)


def assert_matches_reference(b: PagedBatch, out: torch.Tensor) -> None:
    expected = tree_attention_reference(
        b.q.float(), b.k_cache.float(), b.v_cache.float(), b.meta, b.q.shape[-1] ** -0.5
    )
    assert out.dtype == b.q.dtype and out.shape == b.q.shape
    torch.testing.assert_close(out.float(), expected, **TOLERANCES[b.q.dtype])


@pytest.mark.parametrize("consecutive", [False, True])
@pytest.mark.parametrize(
    "parents",
    [
        chain(1),
        chain(5),
        star(9),
        random_tree(17, random.Random(1)),
        random_tree(70, random.Random(2), roots=3),
    ],
)
def test_trees_match_the_reference(parents: tuple[int, ...], consecutive: bool) -> None:
    b = batch([RequestSpec(37, parents)], consecutive=consecutive)
    assert_matches_reference(b, run(b))


def test_mixed_batch_with_cached_tree_nodes_and_empty_requests() -> None:
    """Decode tokens, a prompt chunk from position 0, a drafter's partial queries, and a
    request with no queries this forward, in one batch."""
    rng = random.Random(3)
    specs = [
        RequestSpec(256, chain(1)),
        RequestSpec(0, chain(40)),
        RequestSpec(33, random_tree(40, rng), query_len=8),
        RequestSpec(5, random_tree(6, rng), query_len=0),
        RequestSpec(17, star(70), query_len=69),
    ]
    for consecutive in (False, True):
        b = batch(specs, consecutive=consecutive, seed=4)
        assert_matches_reference(b, run(b))


@pytest.mark.parametrize("heads", [(4, 4), (8, 1), (9, 3), (12, 4)])
def test_grouped_query_layouts(heads: tuple[int, int]) -> None:
    b = batch(
        [RequestSpec(20, random_tree(9, random.Random(5))), RequestSpec(70, star(5))], heads=heads
    )
    assert_matches_reference(b, run(b))


def test_bfloat16_cache() -> None:
    b = batch(
        [RequestSpec(130, random_tree(30, random.Random(6))), RequestSpec(0, chain(6))],
        dtype=torch.bfloat16,
    )
    assert_matches_reference(b, run(b))


def one_token(b: PagedBatch, k: torch.Tensor, v: torch.Tensor, row: slice) -> PagedBatch:
    """A batch of one request whose one new token (query `b.q[row]`) has `k`, `v` [S, Hkv, D]
    as its whole context: what plain decoding attends for that token."""
    lone = batch([RequestSpec(len(k) - 1, chain(1))], heads=(b.q.shape[1], k.shape[1]),
                 head_dim=b.q.shape[2], dtype=b.q.dtype)  # fmt: skip
    blocks = lone.meta.block_tables[0]
    k_cache, v_cache = lone.k_cache.clone(), lone.v_cache.clone()
    for pos in range(len(k)):
        block, offset = int(blocks[pos // 16]), pos % 16
        k_cache[block, offset], v_cache[block, offset] = k[pos], v[pos]
    return replace(lone, q=b.q[row].clone(), k_cache=k_cache, v_cache=v_cache)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_exact_rows_attend_to_their_own_keys_as_one_token_does(dtype: torch.dtype) -> None:
    """With exact rows a tree attends row by row: each row's output is bitwise what a lone new
    token over the same keys gets (plain decoding's one-token forward, through the same kernel),
    whatever else the forward holds. Without (the default) it is one masked SDPA call per bf16
    request, two matmuls per fp32 one."""
    b = batch(
        [RequestSpec(70, random_tree(12, random.Random(8))), RequestSpec(20, chain(5))],
        dtype=dtype,
    )
    attention = CpuTreeAttention(exact_rows=EXACT_ROWS)
    out = run(b, attention)
    assert_matches_reference(b, out)
    assert all(p.row_keys is None for p in plan_requests(b.meta, block_size=16, num_kv_heads=3,
               group=3, dtype=dtype))  # fmt: skip
    for plan in attention._plans:
        assert plan.row_keys is not None and not plan.is_matmul
        k, v = (_request_kv(cache, plan) for cache in (b.k_cache, b.v_cache))
        seen = []
        for rows, keys in plan.row_keys:
            for i, row_keys in zip(rows.tolist(), keys, strict=True):
                row = slice(plan.q_lo + i, plan.q_lo + i + 1)
                alone = run(one_token(b, k[row_keys], v[row_keys], row), attention_like(attention))
                assert torch.equal(out[row], alone)
                seen.append(i)
        assert sorted(seen) == list(range(plan.q_hi - plan.q_lo))
    wide = batch([RequestSpec(10, chain(EXACT_ROWS + 1))], dtype=dtype)
    [plan] = plan_requests(
        wide.meta, block_size=16, num_kv_heads=3, group=3, dtype=dtype, exact_rows=EXACT_ROWS,
    )  # fmt: skip
    assert plan.row_keys is None  # a long prompt chunk stays one SDPA call


def test_long_chunks_take_sdpa_with_the_same_mask() -> None:
    b = batch([RequestSpec(64, chain(48)), RequestSpec(3, random_tree(20, random.Random(7)))])
    assert_matches_reference(b, run(b, CpuTreeAttention(max_scores=1)))


def test_plan_is_reused_within_a_forward_and_renewed_for_the_next() -> None:
    """Layers share one forward's plan; new metadata (the next forward) gets its own, so a
    corrupted mask in it is seen (the comparison can fail)."""
    attention = CpuTreeAttention()
    b = batch([RequestSpec(3, chain(8)), RequestSpec(5, star(12))])
    assert_matches_reference(b, run(b, attention))
    plans = attention._plans
    assert_matches_reference(b, run(b, attention))
    assert attention._plans is plans
    bad_masks = b.meta.tree_mask.clone()
    bad_masks[7, 0] &= ~1  # the chain's last node no longer sees its root
    bad = replace(b, meta=replace(b.meta, tree_mask=bad_masks))
    with pytest.raises(AssertionError):
        assert_matches_reference(b, run(bad, attention))


def test_consecutive_blocks_are_viewed_not_gathered() -> None:
    b = batch([RequestSpec(40, chain(3)), RequestSpec(10, chain(1))], consecutive=True)
    plans = plan_requests(b.meta, block_size=16, num_kv_heads=3, group=3)
    assert [p.blocks for p in plans] == [None, None]
    assert [p.first_block for p in plans] == [0, 3]
    assert plans[0].is_matmul and plans[0].mask is not None and plans[0].mask.shape == (9, 43)
    assert plans[1].mask is None  # one new token sees its whole context
    shuffled = batch([RequestSpec(40, chain(3))])
    [plan] = plan_requests(shuffled.meta, block_size=16, num_kv_heads=3, group=3)
    assert plan.first_block is None and plan.blocks is not None
    # gathering what could be viewed (as the CPU attention benchmark does to measure views)
    # reads the same KV
    gathering = CpuTreeAttention(reads_views=False)
    torch.testing.assert_close(run(b, gathering), run(b), rtol=0, atol=0)
    assert all(p.blocks is not None for p in gathering._plans)


def test_sdpa_requests_keep_only_the_compact_mask() -> None:
    """Long chunks and other dtypes go through SDPA: their plan holds the [n, num_kv] boolean
    mask, not the fp32 one repeated for every query head of a group."""
    b = batch([RequestSpec(64, chain(48))])
    [big] = plan_requests(b.meta, block_size=16, num_kv_heads=3, group=3, max_scores=1)
    [half] = plan_requests(b.meta, block_size=16, num_kv_heads=3, group=3, dtype=torch.bfloat16)
    for plan in (big, half):
        assert not plan.is_matmul
        assert plan.mask is not None and plan.mask.dtype == torch.bool
        assert plan.mask.shape == (48, 112)


def test_strided_queries_as_the_model_passes_them() -> None:
    """The model hands attention q as a slice of its fused projection (rows strided)."""
    b = batch([RequestSpec(30, random_tree(12, random.Random(8))), RequestSpec(7, chain(1))])
    fused = torch.cat([b.q.flatten(1), torch.randn(b.q.shape[0], 40)], dim=1)
    strided = fused[:, : b.q[0].numel()].view_as(b.q)
    assert not strided.is_contiguous()
    attention = CpuTreeAttention()
    out = attention(strided, b.k_cache, b.v_cache, b.meta, b.q.shape[-1] ** -0.5)
    assert_matches_reference(b, out)
