"""The tensor-parallel target on this CPU: gloo, ranks spawned here.

The sharded forward's logits (and the final features a feature-level draft reads) equal the
single-process forward's in fp32 for prefill chunks, token trees and decode steps, through the
runner calls the verifier makes (commits, swaps) on tiny random checkpoints of the supported
architectures, and on SmolLM2-135M (3 ranks: its 9 heads and 3 KV heads do not split in 2).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from services.run import Stack, start_drafter, start_scheduler
from services.runtime import ModelPaths
from shared.bus import EmbeddedRedis
from shared.errors import UnsupportedModelError
from shared.model import load_model
from shared.model.config import ModelConfig
from shared.model.profile_files import architecture_fingerprint
from shared.model.profiling import measure_curve, profile_key
from shared.model.rank_group import (
    GROUP_FAILED_EXIT,
    GroupRunner,
    follow,
    free_port,
    init_rank_group,
    load_sharded_runner,
    tcp_init_method,
)
from shared.model.runner import ForwardItem, ModelRunner
from shared.model.tensor_parallel import check_shardable, shard_bounds, valid_sizes
from shared.values.sampling import SamplingParams
from tests.conftest import make_tiny_checkpoint
from tests.test_services_processes import LOGS, launch, log_tail, processes, service_env, stop
from tests.test_services_support import NO_PROFILES, Client, make_settings, plain_greedy

__all__ = ["processes"]  # the fixture

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
    """Each checkpoint through the group and alone (rank 0 compares); then the last rank dies
    and rank 0's next call must end its process with GROUP_FAILED_EXIT, not raise."""
    torch.set_num_threads(1)
    group = init_rank_group(rank, size, tcp_init_method(port), "cpu")
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
        # a cost profile through the group: its key, and a small curve (zero KV swapped in)
        key = profile_key(sharded, "t")  # type: ignore[arg-type]
        curve = measure_curve(sharded, [1, 4], [0, 8], repeats=1, warmup=0)  # type: ignore[arg-type]
        sharded.close()
        results[path] = _differences(got, want) | {
            "profile_tp": key.tensor_parallel,
            "profile_fingerprint": key.fingerprint == architecture_fingerprint(plain.cfg),
            "profile_points": len(curve.ms_grid) * len(curve.ms_grid[0]),
            "kv_heads": runner.cache.k.shape[3],
            "full_kv_heads": plain.cache.k.shape[3],
            "free_after": runner.cache.allocator.num_free == runner.cache.num_blocks,
        }
    if rank == 0:
        Path(report).write_text(json.dumps(results))
    dist.barrier(group=group.control)  # the report is written
    if rank == size - 1:
        os.kill(os.getpid(), signal.SIGKILL)
    if rank == 0:
        GroupRunner(runner, group).add_request("after")
        raise AssertionError("a call on a group with a dead rank returned")
    follow(runner, group)  # the other followers: the broken group's error ends them


def _differences(got: list[list], want: list[list]) -> dict[str, object]:
    same_argmax, worst_abs, worst_scaled = True, {}, {}
    for step_got, step_want in zip(got, want, strict=True):
        for g, w in zip(step_got, step_want, strict=True):
            assert g.logits.shape == w.logits.shape
            assert g.features.shape == w.features.shape
            pairs = (("logits", g.logits, w.logits), ("features", g.features, w.features))
            for what, a, b in pairs:
                if a.numel():
                    diff = (a - b).abs()
                    worst_abs[what] = max(worst_abs.get(what, 0.0), diff.max().item())
                    scale = b.abs().amax(-1, keepdim=True)
                    worst_scaled[what] = max(
                        worst_scaled.get(what, 0.0), (diff / scale).max().item()
                    )
            if g.logits.numel():
                same_argmax &= bool((g.logits.argmax(-1) == w.logits.argmax(-1)).all())
    return {"abs": worst_abs, "scaled": worst_scaled, "same_argmax": same_argmax}


def compare_sharded(paths: list[Path], size: int, tmp_path: Path) -> dict[str, dict]:
    """Spawn `size` ranks running `_compare_rank`; rank 0's report, after checking that the
    dead rank took rank 0 down with GROUP_FAILED_EXIT."""
    report = tmp_path / "report.json"
    spawn = mp.get_context("spawn")
    args = (size, free_port(), [str(p) for p in paths], str(report))
    ranks = [spawn.Process(target=_compare_rank, args=(rank, *args)) for rank in range(size)]
    for process in ranks:
        process.start()
    for process in ranks:
        process.join(600)
    codes = [p.exitcode for p in ranks]
    assert codes[0] == GROUP_FAILED_EXIT and codes[-1] == -signal.SIGKILL, codes
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
    # (and a rank that dies then ends rank 0 at its next call: `compare_sharded` checks)
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
        # the profile keys on the whole architecture and the size; measured through the group
        assert (r["profile_tp"], r["profile_fingerprint"], r["profile_points"]) == (2, True, 4)


@pytest.mark.smollm2
@pytest.mark.slow
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


# ---- the verifier as a rank group, through the services ----------------------------------------

RANK_PID = re.compile(r"verifier group start (\d+): rank verifier-rank(\d+) pid (\d+)")


def rank_pids(log: Path) -> dict[tuple[int, int], int]:
    """(group start, rank) -> pid, from the launcher's log."""
    found = RANK_PID.findall(log.read_text(errors="replace"))
    return {(int(start), int(rank)): int(pid) for start, rank, pid in found}


@pytest.mark.anyio
@pytest.mark.slow
async def test_a_two_rank_verifier_serves_plain_greedy_and_survives_a_killed_rank(
    server: EmbeddedRedis, tiny_target_dir: Path, processes: list[subprocess.Popen[bytes]]
) -> None:
    """`python -m services verifier --tp 2` beside an in-process scheduler and drafter (the
    target drafting for itself): output equals plain greedy decoding with nearly every draft
    accepted; then rank 1 is SIGKILLed mid-stream, the launcher restarts the whole group, and
    every stream completes equal to plain greedy with no gap and no repeated token (the client
    checks every offset)."""
    cell = "tp"
    env = service_env(
        tiny_target_dir,
        tiny_target_dir,
        cell,
        AUGURY_REDIS__URL=server.url,
        AUGURY_REDIS__CLAIM_IDLE_MS="2000",
        # no cost model: a profile measured on a loaded host can price every draft out (the
        # profile through the group is checked by the logits test)
        AUGURY_ENGINE__MEASURE_PROFILE="false",
        AUGURY_ENGINE__PROFILE_DIR=str(NO_PROFILES),
        AUGURY_ENGINE__PROFILE_CACHE_DIR=str(NO_PROFILES),
    )
    group = launch("verifier", "--tp", "2", env=env)
    processes.append(group)
    settings = make_settings(server.url, cell, scheduler={"micro_batches": 2})
    models = ModelPaths(tiny_target_dir, {"d": tiny_target_dir})
    stack = Stack(settings, server.url)
    client = Client(server.url, settings, f"{cell}-client")
    try:
        await start_drafter(stack, models, "d", f"{cell}-drafter")
        await start_scheduler(stack, models, f"{cell}-scheduler")
        # the scheduler sees the drafter on its own schedule: until then it decodes plainly
        warmups = 0
        while not any(o.drafts for o in client.outcomes.values()):
            assert warmups < 20, "the scheduler never drafted"
            await client.submit(f"warm{warmups}", [1, 2, 3], SamplingParams(max_tokens=6))
            await client.wait([f"warm{warmups}"], timeout_s=180)
            warmups += 1
        # phase 1: greedy output through the group
        prompts = [[3 + i, 9, 27 + i, 4] for i in range(4)]
        params = [SamplingParams(max_tokens=12 + 3 * i) for i in range(4)]
        expected = plain_greedy(tiny_target_dir, prompts, params)
        for i, prompt in enumerate(prompts):
            await client.submit(f"g{i}", prompt, params[i])
        await client.wait([f"g{i}" for i in range(4)], timeout_s=180)
        outcomes = [client.outcomes[f"g{i}"] for i in range(4)]
        for i, (outcome, want) in enumerate(zip(outcomes, expected, strict=True)):
            assert outcome.tokens == want, f"request {i}"
        # trees were verified and nearly every one had a token accepted (a garbage draft: 1 in
        # 96 per node); over all four, since a loaded host may miss the drafter's heartbeat
        drafts = sum(o.drafts for o in outcomes)
        assert sum(o.accepted_tokens for o in outcomes) >= 0.9 * drafts >= 0.9 * 4, outcomes
        # phase 2: a rank dies mid-stream
        prompts = [[5 + i, 11, 2 * i + 1, 60] for i in range(4)]
        params = [SamplingParams(max_tokens=70 + 5 * i) for i in range(4)]
        expected = plain_greedy(tiny_target_dir, prompts, params)
        for i, prompt in enumerate(prompts):
            await client.submit(f"k{i}", prompt, params[i])
        while not all(client.outcomes[f"k{i}"].tokens for i in range(4)):
            await client.poll(50)
        os.kill(rank_pids(LOGS[group.pid])[(0, 1)], signal.SIGKILL)
        assert not all(client.outcomes[f"k{i}"].done for i in range(4)), "done before the kill"
        await client.wait([f"k{i}" for i in range(4)], timeout_s=180)
        for i, want in enumerate(expected):
            outcome = client.outcomes[f"k{i}"]
            assert outcome.error is None and outcome.tokens == want, f"request {i}"
        assert (1, 0) in rank_pids(LOGS[group.pid]), "the group was not started again"
        assert group.poll() is None, log_tail(group)
    finally:
        await client.close()
        await stack.stop()
    assert stop([group]) == [0], log_tail(group)  # SIGTERM: rank 0 stops, then the followers
    processes.remove(group)


def test_the_paper_estimate_scales_the_profile_and_adds_the_collectives() -> None:
    from bench.tp_estimate import LLAMA_3_8B, LLAMA_3_70B, estimate
    from shared.scheduling.cost_model import ForwardCurve

    curve = ForwardCurve(tokens=[1, 16], contexts=[0], ms_grid=[[7.0], [8.0]])
    alone = estimate(curve, LLAMA_3_8B, LLAMA_3_8B, 1, 16)
    assert (alone.compute_ms, alone.collectives_ms) == (8.0, 0.0)
    tp8 = estimate(curve, LLAMA_3_8B, LLAMA_3_70B, 8, 1, alpha_us=10.0)
    assert tp8.compute_ms == pytest.approx(7.0 * 69.50 / 8 / 7.50, rel=1e-3)
    # 160 all-reduces and one gather of latency 10 us, plus their bytes over 450 GB/s
    assert 1.61 < tp8.collectives_ms < 1.65
