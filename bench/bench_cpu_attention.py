"""Whole target forwards on a CPU with the reference tree attention vs the planned one.

    .venv/bin/python bench/bench_cpu_attention.py [--rounds 15] [--threads 2]

Loads the target (SmolLM2-135M-Instruct, fp32) with its measured linear-kernel plan, then times
one forward with the PyTorch reference attention (`kernels.reference`) and one with the planned
CPU attention (`kernels.cpu_tree_attention`), in turn, over the same cache and tokens:

- one request after a 256-token prefix, a chain of n new tokens (n = 1: plain decoding; n > 1:
  what a verifier forward of a chain of n - 1 drafts costs);
- a batch of b requests (256-token prefixes each), one decode token each, as the services run
  at concurrency b.

Prints medians of the forward latency with both, the ratio, and the largest logit difference.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path[0] = str(Path(__file__).resolve().parents[1])  # bench/profile.py would shadow profile

from kernels.cpu_tree_attention import CpuTreeAttention  # noqa: E402
from kernels.reference import tree_attention_reference  # noqa: E402
from shared.model import load_model  # noqa: E402
from shared.model.model_set import target_dir  # noqa: E402
from shared.model.runner import ForwardItem, ModelRunner  # noqa: E402

PREFIX = 256
CHAINS = (1, 2, 3, 5, 9, 17)
BATCHES = (4, 8, 16)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model = load_model(target_dir())
    model.plan_kernels()
    runner = ModelRunner(model, kv_memory_bytes=512 << 20)
    rng = random.Random(0)
    rids = [f"r{i}" for i in range(max(BATCHES))]
    for rid in rids:
        runner.add_request(rid)
        runner.prefill({rid: [rng.randrange(1000, 20000) for _ in range(PREFIX)]})
    modes = {"reference": tree_attention_reference, "planned": CpuTreeAttention()}
    cases = [("chain", n) for n in CHAINS] + [("batch", b) for b in BATCHES]

    def forward(items: list[ForwardItem]) -> tuple[float, torch.Tensor]:
        t = time.perf_counter()
        logits = runner.forward(items)
        dt = time.perf_counter() - t
        for item in items:
            runner.discard_tree(item.request_id)
        return dt, torch.cat(logits)

    def new_items(case: tuple[str, int]) -> list[ForwardItem]:
        kind, n = case
        if kind == "chain":
            tokens = [rng.randrange(1000, 20000) for _ in range(n)]
            return [ForwardItem.chain(rids[0], tokens, logits="all")]
        return [ForwardItem.chain(r, [rng.randrange(1000, 20000)], logits="all") for r in rids[:n]]

    times: dict[tuple[str, tuple[str, int]], list[float]] = {
        (m, c): [] for m in modes for c in cases
    }
    max_diff = dict.fromkeys(cases, 0.0)
    for r in range(args.rounds + 1):  # round 0 warms up
        for case in cases:
            items = new_items(case)
            out = {}
            for m in list(modes) if r % 2 else list(modes)[::-1]:
                runner.attention = modes[m]
                dt, out[m] = forward(items)
                if r:
                    times[(m, case)].append(dt)
            diff = (out["reference"] - out["planned"]).abs().max().item()
            max_diff[case] = max(max_diff[case], diff)
        print(f"round {r}/{args.rounds}", file=sys.stderr, end="\r")

    def med(m: str, case: tuple[str, int]) -> float:
        return statistics.median(times[(m, case)]) * 1e3

    print(
        f"{torch.get_num_threads()} threads, torch {torch.__version__}, "
        f"median of {args.rounds} forwards (ms) after {PREFIX}-token prefixes"
    )
    print(f"{'forward':<22} {'reference':>10} {'planned':>8} {'speedup':>8} {'max|dlogit|':>12}")
    for case in cases:
        kind, n = case
        label = f"1 request, {n} tokens" if kind == "chain" else f"{n} requests x 1 token"
        ref, planned = med("reference", case), med("planned", case)
        print(
            f"{label:<22} {ref:>10.1f} {planned:>8.1f} {ref / planned:>7.2f}x "
            f"{max_diff[case]:>12.2e}"
        )
    ref1, planned1 = med("reference", ("chain", 1)), med("planned", ("chain", 1))
    print("cost(n) / cost(1):")
    for n in CHAINS:
        case = ("chain", n)
        print(
            f"  n = {n:>2}: reference {med('reference', case) / ref1:.2f}, "
            f"planned {med('planned', case) / planned1:.2f}"
        )


if __name__ == "__main__":
    main()
