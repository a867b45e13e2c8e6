"""Whole target forward of n tokens, plain F.linear vs the measured per-shape kernel plan.

    .venv/bin/python bench/bench_linear.py [--rounds 15] [--threads 2] [--plan-json plan.json]
    .venv/bin/python bench/bench_linear.py --model-set qwen2.5-coder --dtype bfloat16

Loads the target (SmolLM2-135M-Instruct, fp32, by default), commits a 256-token prefix, then for
each round and each n in (1, 2, 3, 5, 9, 17) forwards a chain of n tokens with logits for every
row and discards it, once without a plan (`set_linear_plan(None)`, plain F.linear), once with
the plan `model.plan_kernels()` measured at start, once with the same timings chosen without
weight copies (`copy_gain=inf`), and once chosen without the kernel that pads up to three rows
to four (`onednn_packed_four_rows`, the plan before it existed), rotating which goes first.
Prints medians (and the interquartile range) of the forward latency, cost(n) / cost(1) for
each, and how far the planned logits are from the plain ones (max |difference| and argmax
flips, planned vs plain).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import time
from pathlib import Path

import torch

# run as a file, the script's own folder leads sys.path, and tools/profile.py would then shadow
# the standard library's profile module (torch imports it): the repository takes its place
sys.path[0] = str(Path(__file__).resolve().parents[1])

from shared.model import LlamaModel, load_model  # noqa: E402
from shared.model.linear import available_kernels, choose  # noqa: E402
from shared.model.loader import read_config  # noqa: E402
from shared.model.model_set import MODEL_SETS, SMOLLM2, model_set_target  # noqa: E402
from shared.model.runner import ForwardItem, ModelRunner  # noqa: E402

COUNTS = (1, 2, 3, 5, 9, 17)
FOUR_ROWS = "onednn_packed_four_rows"
PREFIX = 256


def _cpu_name() -> str:
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "cpu ?"
    name = next(
        (ln.split(":", 1)[1].strip() for ln in info.splitlines() if "model name" in ln), "?"
    )
    return f"{name}{' (AMX)' if 'amx_tile' in info else ''}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--plan-rounds", type=int, default=5)
    ap.add_argument("--plan-json", type=Path, help="write the measured plan here")
    ap.add_argument("--model-set", choices=MODEL_SETS, default=SMOLLM2)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument(
        "--random-weights",
        type=Path,
        metavar="CONFIG_DIR",
        help="random weights of the architecture in CONFIG_DIR/config.json instead of the target "
        "(timings do not depend on the values; for machines without the checkpoint)",
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    if args.random_weights:
        torch.manual_seed(0)
        model = LlamaModel(read_config(args.random_weights)).eval()
        model.init_rope(torch.device("cpu"))
        model.to(getattr(torch, args.dtype))
    else:
        model = load_model(model_set_target(args.model_set), dtype=getattr(torch, args.dtype))
    t0 = time.perf_counter()
    plan = model.plan_kernels(COUNTS, rounds=args.plan_rounds)
    plan_s = time.perf_counter() - t0
    print(
        f"{_cpu_name()}; torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"cpu capability {torch.backends.cpu.get_cpu_capability()}"
    )
    print(
        f"planning took {plan_s:.1f} s; weight copies {model.planned_extra_bytes() / 2**20:.0f} MiB"
    )
    print(plan.describe())
    if args.plan_json:
        args.plan_json.write_text(json.dumps(plan.to_dict(), indent=1))

    runner = ModelRunner(model)
    runner.add_request("a")
    rng = random.Random(0)
    runner.prefill({"a": [rng.randrange(1000, 20000) for _ in range(PREFIX)]})

    def forward(n: int, tokens: list[int]) -> tuple[float, torch.Tensor]:
        t = time.perf_counter()
        [logits] = runner.forward([ForwardItem.chain("a", tokens, logits="all")])
        dt = time.perf_counter() - t
        runner.discard_tree("a")
        return dt, logits

    # The same timings chosen without weight copies (copy_gain=inf): what the copies buy.
    kernels = available_kernels(next(model.parameters()).device)
    in_place = choose(
        plan.timings, plan.buckets, kernels, copy_gain=math.inf, invariant=plan.invariant
    )
    print("without weight copies:\n" + "\n".join(in_place.describe().splitlines()[1:6]))
    timings = plan.timings.items()
    before = {r: {k: t for k, t in ts.items() if k != FOUR_ROWS} for r, ts in timings}
    no_four = choose(before, plan.buckets, kernels, invariant=plan.invariant)
    print(f"without {FOUR_ROWS}:\n" + "\n".join(no_four.describe().splitlines()[1:6]))
    modes = {"plain": None, "planned": plan, "no-copy": in_place, "no-four": no_four}
    times: dict[tuple[str, int], list[float]] = {(m, n): [] for m in modes for n in COUNTS}
    max_diff = {n: 0.0 for n in COUNTS}
    argmax_flips = {n: 0 for n in COUNTS}
    for r in range(args.rounds + 1):  # round 0 warms up
        for n in COUNTS:
            tokens = [rng.randrange(1000, 20000) for _ in range(n)]
            order = list(modes)[r % len(modes) :] + list(modes)[: r % len(modes)]
            out = {}
            for m in order:
                model.set_linear_plan(modes[m])
                dt, out[m] = forward(n, tokens)
                if r:
                    times[(m, n)].append(dt)
            max_diff[n] = max(max_diff[n], (out["plain"] - out["planned"]).abs().max().item())
            argmax_flips[n] += int((out["plain"].argmax(-1) != out["planned"].argmax(-1)).sum())

    def med(m: str, n: int) -> float:
        return statistics.median(times[(m, n)])

    def iqr(m: str, n: int) -> str:
        q = statistics.quantiles(times[(m, n)], n=4)
        return f"{q[0] * 1e3:.1f}-{q[2] * 1e3:.1f}"

    print(f"\nwhole forward after a {PREFIX}-token prefix, median of {args.rounds} (IQR), ms")
    print(
        f"{'n':>3} {'plain':>7} {'IQR':>11} {'planned':>8} {'IQR':>11} {'no-copy':>8} "
        f"{'no-four':>8} {'plain/1':>8} {'planned/1':>10} {'no-copy/1':>10} {'no-four/1':>10} "
        f"{'speedup':>8} {'no-four/planned':>16} {'max|dlogit|':>12} {'flips':>6}"
    )
    for n in COUNTS:
        p, q, c, f = (med(m, n) for m in modes)
        print(
            f"{n:>3} {p * 1e3:>7.1f} {iqr('plain', n):>11} {q * 1e3:>8.1f} "
            f"{iqr('planned', n):>11} {c * 1e3:>8.1f} {f * 1e3:>8.1f} {p / med('plain', 1):>8.2f} "
            f"{q / med('planned', 1):>10.2f} {c / med('no-copy', 1):>10.2f} "
            f"{f / med('no-four', 1):>10.2f} {p / q:>8.2f} {f / q:>16.2f} "
            f"{max_diff[n]:>12.2e} {argmax_flips[n]:>6}"
        )
    # The fastest of the rounds: on a shared machine other processes only ever add time.
    print(f"\nbest of {args.rounds} rounds, ms (less sensitive to other processes' load)")
    print(
        f"{'n':>3} {'plain':>7} {'planned':>8} {'no-copy':>8} {'no-four':>8} {'plain/1':>8} "
        f"{'planned/1':>10} {'no-copy/1':>10} {'no-four/1':>10} {'speedup':>8} "
        f"{'no-four/planned':>16}"
    )
    best = {k: min(v) for k, v in times.items()}
    for n in COUNTS:
        p, q, c, f = (best[(m, n)] for m in modes)
        print(
            f"{n:>3} {p * 1e3:>7.1f} {q * 1e3:>8.1f} {c * 1e3:>8.1f} {f * 1e3:>8.1f} "
            f"{p / best[('plain', 1)]:>8.2f} {q / best[('planned', 1)]:>10.2f} "
            f"{c / best[('no-copy', 1)]:>10.2f} {f / best[('no-four', 1)]:>10.2f} "
            f"{p / q:>8.2f} {f / q:>16.2f}"
        )


if __name__ == "__main__":
    main()
