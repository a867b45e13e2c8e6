"""Single-stream speed of a model set on this CPU: speculation against plain decoding, interleaved.

    python -m bench.bench_model_set --model-set qwen2.5-coder --target-dtype bfloat16 \\
        --kinds code-edit revision code everyday --per-kind 3 --max-tokens 128 --json out.json
    python -m bench.bench_model_set --configs ngram draft-e draft-e+ngram --per-kind 2
    python -m bench.bench_model_set --draft new=DIR/qwen2.5-coder-e \\
        --configs qwen2.5-coder-e+ngram new+ngram      # a retrained draft against the committed

Every prompt is decoded greedily by each configuration in turn, so drift in background load
hits all alike: `plain` (this engine without a draft, the baseline at the same precision), the
speculation configurations (named as in `bench.bench_model_free`: a draft of the set, `ngram`,
`suffix`, `A+B` merged trees, `choose:A,B,...` the counterfactual chooser, `plan:A,B,...` the
planner's choice among them; all sized every step by the goodput planner on this machine's cost
profile, as `augury generate` runs; one engine per configuration for the whole run, as a
server lives, so what it learned of each draft on earlier prompts is its prior on the next) and
`hf-assisted` (transformers' assisted generation with the set's model draft, the target at the
same precision, the draft in fp32; not with an int8 target, which transformers cannot run).
Per kind and configuration it prints tokens/s, the ratio to plain (total tokens over total
time, and the worst single prompt's), tokens per target forward and how many outputs equal
plain decoding token for token.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from bench.bench_model_free import DATASET_KINDS, Models, prompts
from shared.model.hf_checkpoint import load_transformers_model
from shared.model.loader import read_config
from shared.model.model_set import MODEL_SETS, model_set_drafts
from shared.model.precision import TARGET_DTYPES
from shared.values.sampling import SamplingParams
from tools.workloads import COPY_KINDS

PLAIN = "plain"
HF_ASSISTED = "hf-assisted"


@dataclass
class Tally:
    """One configuration's totals on one kind."""

    tokens: int = 0
    seconds: float = 0.0
    forwards: int = 0
    equal: int = 0
    prompts: int = 0
    worst: float = float("inf")  # the lowest single prompt's speed over plain decoding's
    steps_by_draft: dict[str, int] = field(default_factory=dict)


# A run: prompt ids -> (output ids, target forwards or None, steps by draft)
Run = Callable[[list[int]], tuple[list[int], int | None, dict[str, int]]]


def engine_run(models: Models, config: str, max_tokens: int) -> Run:
    """One engine per configuration for the whole run, as a server lives: what its planner
    learned of each draft on earlier prompts is its prior on the next (each prompt still
    computes its own prefill: the runners cache no prefixes)."""
    params = SamplingParams(max_tokens=max_tokens)
    engine = models.engine(config) if config != PLAIN else models.plain_engine()

    def run(prompt: list[int]) -> tuple[list[int], int | None, dict[str, int]]:
        before = engine.stats.num_target_forwards
        [request] = engine.generate([prompt], params)
        steps = {m: s.num_target_forwards for m, s in request.draft_stats.items()}
        return request.output, engine.stats.num_target_forwards - before, steps

    return run


def assisted_run(models: Models, target_dtype: torch.dtype, max_tokens: int) -> Run:
    """transformers' `generate` with `assistant_model`: the set's first model draft that
    transformers can load (a full output head), in fp32."""
    draft_dir = next(p for p in models.draft_dirs.values() if not read_config(p).num_output_tokens)
    target = load_transformers_model(models.target_dir, target_dtype)
    draft = load_transformers_model(draft_dir, torch.float32)
    eos = list(models.target.cfg.eos_token_ids)

    def run(prompt: list[int]) -> tuple[list[int], int | None, dict[str, int]]:
        ids = torch.tensor([prompt])
        with torch.inference_mode():
            out = target.generate(
                ids, assistant_model=draft, do_sample=False, max_new_tokens=max_tokens,
                eos_token_id=eos, pad_token_id=eos[0],
            )  # fmt: skip
        output = out[0, len(prompt) :].tolist()
        while output and output[-1] in eos:  # our engine does not count the EOS it stops at
            output.pop()
        return output, None, {}

    return run


def measure(runs: dict[str, Run], batch: dict[str, list[list[int]]]) -> dict[str, dict[str, Tally]]:
    warm = next(iter(batch.values()))[0][:16]
    for run in runs.values():
        run(warm)
    tallies = {name: {kind: Tally() for kind in batch} for name in runs}
    for kind, kind_prompts in batch.items():
        for i, prompt in enumerate(kind_prompts):
            names = list(runs)
            names = names[i % len(names) :] + names[: i % len(names)]  # rotate who goes first
            outputs, seconds, per_forward, drafted = {}, {}, {}, {}
            for name in names:
                start = time.perf_counter()
                outputs[name], forwards, steps = runs[name](prompt)
                seconds[name] = time.perf_counter() - start
                if forwards:
                    per_forward[name] = round(len(outputs[name]) / forwards, 2)
                if len(steps) > 1:
                    drafted[name] = steps
                t = tallies[name][kind]
                t.seconds += seconds[name]
                t.tokens += len(outputs[name])
                t.forwards += forwards or 0
                t.prompts += 1
                for model, n in steps.items():
                    t.steps_by_draft[model] = t.steps_by_draft.get(model, 0) + n
            plain_rate = len(outputs[PLAIN]) / seconds[PLAIN]
            for name in runs:
                t = tallies[name][kind]
                t.equal += outputs[name] == outputs[PLAIN]
                t.worst = min(t.worst, len(outputs[name]) / seconds[name] / plain_rate)
            line = {n: round(len(outputs[n]) / seconds[n], 2) for n in runs}
            print(kind, i, "tok/s", line, flush=True)
            print(kind, i, "tok/fwd", per_forward, *(["steps", drafted] if drafted else []))
    return tallies


def report(tallies: dict[str, dict[str, Tally]]) -> tuple[str, dict]:
    kinds = list(next(iter(tallies.values())))
    lines = [
        "| configuration | " + " | ".join(kinds) + " |",
        "|---|" + "---|" * len(kinds),
    ]
    table: dict = {}
    for name, per_kind in tallies.items():
        cells = []
        for kind in kinds:
            t, base = per_kind[kind], tallies[PLAIN][kind]
            rate, base_rate = t.tokens / t.seconds, base.tokens / base.seconds
            per_forward = t.tokens / t.forwards if t.forwards else None
            table.setdefault(name, {})[kind] = {
                "tokens_per_s": round(rate, 3),
                "ratio_to_plain": round(rate / base_rate, 3),
                "tokens_per_target_forward": per_forward and round(per_forward, 2),
                "equal_to_plain": f"{t.equal}/{t.prompts}",
                "worst_prompt_ratio": round(t.worst, 3),
                "steps_by_draft": t.steps_by_draft,
            }
            tpf = f", {per_forward:.2f} tok/fwd" if per_forward else ""
            cells.append(
                f"{rate:.2f} tok/s, {rate / base_rate:.2f}x (worst {t.worst:.2f}x){tpf} "
                f"({t.equal}/{t.prompts})"
            )
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines), table


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-set", choices=MODEL_SETS, default="qwen2.5-coder")
    ap.add_argument("--target-dtype", choices=TARGET_DTYPES, default="float32")
    ap.add_argument("--kinds", nargs="+", default=["code-edit", "code", "everyday"],
                    choices=[*COPY_KINDS, *DATASET_KINDS])  # fmt: skip
    ap.add_argument("--configs", nargs="+", help="default: the set's model draft, ngram, suffix, "
                    "the draft merged with each, the chooser among all three")  # fmt: skip
    ap.add_argument("--draft", action="append", default=[], metavar="NAME=DIR",
                    help="another draft directory beside the set's, named in --configs as NAME "
                    "(e.g. one `python -m distill build --out DIR` trained, against the "
                    "committed one)")  # fmt: skip
    ap.add_argument("--no-assisted", action="store_true", help="skip transformers' assisted")
    ap.add_argument("--exact-attention", action="store_true", help="trees attend row by row")
    ap.add_argument("--per-kind", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    extra_drafts: dict[str, Path] = {}
    for extra in args.draft:
        name, _, path = extra.partition("=")
        if not name or not (Path(path) / "config.json").is_file():
            ap.error(f"--draft {extra!r}: want NAME=DIR, a directory with a config.json")
        extra_drafts[name] = Path(path)
    if args.threads:
        torch.set_num_threads(args.threads)
    draft = next(iter(model_set_drafts(args.model_set)))
    merged = [f"{draft}+ngram", f"{draft}+suffix", f"choose:{draft},ngram,suffix"]
    configs = args.configs or [draft, "ngram", "suffix", *merged]
    models = Models(
        "goodput",
        args.model_set,
        args.target_dtype,
        exact_attention=args.exact_attention,
        extra_drafts=extra_drafts,
    )
    runs = {PLAIN: engine_run(models, PLAIN, args.max_tokens)}
    runs |= {c: engine_run(models, c, args.max_tokens) for c in configs}
    if not args.no_assisted and args.target_dtype != "int8":  # transformers has no such target
        runs[HF_ASSISTED] = assisted_run(models, models.dtype, args.max_tokens)
    batch = prompts(args.kinds, args.per_kind, args.model_set)
    tallies = measure(runs, batch)
    text, table = report(tallies)
    print(text)
    if args.json:
        meta = {k: v for k, v in vars(args).items() if k != "json"}
        args.json.write_text(json.dumps({"args": meta, "results": table}, indent=2) + "\n")


if __name__ == "__main__":
    main()
