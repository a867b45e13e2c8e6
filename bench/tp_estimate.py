"""`python -m bench.tp_estimate`: a paper estimate of a tensor-parallel target's step time, from a
measured single-GPU cost profile of a smaller target and an all-reduce cost model.

Nothing here runs a model. One rank's share of a sharded forward reads 1/N of the weights and
does 1/N of the FLOPs, so its time at T tokens is the measured forward of the profiled model
scaled by the ratio of weights read per rank (both the bandwidth-bound and the compute-bound
regime scale with it; attention over the KV cache scales with the KV heads per rank, a small
term at the contexts profiled). To that come two all-reduces per layer of T x hidden values and
the gather of the logits, each `alpha + 2 (N - 1) / N * bytes / bandwidth`. docs/tensor-parallel.md
explains the inputs and gives the table for a 70B target at TP 4 and 8 on the H200 profile.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from shared.scheduling.cost_model import CostProfile, ForwardCurve


@dataclass(frozen=True)
class Shape:
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def weights_read(self) -> float:
        """Parameters one forward reads: every layer's linear layers and the output head (the
        input embedding is a lookup)."""
        d = self.head_dim
        attention = self.hidden * d * (2 * self.heads + 2 * self.kv_heads)
        mlp = 3 * self.hidden * self.intermediate
        return self.layers * (attention + mlp) + self.hidden * self.vocab


LLAMA_3_8B = Shape(4096, 14336, 32, 32, 8, 128256)
LLAMA_3_70B = Shape(8192, 28672, 80, 64, 8, 128256)


def forward_ms(curve: ForwardCurve, tokens: int, context: int) -> float:
    """The profile's grid, interpolated linearly in tokens at the nearest measured context."""
    j = min(range(len(curve.contexts)), key=lambda i: abs(curve.contexts[i] - context))
    grid = curve.tokens
    if tokens <= grid[0]:
        return curve.ms_grid[0][j]
    for i in range(len(grid) - 1):
        if grid[i] <= tokens <= grid[i + 1]:
            w = (tokens - grid[i]) / (grid[i + 1] - grid[i])
            return curve.ms_grid[i][j] * (1 - w) + curve.ms_grid[i + 1][j] * w
    return curve.ms_grid[-1][j] * tokens / grid[-1]


def collective_ms(n: int, num_bytes: float, alpha_us: float, bandwidth_gbs: float) -> float:
    if n == 1:
        return 0.0
    return (alpha_us + 2 * (n - 1) / n * num_bytes / (bandwidth_gbs * 1e3)) / 1e3


@dataclass(frozen=True)
class Estimate:
    tp: int
    tokens: int
    compute_ms: float
    collectives_ms: float

    @property
    def step_ms(self) -> float:
        return self.compute_ms + self.collectives_ms


def estimate(
    curve: ForwardCurve,
    measured: Shape,
    target: Shape,
    tp: int,
    tokens: int,
    *,
    context: int = 256,
    alpha_us: float = 10.0,
    bandwidth_gbs: float = 450.0,
    bytes_per_value: int = 2,
) -> Estimate:
    ratio = target.weights_read() / tp / measured.weights_read()
    compute = ratio * forward_ms(curve, tokens, context)
    activations = tokens * target.hidden * bytes_per_value
    reduces = 2 * target.layers * collective_ms(tp, activations, alpha_us, bandwidth_gbs)
    logits = tokens * target.vocab * bytes_per_value
    gather = collective_ms(tp, logits / 2, alpha_us, bandwidth_gbs)  # all-gather: half a reduce
    return Estimate(tp, tokens, compute, reduces + gather)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.tp_estimate", description=__doc__)
    parser.add_argument(
        "--profile",
        type=Path,
        default=Path("profiles/Llama-3.1-8B-shape-cuda-nvidia-h200-bfloat16-t0.json"),
        help="a single-GPU profile of a Llama-3.1-8B-shaped target (the measured shape)",
    )
    parser.add_argument("--tp", type=int, nargs="+", default=[4, 8])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--alpha-us", type=float, nargs="+", default=[10.0, 25.0])
    parser.add_argument("--bandwidth-gbs", type=float, default=450.0)
    parser.add_argument("--draft-ms", type=float, default=5.0, help="a request's drafting time")
    parser.add_argument(
        "--accepted", type=float, nargs="+", default=[3.0, 4.0], help="tokens per verify step"
    )
    parser.add_argument("--context", type=int, default=256)
    args = parser.parse_args(argv)
    curve = CostProfile.load(args.profile).target.curve
    print(f"70B step time per rank from {args.profile.name} (context {args.context})")
    print("| TP | alpha (us) | tokens | rank's forward (ms) | collectives (ms) | step (ms) |")
    print("|---:|---:|---:|---:|---:|---:|")
    table: dict[tuple[int, float, int], Estimate] = {}
    for tp in args.tp:
        for alpha in args.alpha_us:
            for tokens in args.tokens:
                e = estimate(
                    curve,
                    LLAMA_3_8B,
                    LLAMA_3_70B,
                    tp,
                    tokens,
                    context=args.context,
                    alpha_us=alpha,
                    bandwidth_gbs=args.bandwidth_gbs,
                )
                table[tp, alpha, tokens] = e
                print(
                    f"| {tp} | {alpha:g} | {tokens} | {e.compute_ms:.1f} | "
                    f"{e.collectives_ms:.2f} | {e.step_ms:.1f} |"
                )
    tree = 16 if 16 in args.tokens else args.tokens[-1]
    print(f"\none request: plain decoding vs a {tree}-token tree (+{args.draft_ms:g} ms drafting)")
    print("| TP | alpha (us) | plain tok/s | accepted per step | speculative tok/s | speed-up |")
    print("|---:|---:|---:|---:|---:|---:|")
    for tp in args.tp:
        for alpha in args.alpha_us:
            plain = 1e3 / table[tp, alpha, 1].step_ms
            for accepted in args.accepted:
                spec = 1e3 * accepted / (table[tp, alpha, tree].step_ms + args.draft_ms)
                print(
                    f"| {tp} | {alpha:g} | {plain:.0f} | {accepted:g} | {spec:.0f} | "
                    f"{spec / plain:.2f}x |"
                )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
