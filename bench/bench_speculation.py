"""Speculation with the defaults against plain decoding of the same engine, per prompt kind.

    python -m bench.bench_speculation --per-kind 4 --max-tokens 128   # --model-free: model alone
    python -m bench.bench_speculation --services --concurrency 1 16 --per-kind 4
    python -m bench.bench_speculation --services --model-set qwen2.5-coder \
        --target-dtype bfloat16 --concurrency 1 4 16 --per-kind 2
    python -m bench.bench_speculation --temperature 0.8 --seed 1 --presence-penalty 0.5 \
        --frequency-penalty 0.3 --repetition-penalty 1.1 --logprobs 5   # processors, logprobs
    python -m bench.bench_speculation --services --model-set qwen2.5-coder --target-dtype \
        bfloat16 --kinds code-edit revision chat everyday --concurrency 8 --drafts none
        # a mixed trace with the model-free draft alone (`--model-free` with no name: the model
        # draft alone; neither: the defaults)

Engine mode: one target (its kernel plan and cost profile loaded as the CLI loads them) serves
both configurations; for every prompt, plain and speculative decoding run one after the other,
alternating which goes first, so drift in background load hits both alike. Reported per kind
(chat, code, math, everyday) and on the mix: tokens/s of each, their ratio (total tokens over
total time), the worst single prompt, the mean accepted length, and whether the outputs are
equal token for token.

Services mode: all services in this process over Redis (embedded), the default settings; at
concurrency c, rounds of c requests alternate between speculative and plain decoding
(`augury.speculate = false`, the same stack) and the ratio of their tokens/s is reported. The
prompts take the kinds in turn (`--kinds`), so every running set mixes them.
Prefix caching is off in both modes: every run computes its own prompt.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from shared.engine.drafting import Drafter
from shared.engine.model_free import ModelFreeDrafter
from shared.engine.presets import DEFAULT_GENERATE_DRAFT, DEFAULT_METHOD
from shared.engine.spec_engine import SpecEngine
from shared.engine.verifier import Verifier
from shared.model import load_model
from shared.model.cost_profiles import load_or_measure
from shared.model.model_set import (
    MODEL_SETS,
    SMOLLM2,
    all_draft_dirs,
    model_set_drafts,
    model_set_target,
    target_dir,
)
from shared.model.quantized import DRAFT_WEIGHTS, uses_int8
from shared.model.runner import ModelRunner
from shared.scheduling.request import AcceptanceStats
from shared.values.sampling import SamplingParams
from tools.prompts import in_turn, kind_prompt_ids
from tools.workloads import COPY_KINDS

KINDS = ("chat", "code", "math", "everyday")
KV_BYTES = 256 << 20


def prompts_by_kind(
    per_kind: int, model_set: str = SMOLLM2, kinds: Sequence[str] = KINDS
) -> dict[str, list[list[int]]]:
    """`per_kind` prompts of each kind: the datasets' (`KINDS`) or the copy-heavy workloads'
    (`COPY_KINDS`: a function to edit, a paragraph to revise, ...)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_set_target(model_set))
    return {kind: kind_prompt_ids(tokenizer, kind, per_kind) for kind in kinds}


@dataclass
class Tally:
    tokens: int = 0
    seconds: float = 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


@dataclass
class KindResult:
    plain: Tally = field(default_factory=Tally)
    spec: Tally = field(default_factory=Tally)
    worst: float = float("inf")  # lowest per-prompt ratio
    equal: int = 0
    prompts: int = 0
    stats: AcceptanceStats = field(default_factory=AcceptanceStats)

    @property
    def ratio(self) -> float:
        return self.spec.tokens_per_s / self.plain.tokens_per_s


def build_engines(
    draft: str, threads: int, draft_weights: str = "auto", model_free: Sequence[str] = ()
) -> tuple[SpecEngine, SpecEngine]:
    """Plain and speculative engines over one target runner (one kernel plan, one profile).
    No prefix caching: the engine that ran a prompt second would find the first one's KV."""
    tdir = target_dir()
    target = ModelRunner(load_model(tdir), kv_memory_bytes=KV_BYTES, prefix_caching=False)
    ddir = all_draft_dirs()[draft]
    drafter = Drafter(
        ModelRunner(
            load_model(ddir, target_path=tdir, int8=uses_int8(draft_weights, "cpu")),
            kv_memory_bytes=KV_BYTES,
            prefix_caching=False,
        ),
        name=draft,
    )
    started = time.perf_counter()
    cost = load_or_measure(target, {draft: drafter.runner}, target_name=tdir.name)
    print(f"cost profile ready in {time.perf_counter() - started:.1f} s", flush=True)
    eos = target.cfg.eos_token_ids
    verifier = Verifier(target)
    plain = SpecEngine(verifier, eos_token_ids=eos)
    # the model draft first (the fixed chooser's), model-free drafts merged beside it
    drafters = {draft: drafter, **{name: ModelFreeDrafter(name) for name in model_free}}
    spec = SpecEngine(verifier, drafters, DEFAULT_METHOD, eos_token_ids=eos, cost=cost)
    return plain, spec


def run_one(
    engine: SpecEngine, prompt: list[int], params: SamplingParams
) -> tuple[list[int], float]:
    started = time.perf_counter()
    [request] = engine.generate([prompt], params)
    return request.output, time.perf_counter() - started


def run_pair(
    plain: SpecEngine, spec: SpecEngine, prompt: list[int], params: SamplingParams, spec_first: bool
) -> tuple[dict[str, list[int]], dict[str, float]]:
    """Plain and speculative decoding of one prompt back to back (`spec_first`: which goes
    first, alternated by the caller so that drift hits both): outputs and seconds by name."""
    order = [("spec", spec), ("plain", plain)] if spec_first else [("plain", plain), ("spec", spec)]
    outputs, seconds = {}, {}
    for name, engine in order:
        outputs[name], seconds[name] = run_one(engine, prompt, params)
    return outputs, seconds


def sampling_params(args: argparse.Namespace) -> SamplingParams:
    """The options every measured request carries (greedy by default). With a seed, sampled
    speculation is Gumbel-coupled and its output equals plain decoding's token for token."""
    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        seed=args.seed,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        repetition_penalty=args.repetition_penalty,
        logprobs=args.logprobs,
    )


def bench_engine(args: argparse.Namespace) -> dict[str, KindResult]:
    args.draft = args.draft or DEFAULT_GENERATE_DRAFT
    plain, spec = build_engines(args.draft, args.threads, args.draft_weights, args.model_free)
    prompts = prompts_by_kind(args.per_kind)
    params = sampling_params(args)
    for engine in (plain, spec):  # warm-up
        run_one(engine, prompts["chat"][0][:16], SamplingParams(max_tokens=8))
    results = {kind: KindResult() for kind in KINDS}
    turn = 0
    for kind in KINDS:
        for prompt in prompts[kind]:
            res = results[kind]
            before = AcceptanceStats()
            before.merge(spec.stats)
            outputs, seconds = run_pair(plain, spec, prompt, params, spec_first=turn % 2 == 1)
            turn += 1
            n = len(outputs["plain"])
            res.plain.tokens += n
            res.plain.seconds += seconds["plain"]
            res.spec.tokens += len(outputs["spec"])
            res.spec.seconds += seconds["spec"]
            ratio = (len(outputs["spec"]) / seconds["spec"]) / (n / seconds["plain"])
            res.worst = min(res.worst, ratio)
            res.equal += outputs["plain"] == outputs["spec"]
            res.prompts += 1
            step = spec.stats
            delta = AcceptanceStats(
                step.num_drafts - before.num_drafts,
                step.num_draft_tokens - before.num_draft_tokens,
                step.num_accepted - before.num_accepted,
                [],
                step.num_target_forwards - before.num_target_forwards,
            )
            res.stats.merge(delta)
            print(
                f"{kind:9s} {n:4d} tokens  plain {n / seconds['plain']:6.1f} tok/s  spec "
                f"{len(outputs['spec']) / seconds['spec']:6.1f} tok/s  x{ratio:.2f}  "
                f"acc.len {delta.mean_accepted_length:.2f}",
                flush=True,
            )
    return results


def report(results: dict[str, KindResult], args: argparse.Namespace) -> str:
    lines = [
        f"draft {args.draft} (weights {args.draft_weights})"
        f"{''.join(f' + {m} merged' for m in args.model_free[:1])}, "
        f"method {DEFAULT_METHOD.kind} (goodput planner), "
        f"{torch.get_num_threads()} threads, {args.per_kind} prompts per kind, "
        f"max {args.max_tokens} tokens, {sampling_params(args)}",
        "",
        "| kind | plain tok/s | speculative tok/s | ratio | worst prompt | acc.len | =plain |",
        "|---|---|---|---|---|---|---|",
    ]
    mix = KindResult()
    for kind, r in results.items():
        lines.append(
            f"| {kind} | {r.plain.tokens_per_s:.1f} | {r.spec.tokens_per_s:.1f} | "
            f"{r.ratio:.2f}x | {r.worst:.2f}x | {r.stats.mean_accepted_length:.2f} | "
            f"{r.equal}/{r.prompts} |"
        )
        mix.plain.tokens += r.plain.tokens
        mix.plain.seconds += r.plain.seconds
        mix.spec.tokens += r.spec.tokens
        mix.spec.seconds += r.spec.seconds
        mix.worst = min(mix.worst, r.worst)
        mix.equal += r.equal
        mix.prompts += r.prompts
        mix.stats.merge(r.stats)
    lines.append(
        f"| **mix** | {mix.plain.tokens_per_s:.1f} | {mix.spec.tokens_per_s:.1f} | "
        f"**{mix.ratio:.2f}x** | {mix.worst:.2f}x | {mix.stats.mean_accepted_length:.2f} | "
        f"{mix.equal}/{mix.prompts} |"
    )
    return "\n".join(lines)


async def bench_services(args: argparse.Namespace) -> str:
    from bench.bench_services import ServicesRunner
    from services.run import start_stack
    from services.runtime import ModelPaths
    from shared.bus import redis_url
    from shared.settings import MODEL_SET_CHOOSERS, AugurySettings, RedisSettings
    from tests.test_services_support import Client

    by_kind = prompts_by_kind(args.per_kind, args.model_set, args.kinds)
    prompts = in_turn(by_kind.values())  # so that every running set mixes the kinds
    params = SamplingParams(max_tokens=args.max_tokens)
    with redis_url(RedisSettings()) as url:
        settings = AugurySettings(
            redis=RedisSettings(url=url),
            engine={
                "kv_memory_bytes": KV_BYTES,
                "draft_weights": args.draft_weights,
                "target_dtype": args.target_dtype,
                # rounds repeat the prompts: a cache would give every round after the first
                # its prefill, and plain rounds more of it than feature-draft speculation
                "enable_prefix_caching": False,
            },
            # the set's chooser (`scheduler.draft_chooser` auto) for its served drafts
            models={"model_free": tuple(args.model_free), "model_set": args.model_set},
            service={"cell": "bench", "replica": "bench"},
        )
        # the set's served drafts where its chooser picks among them; under `fixed` (SmolLM2)
        # the first, which every request uses
        default = list(model_set_drafts(args.model_set, served=True))
        if MODEL_SET_CHOOSERS[args.model_set] == "fixed" or args.draft:
            default = [args.draft or default[0]]
        served = args.drafts or default
        if served == ["none"]:  # the model-free drafts alone
            served = []
        drafts = model_set_drafts(args.model_set)
        models = ModelPaths(
            model_set_target(args.model_set),
            {name: drafts[name] for name in served},
            model_free=tuple(args.model_free),
        )
        stack = await start_stack(settings, url, models, gateway=False)
        client = Client(url, settings, "bench-client")
        runner = ServicesRunner(stack, client)
        lines = [
            f"services, default settings ({args.model_set}, target {args.target_dtype or 'fp32'}"
            f"; drafts {', '.join([*served, *args.model_free])}; weights {args.draft_weights}), "
            f"{len(prompts)} prompts ({', '.join(args.kinds)}, in turn) x "
            f"max {args.max_tokens} tokens per round, {args.rounds} rounds",
            "",
            "| concurrency | plain tok/s | speculative tok/s | ratio, each round | worst "
            "| =plain |",
            "|---|---|---|---|---|---|",
        ]
        try:
            await runner.run(prompts[:2], SamplingParams(max_tokens=4), 2)  # warm-up
            for c in args.concurrency:
                ratios, plain_tps, spec_tps = [], [], []
                num_equal = num_outputs = 0
                for r in range(args.rounds):
                    order = [False, True] if r % 2 else [True, False]
                    tps, outputs = {}, {}
                    for speculate in order:
                        run = await runner.run(prompts, params, c, speculate=speculate)
                        tps[speculate] = run.tokens_per_s
                        outputs[speculate] = run.outputs
                    plain = outputs[False]
                    num_equal += sum(outputs[True].get(i) == out for i, out in plain.items())
                    num_outputs += len(plain)
                    ratios.append(tps[True] / tps[False])
                    plain_tps.append(tps[False])
                    spec_tps.append(tps[True])
                    print(f"c={c} round {r}: x{ratios[-1]:.2f}", flush=True)
                each = " ".join(f"{r:.2f}x" for r in ratios)
                lines.append(
                    f"| {c} | {sum(plain_tps) / len(plain_tps):.1f} | "
                    f"{sum(spec_tps) / len(spec_tps):.1f} | {each} | {min(ratios):.2f}x | "
                    f"{num_equal}/{num_outputs} |"
                )
        finally:
            await client.close()
            await stack.stop()
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--per-kind", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--draft", help=f"default: {DEFAULT_GENERATE_DRAFT} (the set's first draft)")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument(
        "--draft-weights",
        choices=DRAFT_WEIGHTS,
        default="auto",
        help="the draft's linear layers with int8 weights (auto, the default: on a CPU)",
    )
    ap.add_argument("--services", action="store_true")
    ap.add_argument("--model-set", choices=MODEL_SETS, default=SMOLLM2, help="with --services")
    ap.add_argument(
        "--target-dtype", choices=["float32", "bfloat16"], help="with --services: the target's"
    )
    ap.add_argument(
        "--model-free",
        nargs="*",
        default=["ngram"],
        choices=["ngram", "suffix"],
        help="model-free drafts beside the model draft, the first's trees merged with the model "
        "draft's, as models.model_free does (default: ngram, the default; none given: none)",
    )
    ap.add_argument(
        "--drafts",
        nargs="+",
        help="with --services: the stack's draft set, in order (the first drafts every request, "
        "as the default chooser does; the services' default: draft-e draft-s draft-m draft-l); "
        "none: no model draft, the --model-free drafts alone; default: --draft alone, or "
        "without it the set's served drafts (SmolLM2: draft-e alone)",
    )
    ap.add_argument("--temperature", type=float, default=0.0, help="engine mode: 0 is greedy")
    ap.add_argument("--seed", type=int, help="engine mode: seeded (coupled) sampling")
    ap.add_argument("--presence-penalty", type=float, default=0.0)
    ap.add_argument("--frequency-penalty", type=float, default=0.0)
    ap.add_argument("--repetition-penalty", type=float, default=1.0)
    ap.add_argument("--logprobs", type=int, help="engine mode: ask for N top logprobs")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 16])
    ap.add_argument(
        "--kinds",
        nargs="+",
        default=list(KINDS),
        choices=[*KINDS, *COPY_KINDS],
        help="with --services: the prompt kinds, mixed in one trace (copy-heavy ones too)",
    )
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if not args.services and (args.model_set != SMOLLM2 or args.target_dtype):
        ap.error("--model-set and --target-dtype are for --services; in one "
                 "process: python -m bench.bench_model_set")  # fmt: skip
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.services:
        print(asyncio.run(bench_services(args)))
        return
    results = bench_engine(args)
    print()
    print(report(results, args))
    if args.json:
        rows = {
            k: {"plain_tps": r.plain.tokens_per_s, "spec_tps": r.spec.tokens_per_s,
                "ratio": r.ratio, "worst": r.worst, "equal": r.equal, "prompts": r.prompts}
            for k, r in results.items()
        }  # fmt: skip
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
