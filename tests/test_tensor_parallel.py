"""The tensor-parallel target on this CPU: gloo, ranks spawned here.

The sharded forward's logits (and the final features a feature-level draft reads) equal the
single-process forward's in fp32 for prefill chunks, token trees and decode steps, through the
runner calls the verifier makes (commits, swaps) on tiny random checkpoints of the supported
architectures, and on SmolLM2-135M (3 ranks: its 9 heads and 3 KV heads do not split in 2).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from shared.errors import UnsupportedModelError
from shared.model import load_model
from shared.model.config import ModelConfig
from shared.model.rank_group import (
    GroupRunner,
    close_rank_group,
    follow,
    free_port,
    init_rank_group,
    load_sharded_runner,
    tcp_init_method,
)
from shared.model.runner import ForwardItem, ModelRunner
from shared.model.tensor_parallel import check_shardable, shard_bounds, valid_sizes
from tests.conftest import make_tiny_checkpoint

# Each row's largest difference, relative to the row's largest magnitude: summing the ranks'
# partial products reorders fp32 additions (SmolLM2's logits differ by up to 4e-5 on values
# near 25; the tiny models' by 3e-6).
TOLERANCE = 1e-5
RUNNER = {"block_size": 4, "kv_memory_bytes": 8 << 20}


def _steps(vocab: int) -> list[tuple[str, object]]:
    """The runner calls of a verifier's life, the same on both sides: prefill chunks of two
    requests, a tree beside a chunk, commits of a tree path, decode steps, a swap out and in."""
    def ids(seed: int, n: int) -> list[int]:
        return [(seed * 31 + 7 * i) % vocab for i in range(n)]

    return [
        ("add", ["a", "b"]),
        ("forward", [ForwardItem.chain("a", ids(1, 9), "all"), ForwardItem.chain("b", ids(2, 5))]),
        ("commit", {"a": range(9), "b": range(5)}),
        (
            "forward",
            [
                ForwardItem("a", ids(3, 6), [-1, 0, 0, 1, 1, 2], feature_rows="all"),
                ForwardItem.chain("b", ids(4, 3), "all"),
            ],
        ),
        ("commit", {"a": [0, 1, 3], "b": range(3)}),
        ("forward", [ForwardItem.chain("a", ids(5, 1)), ForwardItem.chain("b", ids(6, 1))]),
        ("commit", {"a": [0], "b": [0]}),
        ("swap", "b"),
        ("forward", [ForwardItem.chain("b", ids(7, 1)), ForwardItem.chain("a", ids(8, 1))]),
        ("commit", {"a": [0], "b": [0]}),
        ("free", ["a", "b"]),
    ]


def _run(runner: ModelRunner | GroupRunner, steps: list[tuple[str, object]]) -> list[list]:
    outputs: list[list] = []
    for kind, arg in steps:
        if kind == "add":
            for rid in arg:  # type: ignore[union-attr]
                runner.add_request(rid)
        elif kind == "forward":
            outputs.append(runner.forward_full(arg))  # type: ignore[arg-type]
        elif kind == "commit":
            runner.commit(arg)  # type: ignore[arg-type]
        elif kind == "swap":
            swapped = runner.swap_out(arg)
            runner.swap_in(arg, swapped)
        elif kind == "free":
            for rid in arg:  # type: ignore[union-attr]
                runner.free_request(rid)
    return outputs


def _compare_rank(rank: int, size: int, port: int, paths: list[str], report: str) -> None:
    torch.set_num_threads(1)
    group = init_rank_group(rank, size, tcp_init_method(port), "cpu")
    try:
        results = {}
        for path in paths:
            runner = load_sharded_runner(group, path, torch.float32, **RUNNER)
            if rank != 0:
                follow(runner, group)
                continue
            sharded = GroupRunner(runner, group)
            plain = ModelRunner(load_model(path), **RUNNER)
            steps = _steps(plain.cfg.vocab_size)
            got, want = _run(sharded, steps), _run(plain, steps)
            sharded.close()
            same_argmax, worst_abs, worst_scaled = True, {}, {}
            for step_got, step_want in zip(got, want, strict=True):
                for g, w in zip(step_got, step_want, strict=True):
                    assert g.logits.shape == w.logits.shape
                    assert g.features.shape == w.features.shape
                    for what, a, b in (
                        ("logits", g.logits, w.logits),
                        ("features", g.features, w.features),
                    ):
                        if a.numel():
                            diff = (a - b).abs()
                            worst_abs[what] = max(worst_abs.get(what, 0.0), diff.max().item())
                            scale = b.abs().amax(-1, keepdim=True)
                            worst_scaled[what] = max(
                                worst_scaled.get(what, 0.0), (diff / scale).max().item()
                            )
                    if g.logits.numel():
                        same_argmax &= bool((g.logits.argmax(-1) == w.logits.argmax(-1)).all())
            results[path] = {
                "abs": worst_abs,
                "scaled": worst_scaled,
                "same_argmax": same_argmax,
                "kv_heads": runner.cache.k.shape[3],
                "full_kv_heads": plain.cache.k.shape[3],
                "free_after": runner.cache.allocator.num_free == runner.cache.num_blocks,
            }
        if rank == 0:
            Path(report).write_text(json.dumps(results))
    finally:
        close_rank_group()


def compare_sharded(paths: list[Path], size: int, tmp_path: Path) -> dict[str, dict]:
    report = tmp_path / "report.json"
    args = (size, free_port(), [str(p) for p in paths], str(report))
    mp.spawn(_compare_rank, args=args, nprocs=size, join=True)
    return json.loads(report.read_text())


def _qwen2_checkpoint(path: Path) -> Path:
    """A tiny random Qwen2 (q/k/v biases) with an MLP width that does not split evenly."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(3)
    cfg = Qwen2Config(
        vocab_size=101,
        hidden_size=64,
        intermediate_size=90,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        use_sliding_window=False,
        eos_token_id=None,
    )
    model = Qwen2ForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.15)  # the biases too: a slice taken wrong shows
    model.save_pretrained(path, safe_serialization=True)
    return path


def test_sharded_forward_equals_the_single_process_forward(tmp_path: Path) -> None:
    paths = [
        # an odd vocabulary: the head's last shard is padded
        make_tiny_checkpoint(tmp_path / "llama", seed=5, vocab_size=97),
        make_tiny_checkpoint(tmp_path / "tied", seed=6, num_heads=4, num_kv_heads=4, tie=True),
        _qwen2_checkpoint(tmp_path / "qwen2"),
    ]
    results = compare_sharded(paths, 2, tmp_path)
    assert set(results) == {str(p) for p in paths}
    for path, r in results.items():
        assert max(r["scaled"].values()) <= TOLERANCE, (path, r)
        assert set(r["scaled"]) == {"logits", "features"}
        assert r["same_argmax"], path
        assert r["kv_heads"] * 2 == r["full_kv_heads"], path  # each rank caches half the heads
        assert r["free_after"], path


@pytest.mark.smollm2
def test_smollm2_over_three_ranks(tmp_path: Path) -> None:
    from shared.model.model_set import target_dir

    [r] = compare_sharded([target_dir()], 3, tmp_path).values()
    assert max(r["scaled"].values()) <= TOLERANCE and r["same_argmax"], r
    assert (r["kv_heads"], r["full_kv_heads"]) == (1, 3)


def _cfg(heads: int, kv_heads: int, **extra: object) -> ModelConfig:
    fields = {
        "vocab_size": 96,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_layers": 1,
        "num_heads": heads,
        "num_kv_heads": kv_heads,
        "head_dim": 64 // heads,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1e4,
        "max_position_embeddings": 64,
        "tie_word_embeddings": False,
    }
    return ModelConfig(**{**fields, **extra})  # type: ignore[arg-type]


def test_head_counts_that_do_not_divide_are_refused() -> None:
    check_shardable(_cfg(8, 8), 8)
    with pytest.raises(UnsupportedModelError, match=r"sizes that do: \[1, 3\]"):
        check_shardable(_cfg(9, 3), 2)  # SmolLM2-135M's heads
    with pytest.raises(UnsupportedModelError, match="does not divide"):
        check_shardable(_cfg(8, 2), 4)  # the KV heads would have to be replicated
    with pytest.raises(UnsupportedModelError, match="one device"):
        check_shardable(_cfg(4, 2, feature_size=64), 2)
    assert valid_sizes(_cfg(64, 8)) == [1, 2, 4, 8]  # Llama-3-70B's heads
    assert shard_bounds(90, 4) == [0, 23, 46, 68, 90]
