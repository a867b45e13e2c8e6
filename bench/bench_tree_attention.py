"""Benchmark the Triton tree-attention kernel and the verifier step on a CUDA GPU.

    python bench/bench_tree_attention.py [--quick] [--json results.json]

Three parts, all with LLaMA-7B's attention layout (32 query and 32 KV heads of 128, fp16):

1. attention sweep over batch x prefix x tree size: the kernel's time and achieved memory
   bandwidth (KV, queries and outputs moved once, against a measured device-to-device copy), and
   two baselines, both given their KV already gathered out of the paged cache (which favors them):
   - `sdpa_mask`: PyTorch SDPA over the whole packed batch as one sequence with a dense boolean
     mask (block-diagonal over requests, tree bits inside);
   - `padded`: SDPA over a batch padded to the longest request (the problem Spin §II-B2 measured).
2. the verifier's step latency (the model runner's packed forward, random LLaMA-7B weights)
   against tokens per forward; AdaServe's hardware budget B (§3) is the largest token count
   whose step latency stays within `--budget-slack` of the smallest one's.

Refuses to run without CUDA.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

# run as a file, the script's own folder leads sys.path, and tools/profile.py would then shadow
# the standard library's profile module (torch imports it): the repository takes its place
sys.path[0] = str(Path(__file__).resolve().parents[1])

from kernels.attention_metadata import unpack_mask_bits  # noqa: E402
from kernels.reference import gather_request_kv  # noqa: E402
from kernels.synthetic import PagedBatch, RequestSpec, make_paged_batch, random_tree  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 32, 128, 16
MAX_DENSE_MASK_ELEMENTS = 1 << 29  # skip a baseline whose mask or padding would not fit
MAX_PADDED_BYTES = 16 << 30
# SDPA with a mask falls back to a kernel that materializes the [heads, queries, keys] scores
MAX_SCORE_BYTES = 8 << 30


@dataclass
class AttentionResult:
    batch: int
    prefix: int
    tree: int
    kernel_ms: float
    kernel_gbps: float
    pct_of_copy: float
    plan_us: float
    sdpa_mask_ms: float | None
    padded_ms: float | None
    max_err_vs_padded: float | None

    @property
    def speedup_vs_sdpa_mask(self) -> float | None:
        return self.sdpa_mask_ms / self.kernel_ms if self.sdpa_mask_ms else None

    @property
    def speedup_vs_padded(self) -> float | None:
        return self.padded_ms / self.kernel_ms if self.padded_ms else None


def bench_ms(fn: Callable[[], object]) -> float:
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=25, rep=100))


def copy_bandwidth_gbps(device: torch.device) -> float:
    """Achievable DRAM bandwidth: a 1 GiB device-to-device copy reads and writes every byte."""
    src = torch.empty(1 << 29, dtype=torch.float16, device=device)
    dst = torch.empty_like(src)
    ms = bench_ms(lambda: dst.copy_(src))
    return 2 * src.numel() * src.element_size() / (ms * 1e-3) / 1e9


def attention_bytes(b: PagedBatch) -> int:
    """Bytes the kernel must move at least once: every request's K and V, q and the output."""
    kv_tokens = sum(
        p + t for p, t in zip(b.meta.prefix_lens_host, b.meta.tree_lens_host, strict=True)
    )
    elem = b.q.element_size()
    return 2 * kv_tokens * KV_HEADS * HEAD_DIM * elem + 2 * b.q.numel() * elem


def request_kv(b: PagedBatch, r: int) -> tuple[torch.Tensor, torch.Tensor]:  # [S, Hkv, D] each
    n = b.meta.prefix_lens_host[r] + b.meta.tree_lens_host[r]
    table = b.meta.block_tables[r]
    return gather_request_kv(b.k_cache, table, n), gather_request_kv(b.v_cache, table, n)


def request_mask(b: PagedBatch, r: int) -> torch.Tensor:  # [n_q, S] bool
    meta = b.meta
    lo, hi = meta.query_start_host[r], meta.query_start_host[r + 1]
    prefix, tree = meta.prefix_lens_host[r], meta.tree_lens_host[r]
    mask = torch.ones(hi - lo, prefix + tree, dtype=torch.bool, device=b.q.device)
    mask[:, prefix:] = unpack_mask_bits(meta.tree_mask[lo:hi], tree)
    return mask


def dense_mask_baseline(b: PagedBatch, scale: float) -> Callable[[], torch.Tensor] | None:
    """SDPA over the packed batch as one sequence; a dense [T, S_total] mask parts the requests."""
    kv_lens = [p + t for p, t in zip(b.meta.prefix_lens_host, b.meta.tree_lens_host, strict=True)]
    elements = b.meta.num_tokens * sum(kv_lens)
    if elements > MAX_DENSE_MASK_ELEMENTS or 4 * HEADS * elements > MAX_SCORE_BYTES:
        return None
    kvs = [request_kv(b, r) for r in range(b.meta.num_requests)]
    k = torch.cat([kv[0] for kv in kvs]).transpose(0, 1)  # [Hkv, S_total, D]
    v = torch.cat([kv[1] for kv in kvs]).transpose(0, 1)
    mask = torch.zeros(b.meta.num_tokens, sum(kv_lens), dtype=torch.bool, device=b.q.device)
    col = 0
    for r, n in enumerate(kv_lens):
        lo, hi = b.meta.query_start_host[r], b.meta.query_start_host[r + 1]
        mask[lo:hi, col : col + n] = request_mask(b, r)
        col += n
    q = b.q.transpose(0, 1)  # [Hq, T, D]
    return lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


def padded_baseline(
    b: PagedBatch, scale: float
) -> tuple[Callable[[], torch.Tensor], Callable[[torch.Tensor], torch.Tensor]] | None:
    """SDPA over [R, H, max_q, D] x [R, H, max_kv, D]; returns the call and an unpadder."""
    meta = b.meta
    qs = meta.query_start_host
    q_lens = [qs[r + 1] - qs[r] for r in range(meta.num_requests)]
    kv_lens = [p + t for p, t in zip(meta.prefix_lens_host, meta.tree_lens_host, strict=True)]
    num_r, max_q, max_kv = meta.num_requests, max(q_lens), max(kv_lens)
    padded_bytes = 2 * num_r * max_kv * KV_HEADS * HEAD_DIM * b.q.element_size()
    elements = num_r * max_q * max_kv
    too_big = elements > MAX_DENSE_MASK_ELEMENTS or 4 * HEADS * elements > MAX_SCORE_BYTES
    if padded_bytes > MAX_PADDED_BYTES or too_big:
        return None
    dev, dtype = b.q.device, b.q.dtype
    q = torch.zeros(num_r, HEADS, max_q, HEAD_DIM, dtype=dtype, device=dev)
    k = torch.zeros(num_r, KV_HEADS, max_kv, HEAD_DIM, dtype=dtype, device=dev)
    v = torch.zeros_like(k)
    # Padded query rows see key 0 only, so no row is fully masked (SDPA would return NaN).
    mask = torch.zeros(num_r, 1, max_q, max_kv, dtype=torch.bool, device=dev)
    mask[:, :, :, 0] = True
    for r in range(num_r):
        kr, vr = request_kv(b, r)
        k[r, :, : kv_lens[r]] = kr.transpose(0, 1)
        v[r, :, : kv_lens[r]] = vr.transpose(0, 1)
        q[r, :, : q_lens[r]] = b.q[qs[r] : qs[r + 1]].transpose(0, 1)
        mask[r, 0, : q_lens[r], : kv_lens[r]] = request_mask(b, r)

    def unpad(out: torch.Tensor) -> torch.Tensor:  # [R, H, max_q, D] -> [T, H, D]
        return torch.cat([out[r, :, : q_lens[r]].transpose(0, 1) for r in range(num_r)])

    return (lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)), unpad


def bench_attention_case(
    batch: int, prefix: int, tree: int, dtype: torch.dtype, copy_gbps: float
) -> AttentionResult:
    from kernels.triton_tree_attention import build_work_plan, launch_config, tree_attention_triton

    rng = random.Random(batch * 7919 + prefix * 31 + tree)
    # Prefixes vary +-25% around the nominal length, as they do in a real batch.
    specs = [
        RequestSpec(max(1, int(prefix * rng.uniform(0.75, 1.25))), random_tree(tree, rng))
        for _ in range(batch)
    ]
    b = make_paged_batch(
        specs,
        num_heads=HEADS,
        num_kv_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        block_size=BLOCK_SIZE,
        dtype=dtype,
        device="cuda",
    )
    scale = HEAD_DIM**-0.5
    kernel = lambda: tree_attention_triton(b.q, b.k_cache, b.v_cache, b.meta, scale)  # noqa: E731
    kernel_ms = bench_ms(kernel)
    t0 = time.perf_counter()
    cfg = launch_config(b.meta, HEADS, KV_HEADS, b.q.device)
    build_work_plan(b.meta, cfg, b.q.device)
    torch.cuda.synchronize()
    plan_us = (time.perf_counter() - t0) * 1e6
    gbps = attention_bytes(b) / (kernel_ms * 1e-3) / 1e9

    sdpa_mask_ms = padded_ms = err = None
    try:  # a baseline that does not fit in memory is reported as such ("-")
        dense = dense_mask_baseline(b, scale)
        sdpa_mask_ms = bench_ms(dense) if dense else None
        del dense
        padded = padded_baseline(b, scale)
        if padded:
            run_padded, unpad = padded
            padded_ms = bench_ms(run_padded)
            err = (unpad(run_padded()).float() - kernel().float()).abs().max().item()
        del padded
    except torch.OutOfMemoryError:
        pass  # the exception (and the tensors its frames held) is gone after this block
    torch.cuda.empty_cache()
    return AttentionResult(
        batch, prefix, tree, kernel_ms, gbps, 100 * gbps / copy_gbps, plan_us,
        sdpa_mask_ms, padded_ms, err,
    )  # fmt: skip


# ---- verifier step latency ----------------------------------------------------------------------


def llama7b_runner(num_layers: int, kv_tokens: int, graph_tokens: int):  # noqa: ANN201 (a ModelRunner)
    from shared.model.config import ModelConfig
    from shared.model.llama import LlamaModel
    from shared.model.runner import ModelRunner

    cfg = ModelConfig(
        vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_layers=num_layers,
        num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, rms_norm_eps=1e-6,
        rope_theta=10000.0, max_position_embeddings=16384, tie_word_embeddings=False,
    )  # fmt: skip
    torch.set_default_dtype(torch.float16)
    try:
        with torch.device("cuda"):
            model = LlamaModel(cfg)
    finally:
        torch.set_default_dtype(torch.float32)
    model.init_rope(torch.device("cuda"))
    per_token = 2 * num_layers * KV_HEADS * HEAD_DIM * 2
    return ModelRunner(
        model,
        block_size=BLOCK_SIZE,
        kv_memory_bytes=kv_tokens * per_token,
        cuda_graph_max_tokens=graph_tokens,
    )


def bench_step_latency(
    token_counts: list[int],
    num_requests: int,
    prefix: int,
    num_layers: int,
    repeats: int,
    graph_tokens: int,
) -> list[tuple[int, float]]:
    from shared.model.runner import ForwardItem

    max_tree = -(-max(token_counts) // num_requests)
    kv_tokens = num_requests * (prefix + max_tree + BLOCK_SIZE)
    runner = llama7b_runner(num_layers, kv_tokens, graph_tokens)
    rng = random.Random(0)
    rids = [f"r{i}" for i in range(num_requests)]
    for rid in rids:
        runner.add_request(rid)
        runner.prefill({rid: [rng.randrange(3, 32000) for _ in range(prefix)]})
    results = []
    for n in token_counts:
        active = rids[: min(num_requests, n)]
        sizes = [n // len(active) + (i < n % len(active)) for i in range(len(active))]
        items = [
            ForwardItem(rid, [rng.randrange(3, 32000) for _ in range(s)], random_tree(s, rng))
            for rid, s in zip(active, sizes, strict=True)
        ]
        times = []
        for i in range(repeats + 2):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            runner.forward(items)
            torch.cuda.synchronize()
            if i >= 2:  # the first two compile kernels and warm the allocator
                times.append((time.perf_counter() - t0) * 1e3)
            for rid in active:
                runner.discard_tree(rid)
        results.append((n, statistics.median(times)))
    return results


def hardware_budget(latencies: list[tuple[int, float]], slack: float) -> int:
    """AdaServe's B: the most tokens per forward before the step gets `slack` slower."""
    base = latencies[0][1]
    return max(n for n, ms in latencies if ms <= base * (1 + slack))


# ---- reporting ----------------------------------------------------------------------------------


def fmt(x: float | None, spec: str = ".3f") -> str:
    return "—" if x is None else format(x, spec)


def print_attention_table(results: list[AttentionResult]) -> None:
    print(
        "| batch | prefix | tree | kernel ms | GB/s | % of copy | plan µs | SDPA+mask ms | ×"
        " | padded ms | × | max err |"
    )
    print("|" + "---|" * 12)
    for r in results:
        cells = [
            str(r.batch), str(r.prefix), str(r.tree), fmt(r.kernel_ms), fmt(r.kernel_gbps, ".0f"),
            fmt(r.pct_of_copy, ".0f"), fmt(r.plan_us, ".0f"), fmt(r.sdpa_mask_ms),
            fmt(r.speedup_vs_sdpa_mask, ".1f"), fmt(r.padded_ms), fmt(r.speedup_vs_padded, ".1f"),
            fmt(r.max_err_vs_padded, ".1e"),
        ]  # fmt: skip
        print("| " + " | ".join(cells) + " |")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a small sweep, for a smoke run")
    p.add_argument("--dtype", choices=["fp16", "bf16"], default="fp16")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 32, 64])
    p.add_argument("--prefixes", type=int, nargs="+", default=[128, 512, 2048, 8192])
    p.add_argument("--trees", type=int, nargs="+", default=[8, 32, 128])
    p.add_argument("--skip-step", action="store_true", help="skip the verifier step latency")
    p.add_argument("--step-layers", type=int, default=32)
    p.add_argument("--step-requests", type=int, default=16)
    p.add_argument("--step-prefix", type=int, default=1024)
    p.add_argument(
        "--step-tokens", type=int, nargs="+", default=[16, 32, 64, 128, 256, 512, 1024, 2048]
    )
    p.add_argument(
        "--cuda-graph-max-tokens",
        type=int,
        default=512,
        help="the step's forwards of up to this many tokens replay CUDA graphs (0: eager)",
    )
    p.add_argument("--budget-slack", type=float, default=0.2)
    p.add_argument("--json", type=Path, help="also write the results here")
    args = p.parse_args()
    if args.quick:
        args.batches, args.prefixes, args.trees = [1, 32], [512, 8192], [32]
        args.step_layers, args.step_tokens = 4, [16, 64, 256, 1024]
    return args


def main() -> None:
    args = parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_tree_attention: needs a CUDA GPU (the kernel is benchmarked there)")
    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[args.dtype]
    device = torch.device("cuda")
    gpu = torch.cuda.get_device_name(device)
    copy_gbps = copy_bandwidth_gbps(device)
    print(f"# {gpu}, torch {torch.__version__}, {args.dtype}; copy bandwidth {copy_gbps:.0f} GB/s")
    print(f"# command: python {' '.join(sys.argv)}\n")

    results = [
        bench_attention_case(bsz, prefix, tree, dtype, copy_gbps)
        for bsz in args.batches
        for prefix in args.prefixes
        for tree in args.trees
    ]
    print_attention_table(results)
    report: dict[str, object] = {
        "gpu": gpu,
        "command": "python " + " ".join(sys.argv),
        "copy_gbps": copy_gbps,
        "attention": [asdict(r) for r in results],
    }
    if not args.skip_step:
        latencies = bench_step_latency(
            args.step_tokens,
            args.step_requests,
            args.step_prefix,
            args.step_layers,
            repeats=5,
            graph_tokens=args.cuda_graph_max_tokens,
        )
        budget = hardware_budget(latencies, args.budget_slack)
        print(
            f"\n## verifier step, {args.step_layers} layers, {args.step_requests} requests x "
            f"prefix {args.step_prefix}, CUDA graphs up to {args.cuda_graph_max_tokens} tokens"
            "\n\n| tokens per forward | step ms |\n|---|---|"
        )
        for n, ms in latencies:
            print(f"| {n} | {ms:.2f} |")
        print(f"\nhardware budget B (within {args.budget_slack:.0%} of the smallest): {budget}")
        report["step_latency_ms"] = latencies
        report["hardware_budget"] = budget
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
