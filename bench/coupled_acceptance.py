"""Acceptance of seeded (Gumbel-coupled) against multi-step speculative sampling, per draft.

    python -m bench.coupled_acceptance --per-kind 4 --max-tokens 96 --temperature 0.8

Every prompt runs twice per draft and method on one target: seeded (the draft proposes the argmax
of its own log-probabilities plus the request's Gumbel noise, the target accepts a node iff its
own perturbed argmax equals it) and unseeded (SpecInfer's multi-step speculative sampling: a
chain's children sampled from the draft, a tree's chosen by the draft and accepted by recursive
rejection). Acceptance does not depend on load or on the machine's speed, so the numbers of a
busy machine are the numbers; nothing here is timed. Reported per draft and method: tokens per
target forward (1 + accepted per step) and the acceptance rate of draft tokens.
"""

from __future__ import annotations

import argparse
import itertools
import json
import secrets
from collections.abc import Sequence
from pathlib import Path

from bench.bench_speculation import KINDS, KV_BYTES, prompts_by_kind
from shared.engine.drafting import Drafter
from shared.engine.spec_engine import SpecEngine
from shared.engine.verifier import Verifier
from shared.model import load_model
from shared.model.model_set import all_draft_dirs, target_dir
from shared.model.quantized import DRAFT_WEIGHTS, uses_int8
from shared.model.runner import ModelRunner
from shared.scheduling.config import SchedulerConfig
from shared.scheduling.request import AcceptanceStats
from shared.values.methods import DraftMethod
from shared.values.sampling import SEED_BITS, SamplingParams

METHODS = {
    "chain-4": DraftMethod("chain", k=4),
    "dynamic-16": DraftMethod("dynamic", budget=16, max_size=16, max_depth=6, max_width=4),
}


def measure(
    engine: SpecEngine, prompts: Sequence[list[int]], args: argparse.Namespace, coupled: bool
) -> AcceptanceStats:
    """Run every prompt alone (seeds 0.. when coupled) and return the engine's counters."""
    engine.core.stats = AcceptanceStats()
    for seed, prompt in enumerate(prompts):
        params = SamplingParams(
            temperature=args.temperature,
            top_p=args.top_p,
            seed=seed if coupled else None,
            max_tokens=args.max_tokens,
        )
        engine.generate([prompt], params)
    return engine.core.stats


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--per-kind", type=int, default=4, help=f"prompts of each of {KINDS}")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--temperature", type=float, default=0.8)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--drafts", nargs="+", default=None, help="default: every committed one")
    parser.add_argument("--methods", nargs="+", choices=sorted(METHODS), default=sorted(METHODS))
    parser.add_argument("--draft-weights", choices=DRAFT_WEIGHTS, default="auto")
    parser.add_argument("--json", type=Path, help="write the results here too")
    args = parser.parse_args(argv)

    prompts = list(itertools.chain.from_iterable(prompts_by_kind(args.per_kind).values()))
    tdir = target_dir()
    target = ModelRunner(load_model(tdir), kv_memory_bytes=KV_BYTES)
    verifier = Verifier(target)
    drafts = all_draft_dirs()
    names = args.drafts or list(drafts)
    rows = []
    # unseeded requests draw their engine seed from `secrets`: fixed here, so reruns agree
    counter = itertools.count(1 << 40)
    secrets.randbits = lambda bits: next(counter) % (1 << SEED_BITS)  # type: ignore[assignment]
    print(f"{len(prompts)} prompts, {args.max_tokens} tokens, temperature {args.temperature}")
    print("| draft | method | tokens/fwd coupled | multi-step | acceptance coupled | multi-step |")
    print("|---|---|---|---|---|---|")
    for name in names:
        int8 = uses_int8(args.draft_weights, "cpu")
        model = load_model(drafts[name], target_path=tdir, int8=int8)
        drafter = Drafter(ModelRunner(model, kv_memory_bytes=KV_BYTES), name=name)
        for label in args.methods:
            engine = SpecEngine(
                verifier,
                drafter,
                METHODS[label],
                SchedulerConfig(planner="fixed"),
                eos_token_ids=target.cfg.eos_token_ids,
            )
            coupled = measure(engine, prompts, args, coupled=True)
            multi = measure(engine, prompts, args, coupled=False)
            row = {
                "draft": name,
                "method": label,
                "coupled_tokens_per_forward": coupled.mean_accepted_length,
                "multi_step_tokens_per_forward": multi.mean_accepted_length,
                "coupled_acceptance": coupled.acceptance_rate,
                "multi_step_acceptance": multi.acceptance_rate,
            }
            rows.append(row)
            print(
                f"| {name} | {label} | {coupled.mean_accepted_length:.2f} | "
                f"{multi.mean_accepted_length:.2f} | {coupled.acceptance_rate:.1%} | "
                f"{multi.acceptance_rate:.1%} |",
                flush=True,
            )
    if args.json is not None:
        settings = vars(args) | {"json": str(args.json)}
        args.json.write_text(json.dumps({"args": settings, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
