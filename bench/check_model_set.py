"""Check a model set's real models: speculation's greedy output equals plain decoding's.

    python -m bench.check_model_set --model-set qwen2.5-coder --max-tokens 48 --out result.json

One prompt through the chat template; plain decoding of the target, then a chain and a dynamic
tree with the set's default draft (int8 weights where the CPU has the kernels, as the CLI and
the services run it), `planner=fixed` and no cost profile or kernel plan (nothing to measure
first: this checks outputs, not speed; the timings it prints are not benchmarks).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence
from pathlib import Path

DEFAULT_PROMPT = (
    "Add type hints and a docstring to this function, and raise ValueError when the list is "
    "empty:\n\ndef mean(values):\n    total = 0\n    for v in values:\n        total += v\n"
    "    return total / len(values)\n"
)


def main(argv: Sequence[str] | None = None) -> int:
    import torch
    from transformers import AutoTokenizer

    from shared.engine.drafting import Drafter
    from shared.engine.spec_engine import SpecEngine
    from shared.engine.verifier import Verifier
    from shared.model import load_model, load_target
    from shared.model.model_set import MODEL_SETS, model_set_drafts, model_set_target
    from shared.model.precision import check_target_precision
    from shared.model.quantized import uses_int8
    from shared.model.runner import ModelRunner
    from shared.scheduling.config import SchedulerConfig
    from shared.values.methods import DraftMethod
    from shared.values.sampling import SamplingParams

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-set", choices=MODEL_SETS, default="qwen2.5-coder")
    parser.add_argument("--prompt", default=DEFAULT_PROMPT)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument(
        "--target-dtype",
        choices=["float32", "bfloat16"],
        default="float32",
        help="the target's precision (drafts stay as they are)",
    )
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    target_dir = model_set_target(args.model_set)
    draft_name, draft_dir = next(iter(model_set_drafts(args.model_set, served=True).items()))
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    prompt = list(
        tokenizer.apply_chat_template(
            [{"role": "user", "content": args.prompt}],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )
    )
    precision = check_target_precision(args.target_dtype, "cpu", setting="--target-dtype")
    target = load_target(target_dir, precision)
    draft = load_model(draft_dir, target_path=target_dir, int8=uses_int8("auto", "cpu"))
    params = SamplingParams(max_tokens=args.max_tokens)
    methods: dict[str, DraftMethod | None] = {
        "plain": None,
        "chain k=4": DraftMethod("chain", k=4),
        "dynamic tree": DraftMethod("dynamic", budget=16, max_size=16, max_depth=6, max_width=4),
    }
    rows = []
    plain_output: list[int] | None = None
    for name, method in methods.items():
        verifier = Verifier(ModelRunner(target, kv_memory_bytes=256 << 20))
        drafter = None
        if method is not None:
            drafter = Drafter(ModelRunner(draft, kv_memory_bytes=256 << 20), name=draft_name)
        engine = SpecEngine(
            verifier,
            drafter,
            method,
            SchedulerConfig(planner="fixed"),
            eos_token_ids=target.cfg.eos_token_ids,
        )
        start = time.perf_counter()
        [req] = engine.generate([prompt], params)
        seconds = time.perf_counter() - start
        plain_output = req.output if plain_output is None else plain_output
        row = {
            "method": name,
            "tokens": len(req.output),
            "equals_plain": req.output == plain_output,
            "target_forwards": engine.stats.num_target_forwards,
            "mean_accepted_length": round(engine.stats.mean_accepted_length, 3),
            "seconds_untimed_busy_machine": round(seconds, 1),
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
    assert plain_output is not None
    result = {
        "model_set": args.model_set,
        "target": target_dir.name,
        "target_dtype": args.target_dtype,
        "draft": f"{draft_name} ({draft_dir.name}, int8={draft.is_int8})",
        "prompt_tokens": len(prompt),
        "text": tokenizer.decode(plain_output, skip_special_tokens=True),
        "output_ids": plain_output,
        "rows": rows,
    }
    print(result["text"])
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0 if all(r["equals_plain"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
