"""What CUDA graphs save on a GPU forward: the host enqueueing kernels, against the kernels.

    python -m bench.bench_gpu_forward --target bench/shapes/Llama-3.1-8B-shape --dtype bfloat16

For each model (random weights with the checkpoint's shapes) and each batch layout (requests x
new tokens each, as chains with logits for every token, at a committed context), one process
measures two runners over the same model:

- `eager ms`: the runner's eager forward (`cuda_graph_max_tokens=0`), bracketed by
  `torch.cuda.synchronize` (what a cost profile holds);
- `enqueue ms`: the time until that forward returns to the host without waiting for the GPU
  (close to `eager ms`: the host is the bottleneck);
- `kernel ms`: the summed duration of its GPU kernels (torch.profiler), and their count;
- `graphs ms`: the same forward replaying the runner's CUDA graphs (`shared/model/cuda_graphs.py`),
  and `x`, eager over graphs.

The profiler's top host operations of each eager layout go to one file (`--trace`).
Refuses to run without CUDA.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

from bench.timing import median_ms
from shared.model.kv_cache import SwappedKV
from shared.model.runner import ForwardItem, ModelRunner
from tools.profile import kv_bytes_for, random_model

LAYOUTS = ((1, 1), (1, 16), (8, 1), (8, 2), (16, 16), (32, 16))  # (requests, tokens each)


def measure_layout(
    runners: dict[str, ModelRunner], requests: int, tokens_each: int, context: int, repeats: int
) -> tuple[dict[str, float], str]:
    eager, graphed = runners["eager"], runners["graphs"]
    cfg = eager.cfg
    rids = [f"bench_{i}" for i in range(requests)]
    shape = (cfg.num_layers, context, cfg.num_kv_heads, cfg.head_dim)
    zeros = torch.zeros(shape, dtype=eager.dtype)
    for runner in runners.values():
        for rid in rids:
            runner.swap_in(rid, SwappedKV(k=zeros, v=zeros))
    rng = np.random.default_rng(0)
    features = None
    if cfg.feature_size:
        features = torch.randn(tokens_each, cfg.feature_size).to(eager.device, eager.dtype)
    items = [
        ForwardItem(
            rid,
            rng.integers(0, cfg.vocab_size, tokens_each).tolist(),
            list(range(-1, tokens_each - 1)),
            "all",
            features,
        )
        for rid in rids
    ]

    def forward(runner: ModelRunner) -> None:
        runner.forward(items)
        for rid in rids:
            runner.discard_tree(rid)

    for runner in runners.values():
        for _ in range(3):  # the graphed runner records its graph here
            forward(runner)
    eager_ms = median_ms(lambda: forward(eager), repeats, torch.cuda.synchronize)
    graphs_ms = median_ms(lambda: forward(graphed), repeats, torch.cuda.synchronize)

    enqueue_times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        start = time.perf_counter()
        eager.forward(items)
        enqueue_times.append((time.perf_counter() - start) * 1e3)
        torch.cuda.synchronize()
        for rid in rids:
            eager.discard_tree(rid)

    from torch.profiler import ProfilerActivity, profile

    rounds = 5
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(rounds):
            forward(eager)
        torch.cuda.synchronize()
    events = prof.key_averages()
    on_gpu = [e for e in events if str(e.device_type).endswith("CUDA")]
    kernel_us = sum(e.self_device_time_total for e in on_gpu) / rounds
    launches = sum(e.count for e in on_gpu)
    top = events.table(sort_by="self_cpu_time_total", row_limit=25)
    for runner in runners.values():
        for rid in rids:
            runner.free_request(rid)
    row = {
        "requests": requests,
        "tokens_each": tokens_each,
        "context": context,
        "eager_ms": round(eager_ms, 3),
        "enqueue_ms": round(statistics.median(enqueue_times), 3),
        "kernel_ms": round(kernel_us / 1e3, 3),
        "launches": launches / rounds,
        "graphs_ms": round(graphs_ms, 3),
        "speedup": round(eager_ms / graphs_ms, 2),
    }
    return row, top


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", type=Path, required=True, help="a checkpoint folder (config.json)")
    ap.add_argument("--drafts", type=Path, nargs="*", default=[], help="draft checkpoint folders")
    ap.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--json", type=Path, help="write the rows here")
    ap.add_argument("--trace", type=Path, help="write each layout's top host operations here")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_gpu_forward needs a CUDA device")
    dtype = getattr(torch, args.dtype)
    rows = []
    for path in [args.target, *args.drafts]:
        model = random_model(path, dtype, "cuda")
        kv = kv_bytes_for(model, dtype, [args.context], 16, max(r for r, _ in LAYOUTS))
        runners = {
            "eager": ModelRunner(model, kv_memory_bytes=kv, cuda_graph_max_tokens=0),
            "graphs": ModelRunner(model, kv_memory_bytes=kv),
        }
        print(f"\n{path.name} ({torch.cuda.get_device_name()}, {args.dtype})", flush=True)
        print(
            f"{'req x tok':>10} {'eager ms':>9} {'enqueue':>8} {'kernels':>8} {'launches':>8} "
            f"{'graphs ms':>9} {'x':>6}"
        )
        for requests, each in LAYOUTS:
            row, top = measure_layout(runners, requests, each, args.context, args.repeats)
            row["model"] = path.name
            rows.append(row)
            print(
                f"{requests:>4} x {each:<3} {row['eager_ms']:9.2f} {row['enqueue_ms']:8.2f} "
                f"{row['kernel_ms']:8.2f} {row['launches']:8.0f} {row['graphs_ms']:9.2f} "
                f"{row['speedup']:6.2f}",
                flush=True,
            )
            if args.trace:
                with args.trace.open("a") as f:
                    f.write(f"\n## {path.name}: {requests} x {each}\n{top}\n")
        del runners, model
        torch.cuda.empty_cache()
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
