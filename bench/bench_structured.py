"""Structured output: constrained decoding with speculation against constrained plain decoding.

    python -m bench.bench_structured --model-set smollm2 --reps 3 --out structured.json
    python -m bench.bench_structured --model-set qwen2.5-coder --target-dtype bfloat16
    python -m bench.bench_structured --quick        # a correctness run, not a measurement

The prompts (`bench/data/structured_prompts.json`) are JSON extraction with a schema each and
tool calls constrained to a union of five functions' argument schemas. Every set runs greedy
through the chat template, single stream (one request at a time) and at concurrency 8, plain and
speculative interleaved per repetition on one target model. It prints, per set and concurrency,
the speedup (plain seconds / speculative seconds), tokens per target forward, the grammar's mask
time per output token and its share of the step time; and checks that speculative outputs equal
plain ones and validate against their schemas (jsonschema).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DATA = Path(__file__).parent / "data" / "structured_prompts.json"
KV_BYTES = 512 << 20


@dataclass
class Run:
    outputs: list[list[int]]
    seconds: float
    tokens: int
    target_forwards: int
    mask_seconds: float
    masks: int
    forced_tokens: int


def load_prompts(tokenizer: Any, quick: bool) -> dict[str, list[tuple[list[int], str]]]:
    """Per set, (prompt ids through the chat template, schema text)."""
    data = json.loads(DATA.read_text())
    sets = {}
    for name, items in data.items():
        items = items[:2] if quick else items
        sets[name] = [
            (
                list(
                    tokenizer.apply_chat_template(
                        [{"role": "user", "content": item["prompt"]}],
                        add_generation_prompt=True,
                        tokenize=True,
                        return_dict=False,
                    )
                ),
                json.dumps(item["schema"]),
            )
            for item in items
        ]
    return sets


def run_set(engine: Any, prompts: list[tuple[list[int], str]], concurrency: int, max_tokens: int):
    """Every prompt greedily, at most `concurrency` at a time (continuous batching)."""
    from shared.values.sampling import SamplingParams, StructuredOutput

    grammar = engine.grammar.stats
    before = (grammar.mask_seconds, grammar.masks, grammar.forced_tokens)
    forwards = engine.stats.num_target_forwards
    ids: list[str] = []
    pending = list(prompts)
    start = time.perf_counter()
    while pending or engine.has_unfinished():
        while pending and sum(1 for i in ids if engine.requests[i].finish_reason is None) < (
            concurrency
        ):
            prompt, schema = pending.pop(0)
            params = SamplingParams(
                max_tokens=max_tokens, structured=StructuredOutput("json_schema", schema)
            )
            ids.append(engine.add_request(prompt, params))
        engine.step()
    seconds = time.perf_counter() - start
    outputs = [engine.requests.pop(i).output for i in ids]
    return Run(
        outputs,
        seconds,
        sum(len(o) for o in outputs),
        engine.stats.num_target_forwards - forwards,
        grammar.mask_seconds - before[0],
        grammar.masks - before[1],
        grammar.forced_tokens - before[2],
    )


def build_engines(args: argparse.Namespace) -> tuple[Any, dict[str, Any]]:
    """The tokenizer, and a plain engine and one per configuration on one target model."""
    from transformers import AutoTokenizer

    from bench.bench_model_free import Models
    from shared.model.model_set import model_set_drafts, model_set_target
    from shared.scheduling.config import SchedulerConfig
    from shared.values.methods import DraftMethod

    tokenizer = AutoTokenizer.from_pretrained(model_set_target(args.model_set))
    models = Models(
        args.planner, args.model_set, args.target_dtype, kv_bytes=KV_BYTES, tokenizer=tokenizer
    )
    methods = {
        "chain": DraftMethod("chain", k=4),
        "dynamic": DraftMethod("dynamic", budget=16, max_size=16, max_depth=6, max_width=4),
    }
    default_draft = next(iter(model_set_drafts(args.model_set, served=True)))
    configs = [c.replace("DRAFT", default_draft) for c in args.configs or ["DRAFT"]]
    engines = {"plain": models.plain_engine(SchedulerConfig(max_running_requests=8))}
    for config in configs:
        engines[config] = models.engine(config, methods[args.method], max_running_requests=8)
    return tokenizer, engines


def check(
    tokenizer: Any, plain: Run, spec: Run, prompts: list[tuple[list[int], str]]
) -> tuple[int, int]:
    """(speculative outputs that differ from plain decoding's, plain outputs that do not parse
    or validate: a document cut by --max-tokens counts there)."""
    import jsonschema

    differ = invalid = 0
    for out_plain, out_spec, (_, schema) in zip(plain.outputs, spec.outputs, prompts, strict=True):
        differ += out_plain != out_spec
        try:
            document = json.loads(tokenizer.decode(out_plain, skip_special_tokens=True))
            jsonschema.validate(document, json.loads(schema))
        except (json.JSONDecodeError, jsonschema.ValidationError):
            invalid += 1
    return differ, invalid


def summary(name: str, concurrency: int, plain: list[Run], spec: list[Run]) -> dict[str, Any]:
    def total(runs: list[Run], key: str) -> float:
        return sum(getattr(r, key) for r in runs)

    spec_seconds = total(spec, "seconds")
    return {
        "set": name,
        "concurrency": concurrency,
        "speedup": round(total(plain, "seconds") / spec_seconds, 3),
        "plain_tokens_per_s": round(total(plain, "tokens") / total(plain, "seconds"), 2),
        "spec_tokens_per_s": round(total(spec, "tokens") / spec_seconds, 2),
        "tokens_per_forward": round(total(spec, "tokens") / total(spec, "target_forwards"), 3),
        "forced_drafted_per_token": round(total(spec, "forced_tokens") / total(spec, "tokens"), 3),
        "mask_us_per_token": round(1e6 * total(spec, "mask_seconds") / total(spec, "tokens"), 1),
        "mask_share_of_step": round(total(spec, "mask_seconds") / spec_seconds, 4),
        "plain_mask_share_of_step": round(
            total(plain, "mask_seconds") / total(plain, "seconds"), 4
        ),
    }


def main(argv: Sequence[str] | None = None) -> int:
    import torch

    from shared.model.precision import TARGET_DTYPES

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-set", default="smollm2", help="smollm2 or qwen2.5-coder")
    parser.add_argument(
        "--configs",
        nargs="+",
        help="speculative configurations as in bench.bench_model_free (a draft, `ngram`, "
        "`A+B` merged trees); DRAFT stands for the set's served default draft (the default)",
    )
    parser.add_argument("--sets", nargs="+", choices=["json", "tools"], default=["json", "tools"])
    parser.add_argument("--method", choices=["chain", "dynamic"], default="dynamic")
    parser.add_argument(
        "--planner", default="goodput", help="SchedulerConfig.planner (the services' default)"
    )
    parser.add_argument("--target-dtype", choices=TARGET_DTYPES, default="float32")
    parser.add_argument("--max-tokens", type=int, default=160)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="2 prompts a set, 1 rep, 2 at once")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    if args.quick:
        args.reps, args.max_tokens, args.concurrency = 1, 96, [2]
    if args.threads:
        torch.set_num_threads(args.threads)
    tokenizer, engines = build_engines(args)
    sets = load_prompts(tokenizer, args.quick)
    sets = {name: sets[name] for name in args.sets}
    rows, differ, invalid = [], 0, 0
    for name, prompts in sets.items():
        for concurrency in args.concurrency:
            for engine in engines.values():  # untimed: first-shape costs (oneDNN, grammars)
                run_set(engine, prompts[:2], concurrency, args.max_tokens)
            runs: dict[str, list[Run]] = {mode: [] for mode in engines}
            for _ in range(args.reps):  # interleaved: drift in the machine hits both alike
                for mode, engine in engines.items():
                    runs[mode].append(run_set(engine, prompts, concurrency, args.max_tokens))
                for mode in runs.keys() - {"plain"}:
                    d, i = check(tokenizer, runs["plain"][-1], runs[mode][-1], prompts)
                    differ, invalid = differ + d, invalid + i
            for mode in runs.keys() - {"plain"}:
                row = {"config": mode, **summary(name, concurrency, runs["plain"], runs[mode])}
                rows.append(row)
                print(json.dumps(row), flush=True)
    print(f"speculative outputs differing from plain decoding: {differ}")
    print(f"plain outputs that do not parse or validate (cut by --max-tokens included): {invalid}")
    if args.out:
        result = {
            "model_set": args.model_set,
            "method": args.method,
            "rows": rows,
            "differ": differ,
            "invalid": invalid,
        }
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0 if differ == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
