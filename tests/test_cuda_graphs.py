"""CUDA-graph forwards: the fixed attention launch, the padded static buffers and the replays.

Without CUDA, the fixed launch runs in Triton's interpreter and the runner's static-buffer
forward runs unrecorded (`record_graphs=False`): everything a graph replays except the recording
itself is checked against the eager forward. With CUDA, the recorded graphs are checked the same
way, and the engine's greedy output with them against plain decoding.
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kernels.attention_metadata import FixedLaunch  # noqa: E402
from kernels.reference import tree_attention_reference  # noqa: E402
from kernels.synthetic import RequestSpec, chain, make_paged_batch, random_tree  # noqa: E402
from kernels.triton_tree_attention import (  # noqa: E402
    fixed_block_m,
    fixed_work_items,
    fixed_work_rows,
    tree_attention_triton,
)
from shared.engine.drafting import Drafter  # noqa: E402
from shared.engine.spec_engine import SpecEngine  # noqa: E402
from shared.engine.verifier import Verifier  # noqa: E402
from shared.model import load_model  # noqa: E402
from shared.model.cuda_graphs import graph_buckets  # noqa: E402
from shared.model.kv_cache import PagedKVCache  # noqa: E402
from shared.model.runner import ForwardItem, ModelRunner  # noqa: E402
from shared.scheduling.config import SchedulerConfig  # noqa: E402
from shared.values.methods import DraftMethod  # noqa: E402
from shared.values.sampling import SamplingParams  # noqa: E402
from tests.test_feature_draft import feature_draft_dir  # noqa: E402, F401 (a fixture)

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
needs_gpu = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")


# ---- buckets and the fixed launch ---------------------------------------------------------------


def test_buckets_cover_every_token_count_with_little_padding() -> None:
    buckets = graph_buckets(512)
    assert buckets[:5] == [1, 2, 4, 8, 12] and buckets[-2:] == [384, 512]
    for t in range(1, 513):
        n = next(b for b in buckets if b >= t)
        assert n >= t and (t <= 8 or (n - t) / n < 1 / 3)
    assert graph_buckets(5) == [1, 2, 4, 5]
    assert graph_buckets(1) == [1]


@pytest.mark.parametrize("max_requests", [None, 8, 64])
def test_fixed_launch_matches_the_reference(max_requests: int | None) -> None:
    """The fixed work table (one tile per 16 queries, rows past the batch all zeros) computes
    the same attention as the reference, drafter-style cached tree nodes included."""
    rng = random.Random(3)
    specs = [
        RequestSpec(37, random_tree(12, rng)),
        RequestSpec(0, chain(5)),
        RequestSpec(70, random_tree(30, rng), query_len=9),
        RequestSpec(5, chain(1)),
        RequestSpec(130, random_tree(20, rng), query_len=20),
    ]
    b = make_paged_batch(
        specs, num_heads=6, num_kv_heads=2, head_dim=16, block_size=8, dtype=torch.float32,
        device=DEVICE, seed=1,
    )  # fmt: skip
    num_tokens = b.q.shape[0]  # 64, over 5 requests
    block_m = fixed_block_m(num_tokens, 6, 2)
    rows = fixed_work_items(b.meta, block_m, 6, 2)
    n = len(rows) if max_requests is None else fixed_work_rows(128, max_requests, block_m, 6, 2)
    assert len(rows) <= n
    items = np.zeros((n, rows.shape[1]), dtype=np.int32)
    items[: len(rows)] = rows
    b.meta.fixed_launch = FixedLaunch(block_m, torch.from_numpy(items).to(DEVICE))
    scale = 16**-0.5
    out = tree_attention_triton(b.q, b.k_cache, b.v_cache, b.meta, scale)
    b.meta.fixed_launch = None
    want = tree_attention_reference(b.q, b.k_cache, b.v_cache, b.meta, scale)
    torch.testing.assert_close(out, want, atol=2e-5, rtol=1e-4)


def test_work_rows_hold_every_batch_that_fits() -> None:
    """However a bucket's tokens split over up to `max_requests` requests, the batch's tiles fit
    the fixed table, which stays far shorter than a row per token at large buckets."""
    rng = random.Random(0)
    for heads in ((6, 2), (32, 32), (9, 3)):
        for n, max_requests in ((1, 64), (16, 4), (512, 64), (1024, 64)):
            block_m = fixed_block_m(n, *heads)
            cap = fixed_work_rows(n, max_requests, block_m, *heads)
            for _ in range(20):
                num = rng.randint(1, min(n, max_requests))
                cuts = sorted(rng.sample(range(1, n), num - 1)) if num > 1 else []
                lens = [b - a for a, b in zip([0, *cuts], [*cuts, n], strict=True)]
                specs = [RequestSpec(rng.randrange(0, 50), chain(k)) for k in lens]
                b = make_paged_batch(
                    specs, num_heads=heads[0], num_kv_heads=heads[1], head_dim=16,
                    block_size=16, dtype=torch.float32, device=torch.device("cpu"), seed=0,
                )  # fmt: skip
                assert len(fixed_work_items(b.meta, block_m, *heads)) <= cap
        assert fixed_work_rows(1024, 64, fixed_block_m(1024, *heads), *heads) <= 1024 // 8 + 64


def test_the_scratch_block_is_never_handed_out(tiny_target_dir: Path) -> None:
    model = load_model(tiny_target_dir)
    cache = PagedKVCache(
        model.cfg, block_size=4, memory_bytes=64 << 10, dtype=torch.float32,
        device=torch.device("cpu"), scratch_block=True,
    )  # fmt: skip
    plain = PagedKVCache(
        model.cfg, block_size=4, memory_bytes=64 << 10, dtype=torch.float32,
        device=torch.device("cpu"),
    )  # fmt: skip
    assert cache.num_blocks == plain.num_blocks and plain.scratch_slot is None
    assert cache.k.shape[1] == cache.num_blocks + 1
    cache.add("a")
    cache.reserve("a", cache.capacity_tokens)  # every block the allocator has
    assert cache.scratch_slot == cache.num_blocks * 4
    assert cache.scratch_slot not in cache.slots("a", 0, cache.capacity_tokens)


# ---- the runner: static buffers against the eager forward -------------------------------------


def forward_sequence(runner: ModelRunner) -> list[torch.Tensor]:
    """Prefills, verifier trees, a drafter-style tree grown over two forwards, commits, and a
    forward larger than the graphs hold (eager); every forward's logits."""
    out: list[torch.Tensor] = []
    for rid in ("a", "b", "c"):
        runner.add_request(rid)
    out += runner.prefill({"a": [5, 9, 13, 2, 7, 30], "b": [3, 4], "c": list(range(40, 47))})
    items = [
        ForwardItem("a", [11, 12, 13, 14], [-1, 0, 0, 1]),
        ForwardItem.chain("b", [8]),
        ForwardItem("c", [60, 61, 62], [-1, -1, 0], "all"),
    ]
    out += runner.forward(items)
    runner.commit({"a": [0, 1, 3], "b": [0], "c": [1]})
    out += runner.forward([ForwardItem("a", [40, 41], [-1, 0]), ForwardItem.chain("c", [7])])
    out += runner.forward([ForwardItem("a", [42, 43, 44], [1, 1, 2])])  # grows the tree
    runner.commit({"a": [0, 1, 2, 4], "c": []})
    out += runner.forward([ForwardItem.chain("b", list(range(20, 40)), "all")])  # 20 tokens
    runner.commit({"b": range(20)})
    out += runner.forward([ForwardItem.chain(rid, [17]) for rid in ("a", "b", "c")])
    return out


def committed_kv(runner: ModelRunner) -> list[torch.Tensor]:
    return [t for rid in ("a", "b", "c") for t in runner.cache.gather(rid, runner.num_cached(rid))]


@pytest.mark.parametrize(
    ("max_requests", "expected"), [(64, [15, 8, 3, 3, 3]), (2, [3, 3])], ids=["64", "2"]
)
def test_static_buffer_forward_equals_eager(
    tiny_target_dir: Path, max_requests: int, expected: list[int]
) -> None:
    """Padded static buffers (buckets of up to 16 tokens; the 20-token forward, and with a limit
    of 2 requests the forwards of 3, fall back to eager) give the eager forward's logits and
    leave every request's committed KV as eager leaves it: padded tokens write only the scratch
    block."""
    model = load_model(tiny_target_dir, device=DEVICE)
    eager = ModelRunner(
        model, block_size=4, kv_memory_bytes=1 << 20, attention=tree_attention_reference
    )
    static = ModelRunner(
        model, block_size=4, kv_memory_bytes=1 << 20, attention=tree_attention_triton,
        cuda_graph_max_tokens=16, cuda_graph_max_requests=max_requests, record_graphs=False,
    )  # fmt: skip
    assert eager.graphs is None and static.graphs is not None
    assert static.graphs.buckets == [1, 2, 4, 8, 12, 16]
    graphed = []
    run = static.graphs.hidden_states

    def counting(batch):  # noqa: ANN001, ANN202
        graphed.append(batch.num_tokens)
        return run(batch)

    static.graphs.hidden_states = counting  # type: ignore[method-assign]
    want, got = forward_sequence(eager), forward_sequence(static)
    assert graphed == expected  # padded to 16, 8 and 4 tokens; the others ran eagerly
    for a, b in zip(want, got, strict=True):
        torch.testing.assert_close(b, a, atol=1e-4, rtol=1e-4)
    for a, b in zip(committed_kv(eager), committed_kv(static), strict=True):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)


def test_static_buffer_forward_of_a_feature_draft(
    feature_draft_dir: Path,  # noqa: F811
    tiny_target_dir: Path,
) -> None:
    model = load_model(feature_draft_dir, target_path=tiny_target_dir, device=DEVICE)
    feats = torch.randn(9, model.cfg.feature_size, generator=torch.Generator().manual_seed(0))
    feats = feats.to(DEVICE)
    outs = []
    eager = {"attention": tree_attention_reference}
    for kwargs in (eager, {"attention": tree_attention_triton, "record_graphs": False}):
        runner = ModelRunner(model, block_size=4, kv_memory_bytes=1 << 20, **kwargs)
        runner.add_request("a")
        [a] = runner.forward_full(
            [ForwardItem.chain("a", [3, 4, 5, 6, 7], "all", features=feats[:5])]
        )
        runner.commit({"a": range(5)})
        [b] = runner.forward_full(
            [ForwardItem("a", [8, 9, 10, 11], [-1, 0, 0, 2], "all", feats[5:], "all")]
        )
        outs.append((a.logits, b.logits, b.features))
    for want, got in zip(*outs, strict=True):
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


# ---- GPU: recorded graphs ------------------------------------------------------------------------


@needs_gpu
@pytest.mark.gpu
def test_recorded_graphs_equal_eager_on_gpu(tiny_target_dir: Path) -> None:
    model = load_model(tiny_target_dir, device="cuda")
    eager = ModelRunner(model, block_size=4, kv_memory_bytes=1 << 20, cuda_graph_max_tokens=0)
    graphed = ModelRunner(model, block_size=4, kv_memory_bytes=1 << 20, cuda_graph_max_tokens=16)
    assert eager.graphs is None and graphed.graphs is not None
    want = forward_sequence(eager)
    got = forward_sequence(graphed)
    assert 0 < graphed.graphs.num_graphs < len(graphed.graphs.buckets)  # captured on first use
    for a, b in zip(want, got, strict=True):
        torch.testing.assert_close(b, a, atol=1e-4, rtol=1e-4)
    for a, b in zip(committed_kv(eager), committed_kv(graphed), strict=True):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)
    assert graphed.capture_graphs() == len(graphed.graphs.buckets)
    # the warm-up forwards of the capture wrote only the scratch block
    for a, b in zip(committed_kv(eager), committed_kv(graphed), strict=True):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5)


PROMPTS = [[5, 17, 3, 44], [9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21], [70], [33, 34]]


def gpu_engine(target_dir: Path, draft_dir: Path | None, method, graphs: int) -> SpecEngine:  # noqa: ANN001
    def runner(path: Path) -> ModelRunner:
        return ModelRunner(
            load_model(path, device="cuda"), block_size=4, kv_memory_bytes=2 << 20,
            cuda_graph_max_tokens=graphs,
        )  # fmt: skip

    drafter = Drafter(runner(draft_dir)) if draft_dir is not None else None
    return SpecEngine(
        Verifier(runner(target_dir)), drafter, method, SchedulerConfig(planner="fixed")
    )


@needs_gpu
@pytest.mark.gpu
def test_greedy_with_graphs_equals_plain_on_gpu(tiny_target_dir: Path, tiny_draft_dir: Path):
    params = SamplingParams(max_tokens=20)
    plain = [r.output for r in gpu_engine(tiny_target_dir, None, None, 0).generate(PROMPTS, params)]
    plain_graphed = gpu_engine(tiny_target_dir, None, None, 64).generate(PROMPTS, params)
    assert [r.output for r in plain_graphed] == plain
    # the target drafting for itself: every step accepts its whole chain (acceptance floor)
    own = gpu_engine(tiny_target_dir, tiny_target_dir, DraftMethod("chain", k=3), 64)
    assert [r.output for r in own.generate(PROMPTS, params)] == plain
    assert own.stats.mean_accepted_length > 3.5
    tree = DraftMethod("dynamic", budget=12, max_size=8, max_depth=5, max_width=3)
    small = gpu_engine(tiny_target_dir, tiny_draft_dir, tree, 64)
    assert [r.output for r in small.generate(PROMPTS, params)] == plain
    assert small.stats.num_draft_tokens > 0
