"""What the penalties cost per verification: `process_logits` on a tree's rows, against the dense
version it replaced (an [N, C] counts tensor over the whole vocabulary), interleaved.

    python -m bench.bench_processor_cost --vocab 49152 151936 --rows 1 8 24

Random logits, a 300-token prompt and a 200-token output of random ids, each row a path of 0-4
draft tokens; the two versions' outputs are checked equal before timing. Prints the median
milliseconds of each and their ratio, per vocabulary, variant and row count.
"""

from __future__ import annotations

import argparse
import random
import statistics
from collections.abc import Sequence

import torch

from bench.timing import median_ms
from shared.engine.processors import process_logits
from shared.values.sampling import SamplingParams, TokenHistory

VARIANTS = {
    "repetition": {"repetition_penalty": 1.1},
    "penalties": {"presence_penalty": 0.5, "frequency_penalty": 0.3, "repetition_penalty": 1.1},
}


def dense_penalties(
    logits: torch.Tensor, params: SamplingParams, history: TokenHistory, paths: list[list[int]]
) -> torch.Tensor:
    """The penalties over [N, C] counts of the whole vocabulary (the version before 2026-11-29)."""
    num_rows, num_cols = logits.shape
    x = logits.float().clone()
    counts = torch.bincount(torch.tensor(history.output), minlength=num_cols).float()
    counts = counts.expand(num_rows, num_cols).clone()
    rows = torch.tensor([row for row, path in enumerate(paths) for _ in path], dtype=torch.long)
    if len(rows):
        tokens = torch.tensor([token for path in paths for token in path], dtype=torch.long)
        counts.index_put_((rows, tokens), torch.ones(len(rows)), accumulate=True)
    seen = counts > 0
    if params.repetition_penalty != 1.0:
        in_prompt = torch.zeros(num_cols, dtype=torch.bool)
        in_prompt[torch.tensor(history.prompt)] = True
        p = params.repetition_penalty
        x = torch.where(seen | in_prompt[None, :], torch.where(x > 0, x / p, x * p), x)
    x -= params.frequency_penalty * counts
    x -= params.presence_penalty * seen.float()
    return x


def time_both(
    logits: torch.Tensor,
    params: SamplingParams,
    history: TokenHistory,
    paths: list[list[int]],
    repeats: int,
) -> tuple[float, float]:
    """(dense, process_logits) median ms over three interleaved rounds of `repeats` calls."""
    torch.testing.assert_close(
        process_logits(logits, params, history, paths),
        dense_penalties(logits, params, history, paths),
    )
    dense, sparse = [], []
    for _ in range(3):
        dense.append(median_ms(lambda: dense_penalties(logits, params, history, paths), repeats))
        sparse.append(median_ms(lambda: process_logits(logits, params, history, paths), repeats))
    return statistics.median(dense), statistics.median(sparse)


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--vocab", type=int, nargs="+", default=[49152, 151936])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 24])
    ap.add_argument("--repeats", type=int, default=7, help="calls per timed round")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    rng = random.Random(0)
    print("| vocabulary | variant | rows | dense ms | process_logits ms | ratio |")
    print("|---|---|---|---|---|---|")
    for vocab in args.vocab:
        prompt = tuple(rng.randrange(vocab) for _ in range(300))
        output = tuple(rng.randrange(vocab) for _ in range(200))
        history = TokenHistory(output_len=len(output), output=output, prompt=prompt)
        for name, options in VARIANTS.items():
            params = SamplingParams(temperature=0.8, **options)
            for rows in args.rows:
                paths = [[rng.randrange(vocab) for _ in range(i % 5)] for i in range(rows)]
                logits = torch.randn(rows, vocab)
                dense, sparse = time_both(logits, params, history, paths, args.repeats)
                print(
                    f"| {vocab} | {name} | {rows} | {dense:.2f} | {sparse:.2f} | "
                    f"{sparse / dense:.2f} |"
                )


if __name__ == "__main__":
    main()
