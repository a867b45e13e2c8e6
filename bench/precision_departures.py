"""How often a lower-precision target's greedy output departs from its fp32 greedy output.

    python -m bench.precision_departures --model-set qwen2.5-coder --per-kind 4 --max-tokens 64

Plain greedy decoding (no draft) of the same prompts at fp32 and at `--dtype` (bfloat16 on a CPU
with AMX or AVX-512 BF16, or int8 weights). For each prompt: whether the outputs differ, and
where (the index of the first differing token). Counts tokens, not time, so the machine's load
does not matter.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from bench.bench_model_free import DATASET_KINDS, prompts
from shared.engine.spec_engine import SpecEngine
from shared.engine.verifier import Verifier
from shared.model import load_model, load_target
from shared.model.model_set import MODEL_SETS, model_set_target
from shared.model.precision import check_target_precision
from shared.model.runner import ModelRunner
from shared.values.sampling import SamplingParams
from tools.workloads import COPY_KINDS

KV_BYTES = 256 << 20


def greedy(model: torch.nn.Module, batch: dict[str, list[list[int]]], max_tokens: int) -> dict:
    engine = SpecEngine(
        Verifier(ModelRunner(model, kv_memory_bytes=KV_BYTES)),
        eos_token_ids=model.cfg.eos_token_ids,  # type: ignore[attr-defined]
    )
    params = SamplingParams(max_tokens=max_tokens)
    return {
        kind: [engine.generate([p], params)[0].output for p in kind_prompts]
        for kind, kind_prompts in batch.items()
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-set", choices=MODEL_SETS, default="qwen2.5-coder")
    ap.add_argument("--dtype", choices=["bfloat16", "int8"], default="bfloat16")
    ap.add_argument("--kinds", nargs="+", default=["code-edit", "revision", "code", "everyday",
                    "chat", "math"], choices=[*COPY_KINDS, *DATASET_KINDS])  # fmt: skip
    ap.add_argument("--per-kind", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    path = model_set_target(args.model_set)
    batch = prompts(args.kinds, args.per_kind, args.model_set)
    precision = check_target_precision(args.dtype, "cpu", setting="--dtype")
    low_model = load_target(path, precision)
    low = greedy(low_model, batch, args.max_tokens)
    full = greedy(load_model(path), batch, args.max_tokens)
    rows = []
    for kind in batch:
        for a, b in zip(full[kind], low[kind], strict=True):
            first = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
            if first is None and len(a) != len(b):
                first = min(len(a), len(b))
            rows.append({"kind": kind, "tokens": len(a), "departs_at": first})
    departed = [r for r in rows if r["departs_at"] is not None]
    same = [r["tokens"] if r["departs_at"] is None else r["departs_at"] for r in rows]
    summary = {
        "model_set": args.model_set,
        "dtype": args.dtype,
        "prompts": len(rows),
        "departed": len(departed),
        "identical_tokens_before_departure_or_end": sum(same),
        "rows": rows,
    }
    for r in rows:
        print(r)
    print(f"{len(departed)}/{len(rows)} prompts depart from fp32's greedy output within "
          f"{args.max_tokens} tokens")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2) + "\n")


if __name__ == "__main__":
    main()
