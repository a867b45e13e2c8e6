"""EAGLE-3's fusion of a low, a middle and a high target layer against the last layer's features,
for one feature-level draft: both variants on the same data, seed, schedule and passes.

    python -m distill fusion --steps 500 --out fusion.json   # SmolLM2: 21 + 2 x 13 min here
    python -m distill fusion --model-set qwen2.5-coder --steps 300

The baseline is the set's committed spec (`draft-e`, `qwen2.5-coder-e`): it reads the target's
last layer after the final norm and learns, beside the target's distribution, to regress its own
output onto the target's next feature, which its deeper tree levels then read. The fused variant
reads the outputs of target layers (2, L/2, L-3) side by side through one more projection, and
its deeper levels read its own output with no regression (EAGLE-3's training-time test: the
feature is whatever helps the next token). Both train `feature_passes` chained passes per batch.
What is compared is the held-out top-1 agreement with the target's own answers at tree levels
1-4 (level L reads the draft's own outputs L - 1 deep, as drafting does) and the chain length
they imply. The fused draft is not exported: the serving verifier returns one layer's features.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from distill import data
from distill.model import DRAFT_SPECS, MODEL_SET_DRAFTS, DraftSpec, new_draft
from distill.train import FEATURE_PASSES, seed_everything, train_draft
from shared.model.model_set import SMOLLM2

SEED = 1234
# A tenth of SmolLM2's committed recipe (700 answers, about 9 minutes on a 2-core AMD EPYC; the
# same prompts' first answers, shared with a full build's cache)
RECIPES = {
    SMOLLM2: data.Recipe(
        {"chat": 400, "code": 150, "math": 100, "everyday": 50},
        {"chat": 400, "code": 100, "math": 100},
    ),
    "qwen2.5-coder": data.RECIPES["qwen2.5-coder"],
}


def fused_layers(num_layers: int) -> tuple[int, int, int]:
    """A low, a middle and a high layer of a target with `num_layers` layers (0-based)."""
    return (2, num_layers // 2, num_layers - 3)


def expected_chain(levels: list[float]) -> float:
    """Tokens a chain of len(levels) accepts on average if level L's agreement holds given that
    the levels before it agreed (tree level L is measured teacher-forced on the answer's own
    earlier tokens, so the product is an approximation)."""
    total, alive = 0.0, 1.0
    for p in levels:
        alive *= p
        total += alive
    return round(total, 3)


def run(args: argparse.Namespace) -> dict:
    torch.set_num_threads(args.threads)
    recipe, tdir, cache_dir = data.set_data(args.model_set, args.cache, RECIPES)
    num_layers = json.loads((tdir / "config.json").read_text())["num_hidden_layers"]
    layers = fused_layers(int(num_layers))
    started = time.time()
    cache = data.build_topk_cache(cache_dir, tdir, recipe)
    gen_starts = data.load_gen_starts(cache_dir, recipe)
    last_layer = data.load_features(cache_dir, recipe)
    fused = data.build_fused_features(cache_dir, tdir, recipe, layers)
    data_seconds = time.time() - started
    base = DRAFT_SPECS[MODEL_SET_DRAFTS[args.model_set][-1]]
    assert base.is_feature_level, base.name
    base = replace(base, train_steps=args.steps)
    variants: dict[str, tuple[DraftSpec, np.ndarray]] = {
        "last layer": (base, last_layer),
        "fused": (replace(base, name=f"{base.name}-fused", fused_layers=layers), fused),
    }
    tensors = data.target_init_tensors(tdir, recipe)
    bos, eos = data.bos_eos(data.tokenizer_fingerprint(tdir))
    vocab = torch.from_numpy(
        data.draft_vocabulary(recipe, cache, base.num_output_tokens, [bos, eos, 0])
    )
    results: dict = {}
    for label, (spec, features) in variants.items():
        seed_everything(SEED)
        draft = new_draft(spec, tdir, tensors, vocab, SEED)
        stats = train_draft(
            draft,
            spec,
            cache,
            gen_starts,
            seed=SEED,
            features=features,
            feature_passes=args.feature_passes,
            level_context="chain",
        )
        levels = stats["held_out_top1_by_level"]
        results[label] = {
            "spec": spec.name,
            "fused_layers": list(spec.fused_layers),
            "parameters": draft.num_parameters(),
            "held_out_top1_by_level": levels,
            "expected_chain_of_4": expected_chain(levels),
            **{k: stats[k] for k in ("kept_step", "held_out_history", "train_seconds")},
        }
        print(json.dumps({label: results[label]}))
    out = {
        "model_set": args.model_set,
        "target": tdir.name,
        "recipe_tag": recipe.tag(),
        "tokens": len(cache.tokens),
        "sequences": cache.num_sequences,
        "steps": args.steps,
        "feature_passes": args.feature_passes,
        "threads": args.threads,
        "data_seconds": round(data_seconds, 1),
        "variants": results,
    }
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(out, indent=1) + "\n")
    return out


def add_parser(sub: argparse._SubParsersAction) -> None:
    f = sub.add_parser("fusion", help="EAGLE-3's fused layers against the last layer's features")
    f.add_argument("--model-set", choices=list(RECIPES), default=SMOLLM2)
    f.add_argument("--steps", type=int, default=500, help="training steps of each variant")
    f.add_argument("--feature-passes", type=int, default=FEATURE_PASSES)
    f.add_argument("--threads", type=int, default=2)
    f.add_argument(
        "--cache", type=Path, default=None, help=f"default: {data.CACHE_ROOT}[/<model set>]"
    )
    f.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
