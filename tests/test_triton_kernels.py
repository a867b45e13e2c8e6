"""The Triton tree-attention and KV-commit kernels against their PyTorch references.

Without CUDA the kernels run in Triton's interpreter (TRITON_INTERPRET=1, set before triton is
imported); with CUDA the same cases run on the GPU, plus the GPU-only large cases.
"""

from __future__ import annotations

import os
import random
from dataclasses import replace

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kernels.reference import commit_kv_reference, tree_attention_reference  # noqa: E402
from kernels.synthetic import (  # noqa: E402
    PagedBatch,
    RequestSpec,
    chain,
    make_paged_batch,
    mask_words,
    random_tree,
    star,
)
from kernels.triton_tree_attention import (  # noqa: E402
    build_work_plan,
    choose_kv_chunk,
    commit_kv_triton,
    launch_config,
    tree_attention_triton,
)

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
needs_gpu = pytest.mark.skipif(not CUDA, reason="needs a CUDA device (runs interpreted on CPU)")

# Kernel output vs the fp32 reference on the same (rounded) inputs: the output's own rounding.
TOLERANCES = {
    torch.float32: {"atol": 2e-5, "rtol": 1e-4},
    torch.float16: {"atol": 2e-3, "rtol": 2e-3},
    torch.bfloat16: {"atol": 1.6e-2, "rtol": 1.6e-2},
}


def tree(shape: str, n: int, seed: int = 0) -> tuple[int, ...]:
    rng = random.Random(seed)
    builders = {
        "chain": lambda: chain(n),
        "star": lambda: star(n),
        "random": lambda: random_tree(n, rng),
        "forest": lambda: random_tree(n, rng, roots=min(n, 3)),
    }
    return builders[shape]()


def batch(
    specs: list[RequestSpec],
    *,
    heads: tuple[int, int] = (4, 2),
    head_dim: int = 16,
    block_size: int = 16,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> PagedBatch:
    return make_paged_batch(
        specs,
        num_heads=heads[0],
        num_kv_heads=heads[1],
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
        device=DEVICE,
        seed=seed,
    )


def expected(b: PagedBatch) -> torch.Tensor:  # [T, Hq, D] fp32
    scale = b.q.shape[-1] ** -0.5
    return tree_attention_reference(
        b.q.float(), b.k_cache.float(), b.v_cache.float(), b.meta, scale
    )


def run_kernel(b: PagedBatch, **kwargs: int | None) -> torch.Tensor:
    return tree_attention_triton(b.q, b.k_cache, b.v_cache, b.meta, b.q.shape[-1] ** -0.5, **kwargs)


def assert_matches_reference(b: PagedBatch, out: torch.Tensor) -> None:
    assert out.dtype == b.q.dtype and out.shape == b.q.shape
    torch.testing.assert_close(out.float(), expected(b), **TOLERANCES[b.q.dtype])


# ---- tree attention ---------------------------------------------------------------------------


@pytest.mark.parametrize("shape", ["chain", "star", "random", "forest"])
@pytest.mark.parametrize("num_nodes", [1, 8, 64, 65, 130])
def test_tree_shapes(shape: str, num_nodes: int) -> None:
    b = batch([RequestSpec(37, tree(shape, num_nodes))])
    assert_matches_reference(b, run_kernel(b))


@pytest.mark.parametrize("prefix_len", [0, 1, 15, 16, 17, 63, 64, 65, 400])
@pytest.mark.parametrize("kv_chunk", [None, 64])
def test_prefix_lengths(prefix_len: int, kv_chunk: int | None) -> None:
    """Around cache-block (16) and tile (32) boundaries, and one long prefix, whole or split."""
    b = batch([RequestSpec(prefix_len, tree("random", 12, seed=prefix_len))])
    assert_matches_reference(b, run_kernel(b, block_n=32, kv_chunk=kv_chunk))


@pytest.mark.parametrize(
    ("heads", "head_dim"),
    [((4, 4), 16), ((4, 2), 32), ((8, 1), 16), ((6, 2), 24), ((12, 4), 64), ((32, 8), 16)],
)
def test_gqa_layouts(heads: tuple[int, int], head_dim: int) -> None:
    specs = [RequestSpec(20, tree("random", 9, seed=1)), RequestSpec(70, tree("star", 5))]
    b = batch(specs, heads=heads, head_dim=head_dim)
    assert_matches_reference(b, run_kernel(b))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("kv_chunk", [None, 32])
def test_dtypes(dtype: torch.dtype, kv_chunk: int | None) -> None:
    specs = [
        RequestSpec(0, tree("chain", 6)),
        RequestSpec(130, tree("random", 70, seed=2)),
        RequestSpec(45, tree("forest", 11, seed=3)),
    ]
    b = batch(specs, heads=(6, 2), head_dim=32, dtype=dtype)
    assert_matches_reference(b, run_kernel(b, block_n=32, kv_chunk=kv_chunk))


def test_many_requests_per_batch() -> None:
    rng = random.Random(7)
    shapes = ["chain", "star", "random", "forest"]
    specs = [
        RequestSpec(rng.randrange(0, 90), tree(rng.choice(shapes), rng.randrange(1, 20), seed=i))
        for i in range(24)
    ]
    b = batch(specs, heads=(8, 2), block_size=8)
    assert_matches_reference(b, run_kernel(b))
    assert_matches_reference(b, run_kernel(b, block_n=16, kv_chunk=32))


def test_queries_after_cached_tree_nodes() -> None:
    """A drafter growing its tree: earlier layers are cached, only the last nodes are queries."""
    specs = [
        RequestSpec(33, tree("random", 40, seed=4), query_len=8),
        RequestSpec(0, tree("chain", 10), query_len=1),
        RequestSpec(17, tree("star", 70), query_len=69),
        RequestSpec(5, tree("random", 6, seed=5), query_len=0),
    ]
    b = batch(specs)
    assert_matches_reference(b, run_kernel(b))
    assert_matches_reference(b, run_kernel(b, block_n=16, kv_chunk=16))


@pytest.mark.parametrize("kv_chunk", [16, 32, 48, 128])
def test_decomposition_merges_to_the_whole(kv_chunk: int) -> None:
    """Chunks of one long prefix, each its own program, merge back by log-sum-exp (Eq. 13)."""
    specs = [RequestSpec(300, tree("random", 20, seed=6)), RequestSpec(10, tree("chain", 3))]
    b = batch(specs, heads=(8, 2))
    cfg = launch_config(b.meta, 8, 2, DEVICE, block_n=16, kv_chunk=kv_chunk)
    plan = build_work_plan(b.meta, cfg, DEVICE)
    assert plan.num_merges == 20  # only the long request is split
    assert plan.num_partial_rows == 20 * -(-300 // kv_chunk)
    assert_matches_reference(b, run_kernel(b, block_n=16, kv_chunk=kv_chunk))


def test_one_long_request_is_decomposed_to_fill_the_gpu() -> None:
    """With a GPU's worth of target programs, the long prefix is split and the short ones not."""
    query_lens, kv_lens = [16] * 31 + [16], [150] * 31 + [8200]
    kwargs = {"block_q": 16, "block_n": 64, "num_kv_heads": 32, "target_programs": 264}
    chunk = choose_kv_chunk(query_lens, kv_lens, **kwargs)
    assert 150 <= chunk < 8200 and chunk % 64 == 0
    assert -(-8200 // chunk) >= 4
    # A batch that already fills the GPU with equal requests is left whole.
    assert choose_kv_chunk([16] * 64, [8200] * 64, **kwargs) == 0


def test_wrong_mask_is_caught() -> None:
    """The comparison the tests rely on fails when the kernel sees a corrupted ancestor mask."""
    b = batch([RequestSpec(3, chain(8)), RequestSpec(5, tree("star", 70))])
    assert_matches_reference(b, run_kernel(b))
    bad_masks = b.meta.tree_mask.clone()
    bad_masks[7, 0] &= ~1  # the chain's last node no longer sees its root
    bad_masks[20, 1] |= 1 << 2  # a star leaf sees an unrelated sibling (node 66)
    bad = replace(b.meta, tree_mask=bad_masks)
    out = tree_attention_triton(b.q, b.k_cache, b.v_cache, bad, b.q.shape[-1] ** -0.5)
    with pytest.raises(AssertionError):
        assert_matches_reference(b, out)


def test_mask_word_helper_sets_high_bits() -> None:
    words = mask_words([(1 << 63) | 1, 1 << 64], 2)
    assert words.tolist() == [[-(1 << 63) + 1, 0], [0, 1]]


# ---- KV commit ----------------------------------------------------------------------------------


def accepted_paths(
    tree_slots: list[list[int]], paths: list[list[int]]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Accepted path nodes -> (src, dst) slots, as the runner builds them (moved nodes only)."""
    src, dst = [], []
    for slots, path in zip(tree_slots, paths, strict=True):
        for k, node in enumerate(path):
            if node != k:
                src.append(slots[node])
                dst.append(slots[k])
    as_tensor = lambda xs: torch.tensor(xs, dtype=torch.int64, device=DEVICE)  # noqa: E731
    return as_tensor(src), as_tensor(dst)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_commit_matches_gather_then_scatter(dtype: torch.dtype) -> None:
    num_layers, num_blocks, block_size, heads, dim = 3, 12, 4, 2, 8
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    shape = (num_layers, num_blocks, block_size, heads, dim)
    k = torch.randn(shape, generator=gen, device=DEVICE).to(dtype)
    v = torch.randn(shape, generator=gen, device=DEVICE).to(dtype)
    # Trees spanning shuffled blocks; paths whose destinations are other pairs' sources.
    blocks = [[7, 2, 9], [4, 11], [0, 5, 3]]
    tree_slots = [[b * block_size + i for b in bl for i in range(block_size)] for bl in blocks]
    paths = [[0, 2, 3, 7, 8], [1, 2, 3, 4, 5, 6, 7], [0, 1, 2, 9]]
    src, dst = accepted_paths(tree_slots, paths)
    order = torch.randperm(src.numel(), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    src, dst = src[order], dst[order]
    k_ref, v_ref = k.clone(), v.clone()
    commit_kv_reference(k_ref, v_ref, src, dst)
    commit_kv_triton(k, v, src, dst)
    assert torch.equal(k, k_ref) and torch.equal(v, v_ref)


def test_commit_without_pairs_is_a_no_op() -> None:
    k = torch.randn(2, 3, 4, 1, 8, device=DEVICE)
    v, before = k.clone(), k.clone()
    empty = torch.empty(0, dtype=torch.int64, device=DEVICE)
    commit_kv_triton(k, v, empty, empty)
    assert torch.equal(k, before) and torch.equal(v, before)


# ---- the verifier's choice ----------------------------------------------------------------------


def test_runner_selects_the_kernel_on_cuda_only() -> None:
    from kernels.reference import commit_kv_reference as ref_commit
    from shared.model.runner import select_attention

    assert select_attention(torch.device("cuda")) == (tree_attention_triton, commit_kv_triton)
    from kernels.cpu_tree_attention import CpuTreeAttention

    cpu_attention, cpu_commit = select_attention(torch.device("cpu"))
    assert isinstance(cpu_attention, CpuTreeAttention) and cpu_commit is ref_commit


def test_runner_forward_with_the_kernel(tiny_target_dir) -> None:  # noqa: ANN001
    """The model's packed forward gives the same logits through the kernel as the reference."""
    from shared.model import load_model
    from shared.model.runner import ForwardItem, ModelRunner

    model = load_model(tiny_target_dir, device=DEVICE)
    runners = [
        ModelRunner(model, block_size=4, kv_memory_bytes=1 << 20, attention=attention)
        for attention in (tree_attention_reference, tree_attention_triton)
    ]
    logits = []
    for runner in runners:
        runner._commit_kv = commit_kv_triton  # the CUDA pairing, exercised on any device
        for rid in ("a", "b"):
            runner.add_request(rid)
        runner.prefill({"a": [5, 9, 13, 2, 7, 30], "b": [3, 4]})
        items = [ForwardItem("a", [11, 12, 13, 14], [-1, 0, 0, 1]), ForwardItem.chain("b", [8])]
        runner.forward(items)
        runner.commit({"a": [0, 1, 3], "b": [0]})
        logits.append(runner.forward([ForwardItem("a", [40, 41], [-1, 0])])[0])
    torch.testing.assert_close(logits[1], logits[0], atol=1e-4, rtol=1e-4)


# ---- GPU-only: real sizes -----------------------------------------------------------------------


@needs_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(
    ("num_requests", "prefix_len", "tree_len"), [(1, 8192, 128), (32, 1024, 64)]
)
def test_llama7b_layout_on_gpu(
    dtype: torch.dtype, num_requests: int, prefix_len: int, tree_len: int
) -> None:
    specs = [
        RequestSpec(prefix_len + 37 * r, tree("random", tree_len, seed=r))
        for r in range(num_requests)
    ]
    b = batch(specs, heads=(32, 32), head_dim=128, dtype=dtype)
    assert_matches_reference(b, run_kernel(b))
