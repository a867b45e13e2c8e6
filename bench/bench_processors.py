"""Speculation's speed-up with logits processors and logprobs against its plain-sampling one.

    python -m bench.bench_processors --per-kind 2 --max-tokens 128 --threads 2
    python -m bench.bench_processors --variants sampling penalties logprobs --per-kind 1
    python -m bench.bench_processors --model-set qwen2.5-coder --target-dtype bfloat16 --threads 2

Every variant samples seeded at one temperature (seeded sampling is Gumbel-coupled, so the
speculative output equals plain decoding's token for token) and adds its own options: the
presence (0.5), frequency (0.3) or repetition (1.1) penalty alone, the three together
(`penalties`), or 5 top logprobs (`logprobs`). One target and the default drafts (the set's
model draft, `ngram` merged beside it) serve every variant; for each prompt every variant runs
plain and speculative decoding one after the other (alternating which goes first, the variants
in rotating order), so drift in background load hits all of them alike. The table gives per
variant the speed-up (speculative over plain tokens/s), that speed-up over the plain-sampling
variant's, and tokens per target forward (bonus included): a processor that only costs time
lowers the first ratio at the same tokens per forward, one that changes the text changes both.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

import torch

from bench.bench_model_free import Models
from bench.bench_speculation import KINDS, Tally, prompts_by_kind, run_one, run_pair
from shared.engine.presets import DEFAULT_METHOD
from shared.engine.spec_engine import SpecEngine
from shared.model.model_set import MODEL_SETS, SMOLLM2, model_set_drafts
from shared.model.precision import TARGET_DTYPES
from shared.values.sampling import SamplingParams

VARIANTS: dict[str, dict[str, float | int]] = {
    "sampling": {},
    "presence": {"presence_penalty": 0.5},
    "frequency": {"frequency_penalty": 0.3},
    "repetition": {"repetition_penalty": 1.1},
    "penalties": {"presence_penalty": 0.5, "frequency_penalty": 0.3, "repetition_penalty": 1.1},
    "logprobs": {"logprobs": 5},
}


@dataclass
class VariantResult:
    plain: Tally = field(default_factory=Tally)
    spec: Tally = field(default_factory=Tally)
    forwards: int = 0  # the speculative engine's target forwards
    equal: int = 0
    prompts: int = 0

    @property
    def ratio(self) -> float:
        return self.spec.tokens_per_s / self.plain.tokens_per_s

    @property
    def tokens_per_forward(self) -> float:
        return self.spec.tokens / self.forwards if self.forwards else 0.0


def run_prompt(
    plain: SpecEngine,
    spec: SpecEngine,
    prompt: list[int],
    params: SamplingParams,
    spec_first: bool,
    result: VariantResult,
) -> float:
    """Plain and speculative decoding of one prompt; the speculative / plain ratio."""
    forwards = spec.stats.num_target_forwards
    outputs, seconds = run_pair(plain, spec, prompt, params, spec_first)
    result.plain.tokens += len(outputs["plain"])
    result.plain.seconds += seconds["plain"]
    result.spec.tokens += len(outputs["spec"])
    result.spec.seconds += seconds["spec"]
    result.forwards += spec.stats.num_target_forwards - forwards
    result.equal += outputs["plain"] == outputs["spec"]
    result.prompts += 1
    return (len(outputs["spec"]) / seconds["spec"]) / (len(outputs["plain"]) / seconds["plain"])


def bench(args: argparse.Namespace) -> dict[str, VariantResult]:
    models = Models("goodput", args.model_set, args.target_dtype)
    config = args.draft if args.model_free == "none" else f"{args.draft}+{args.model_free}"
    plain, spec = models.plain_engine(), models.engine(config)
    base = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed)
    params = {name: replace(base, **VARIANTS[name]) for name in args.variants}  # type: ignore[arg-type]
    prompts = prompts_by_kind(args.per_kind, args.model_set)
    for engine in (plain, spec):  # warm-up
        run_one(engine, prompts["chat"][0][:16], SamplingParams(max_tokens=8))
    results = {name: VariantResult() for name in args.variants}
    turn = 0
    for kind in KINDS:
        for prompt in prompts[kind]:
            names = list(args.variants)
            names = names[turn % len(names) :] + names[: turn % len(names)]
            for name in names:
                ratio = run_prompt(plain, spec, prompt, params[name], turn % 2 == 1, results[name])
                print(f"{kind:9s} {name:10s} x{ratio:.2f}", flush=True)
            turn += 1
    return results


def report(results: dict[str, VariantResult], args: argparse.Namespace) -> str:
    baseline = results.get("sampling")
    lines = [
        f"model set {args.model_set} (target {args.target_dtype}), draft {args.draft}"
        f"{'' if args.model_free == 'none' else ' + ' + args.model_free}, "
        f"method {DEFAULT_METHOD.kind} "
        f"(goodput planner), {torch.get_num_threads()} threads, {args.per_kind} prompts per "
        f"kind, max {args.max_tokens} tokens, temperature {args.temperature}, seed {args.seed}",
        "",
        "| variant | plain tok/s | speculative tok/s | speed-up | / sampling's | tokens per "
        "forward | =plain |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        relative = f"{r.ratio / baseline.ratio:.3f}" if baseline else "-"
        lines.append(
            f"| {name} | {r.plain.tokens_per_s:.1f} | {r.spec.tokens_per_s:.1f} | "
            f"{r.ratio:.2f}x | {relative} | {r.tokens_per_forward:.2f} | {r.equal}/{r.prompts} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    ap.add_argument("--per-kind", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--model-set", choices=sorted(MODEL_SETS), default=SMOLLM2)
    ap.add_argument("--target-dtype", choices=TARGET_DTYPES, default="float32")
    ap.add_argument("--draft", help="default: the set's default draft")
    ap.add_argument(
        "--model-free",
        choices=["ngram", "suffix", "none"],
        default="ngram",
        help="merged beside the draft, as served by default (none: the draft alone)",
    )
    ap.add_argument("--threads", type=int, default=0)
    args = ap.parse_args(argv)
    if args.draft is None:
        args.draft = next(iter(model_set_drafts(args.model_set, served=True)))
    if args.threads:
        torch.set_num_threads(args.threads)
    print(report(bench(args), args))


if __name__ == "__main__":
    main()
