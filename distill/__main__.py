"""Rebuild the default drafts from scratch, or evaluate them.

    python -m distill build --out models/drafts      # data + target cache + train + export
    python -m distill eval --drafts models/drafts    # acceptance, costs, winners -> eval.json
    python -m distill kinds --names draft-e          # through the real engine, per prompt kind
    python -m distill winners                        # fastest draft per request, all four drafts
    python -m distill fusion --steps 500             # EAGLE-3's fused layers against the last

Fixed seeds throughout; the target's top-k cache lives in --cache (ignored by git) and is reused
when present (delete it to start over).
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from pathlib import Path

import torch

from distill import data, fusion
from distill.data import tokenizer_fingerprint
from distill.evaluate import METHOD_KEYS
from distill.model import (
    DRAFT_SPECS,
    MODEL_SET_DRAFTS,
    DraftSpec,
    export_draft,
    load_trainable,
    new_draft,
)
from distill.train import FEATURE_PASSES, LEVEL_CONTEXT, seed_everything, train_draft
from shared.model.model_set import (
    ALL_DRAFT_NAMES,
    DRAFT_NAMES,
    DRAFTS_DIR,
    MODEL_SETS,
    REPO_ROOT,
    SMOLLM2,
    target_dir,
)

SEED = 1234


def build(args: argparse.Namespace) -> None:
    started = time.time()
    torch.set_num_threads(args.threads)
    seed_everything(SEED)
    model_set: str = args.model_set
    recipe, tdir, cache_dir = data.set_data(model_set, args.cache)
    out_dir: Path = args.out or recipe.drafts_dir
    cache_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    cache = data.build_topk_cache(cache_dir, tdir, recipe)
    data_seconds = time.time() - t0
    gen_starts = data.load_gen_starts(cache_dir, recipe)
    fingerprint = tokenizer_fingerprint(tdir)
    bos, eos = data.bos_eos(fingerprint)
    target_tensors = data.target_init_tensors(tdir, recipe)
    set_names = MODEL_SET_DRAFTS[model_set]
    names = args.drafts.split(",") if args.drafts else list(set_names)
    unknown = [n for n in names if n not in set_names]
    if unknown:
        raise SystemExit(f"{unknown} are not drafts of {model_set}: {list(set_names)}")
    features = None
    if any(DRAFT_SPECS[n].is_feature_level for n in names):
        features = data.load_features(cache_dir, recipe)
    summary = {
        "sequences": cache.num_sequences,
        "tokens": len(cache.tokens),
        "generated_sequences": int(cache.generated.sum()),
        "top_k": int(cache.topk_ids.shape[1]),
        "data_seconds": round(data_seconds, 1),
    }
    print(json.dumps({"distillation_data": summary}))
    for name in names:
        i = set_names.index(name)  # the seed depends on the draft, not on the subset built
        seed_everything(SEED + i)
        earlier = None
        if args.continue_from is not None:
            # a committed draft trained further on today's recipe: its weights and output
            # vocabulary are kept, the optimizer starts again (warm-up, then cosine)
            draft = load_trainable(args.continue_from / name, tdir).train()
            draft.freeze_target_tensors()
            earlier = json.loads((args.continue_from / name / "metadata.json").read_text())
        else:
            spec = DRAFT_SPECS[name]
            vocab = data.draft_vocabulary(recipe, cache, spec.num_output_tokens, [bos, eos, 0])
            draft = new_draft(spec, tdir, target_tensors, torch.from_numpy(vocab), SEED + i)
        spec = replace(
            draft.spec,
            train_steps=args.steps or draft.spec.train_steps,
            lr=args.lr or draft.spec.lr,
        )
        stats = train_draft(
            draft,
            spec,
            cache,
            gen_starts,
            seed=SEED + i,
            features=features,
            feature_passes=args.feature_passes,
            level_context=args.level_context,
        )
        if earlier is not None:
            stats["continued_from"] = {
                "distillation_data": earlier["distillation_data"],
                "training": earlier["training"],
            }
            stats["lr"] = spec.lr
        meta = {
            "name": name,
            "target": tdir.name,
            "tokenizer": "the target's (load it from the target checkpoint)",
            "reads": "the target's features (last layer, after the final norm) and tokens"
            if spec.is_feature_level
            else "tokens",
            "target_tokenizer": fingerprint,
            "parameters": draft.num_parameters(),
            "seed": SEED + i,
            "distillation_data": summary,
            "training": stats,
            "rebuild": rebuild_command(args, name, spec, earlier),
            "model_set": model_set,
        }
        out = export_draft(draft, out_dir / name, bos_token_id=bos, eos_token_id=eos, metadata=meta)
        print(json.dumps({"exported": str(out), **stats}))
    print(json.dumps({"build_seconds": round(time.time() - started, 1)}))


def rebuild_command(
    args: argparse.Namespace, name: str, spec: DraftSpec, earlier: dict | None
) -> str:
    """How to make this draft again: the earlier draft's commands, then this build's."""
    first = "python -m distill build --out models/drafts"
    if args.model_set != SMOLLM2:
        first = (
            f"python -m distill build --model-set {args.model_set} --steps {spec.train_steps} "
            f"--feature-passes {args.feature_passes} --level-context {args.level_context}"
        )
    if earlier is None:
        return first
    drafts_dir = data.RECIPES[args.model_set].drafts_dir.relative_to(REPO_ROOT)
    model_set = "" if args.model_set == SMOLLM2 else f" --model-set {args.model_set}"
    command = (
        f"python -m distill build{model_set} --drafts {name} --continue-from {drafts_dir} "
        f"--steps {spec.train_steps} --lr {spec.lr}"
    )
    if spec.is_feature_level:
        command += f" --feature-passes {args.feature_passes} --level-context {args.level_context}"
    before = earlier.get("rebuild", first)
    return f"{before}, then {command}"


def evaluate_cmd(args: argparse.Namespace) -> None:
    from distill.evaluate import evaluate, markdown_report

    torch.set_num_threads(args.threads)
    seed_everything(SEED)
    # token-level drafts only: teacher-forced ranks read no target features (a feature-level
    # draft's agreement per tree level is `python -m distill levels`)
    names = [n for n in DRAFT_NAMES if (args.drafts / n / "config.json").is_file()]
    drafts = {n: args.drafts / n for n in names}
    result = evaluate(
        target_dir(),
        drafts,
        n_per_kind=args.n,
        max_new_tokens=args.max_new_tokens,
        cache_dir=args.cache,
    )
    out = args.out or (args.drafts / "eval.json")
    out.write_text(json.dumps(result, indent=2) + "\n")
    report = markdown_report(result)
    out.with_suffix(".md").write_text(report)
    print(report)


def trees_cmd(args: argparse.Namespace) -> None:
    from distill.evaluate import KINDS, engine_trees, target_references

    torch.set_num_threads(args.threads)
    tdir = target_dir()
    refs = target_references(tdir, args.n, args.max_new_tokens, args.cache / "eval_references.json")
    few = [r for kind in KINDS for r in [x for x in refs if x.kind == kind][: args.per_kind]]
    names = args.names.split(",")
    rows = engine_trees(tdir, {n: args.drafts / n for n in names}, few)
    out = args.drafts / "engine_trees.json"
    out.write_text(json.dumps(rows, indent=2) + "\n")
    lines = ["| draft | method | mean accepted (engine) | acceptance rate | outputs = greedy |"]
    lines.append("|---|---|---|---|---|")
    for r in rows:
        lines.append(
            f"| {r['draft']} | {r['method']} | {r['engine_mean_accepted_length']:.2f} | "
            f"{r['engine_acceptance_rate']:.3f} | "
            f"{r['outputs_equal_target_greedy']}/{r['requests']} |"
        )
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def winners_cmd(args: argparse.Namespace) -> None:
    """The per-request winner histogram through the real engine, every named draft (a
    feature-level one included) and plain decoding as contenders, per kind (everyday included)."""
    from distill.evaluate import engine_winners, measure_costs, target_references, winners_report
    from shared.datasets import EVAL_KINDS

    torch.set_num_threads(args.threads)
    tdir = target_dir()
    cache = args.cache / "eval_references_kinds.json"
    refs = target_references(tdir, args.n, args.max_new_tokens, cache, EVAL_KINDS)
    refs = [r for r in refs if len(r.continuation) >= 2]
    drafts = {n: args.drafts / n for n in args.names.split(",")}
    int8 = args.draft_weights == "int8"
    costs = measure_costs(tdir, drafts, int8=int8)
    result = engine_winners(tdir, drafts, refs, costs, chain=args.chain, int8=int8)
    result["draft_weights"] = args.draft_weights
    result["n_per_kind"] = args.n
    result["max_new_tokens"] = args.max_new_tokens
    result["target_decode_ms"] = round(1e3 * costs.target_decode, 3)
    result["draft_step_ms"] = {k: round(1e3 * v[1], 3) for k, v in costs.draft_step.items()}
    out = args.drafts / "engine_winners.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    report = winners_report(result)
    out.with_suffix(".md").write_text(report)
    print(report)


def levels_cmd(args: argparse.Namespace) -> None:
    """Feature-level drafts' held-out top-1 agreement with the target per tree level, on the
    model set's current recipe's held-out target answers (the cache must have been built)."""
    from distill.train import (
        BATCH_TOKENS,
        BatchBuilder,
        agreement_by_level,
        make_batches,
        split_validation,
    )

    torch.set_num_threads(args.threads)
    recipe, tdir, cache_dir = data.set_data(args.model_set, args.cache)
    if not data.features_path(cache_dir, recipe).is_file():
        raise SystemExit(
            f"no feature cache for {args.model_set}'s current recipe in {cache_dir}: build it "
            f"with `python -m distill build --model-set {args.model_set} --steps 1` first"
        )
    cache = data.build_topk_cache(cache_dir, tdir, recipe)
    gen_starts = data.load_gen_starts(cache_dir, recipe)
    features = data.load_features(cache_dir, recipe)
    _, validation_ids = split_validation(cache)
    validation = make_batches(cache, BATCH_TOKENS, validation_ids)
    for path in args.drafts:
        draft = load_trainable(path, tdir).eval()
        if not draft.spec.is_feature_level:
            raise SystemExit(f"{path} is not a feature-level draft")
        builder = BatchBuilder(cache, draft.output_token_ids.numpy(), gen_starts, features)
        levels = agreement_by_level(draft, builder, validation, args.levels)
        print(json.dumps({"draft": str(path), "held_out_top1_by_level": levels}), flush=True)


def kinds_cmd(args: argparse.Namespace) -> None:
    """Each named draft through the real engine, per kind (everyday chat included), with the
    draft's step cost against the target's."""
    from distill.evaluate import engine_by_kind, measure_costs, target_references
    from shared.datasets import EVAL_KINDS

    torch.set_num_threads(args.threads)
    tdir = target_dir()
    cache = args.cache / "eval_references_kinds.json"
    refs = target_references(tdir, args.n, args.max_new_tokens, cache, EVAL_KINDS)
    refs = [r for r in refs if len(r.continuation) >= 2]
    names = args.names.split(",")
    drafts = {n: args.drafts / n for n in names}
    int8 = args.draft_weights == "int8"
    costs = measure_costs(tdir, drafts, int8=int8)
    rows = engine_by_kind(tdir, drafts, refs, methods=args.methods.split(","), int8=int8)
    result = {
        "draft_weights": args.draft_weights,
        "n_per_kind": args.n,
        "max_new_tokens": args.max_new_tokens,
        "kinds": list(EVAL_KINDS),
        "target_decode_ms": round(1e3 * costs.target_decode, 3),
        "target_verify_ms": {n: round(1e3 * t, 3) for n, t in costs.target_verify.items()},
        "draft_step_ms": {k: round(1e3 * v[1], 3) for k, v in costs.draft_step.items()},
        "rows": rows,
    }
    out = args.drafts / "engine_kinds.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    lines = [
        f"Target decode step {result['target_decode_ms']:.1f} ms; draft step (width 1): "
        + ", ".join(
            f"{k} {v:.2f} ms ({v / result['target_decode_ms']:.1%})"
            for k, v in result["draft_step_ms"].items()
        ),
        "",
        "| draft | method | " + " | ".join(EVAL_KINDS) + " | mix | outputs = greedy |",
        "|---|---|" + "---|" * (len(EVAL_KINDS) + 2),
    ]
    for name in names:
        for method in dict.fromkeys(r["method"] for r in rows):
            mine = [r for r in rows if r["draft"] == name and r["method"] == method]
            cells = {r["kind"]: r for r in mine}
            forwards = sum(r["engine_target_forwards"] for r in mine)
            tokens = sum(
                r["engine_mean_accepted_length"] * r["engine_target_forwards"] for r in mine
            )
            same = sum(r["outputs_equal_target_greedy"] for r in mine)
            total = sum(r["requests"] for r in mine)
            per_kind = " | ".join(
                f"{cells[k]['engine_mean_accepted_length']:.2f}" if k in cells else "-"
                for k in EVAL_KINDS
            )
            lines.append(
                f"| {name} | {method} | {per_kind} | {tokens / max(forwards, 1):.2f} | "
                f"{same}/{total} |"
            )
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def draft_weights_option(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--draft-weights",
        choices=["native", "int8"],
        default="native",
        help="the drafts as trained, or their linear layers with int8 weights (what the "
        "services run on a CPU by default)",
    )


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m distill", description=__doc__)
    sub = parser.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="rebuild the drafts from scratch")
    b.add_argument(
        "--model-set",
        choices=MODEL_SETS,
        default=SMOLLM2,
        help="whose drafts: smollm2's four (committed in models/drafts) or qwen2.5-coder's "
        "feature draft (committed in models/qwen2.5-coder)",
    )
    b.add_argument("--out", type=Path, default=None, help="default: by model set (above)")
    b.add_argument(
        "--cache", type=Path, default=None, help=f"default: {data.CACHE_ROOT}[/<model set>]"
    )
    b.add_argument("--drafts", default="", help="subset, e.g. " + ",".join(ALL_DRAFT_NAMES))
    b.add_argument("--threads", type=int, default=2)
    b.add_argument(
        "--continue-from",
        type=Path,
        default=None,
        help="train the drafts found here further (their weights and vocabulary) on the recipe",
    )
    b.add_argument("--steps", type=int, default=0, help="training steps (default: the spec's)")
    b.add_argument("--lr", type=float, default=0.0, help="peak learning rate (default: the spec's)")
    b.add_argument(
        "--feature-passes",
        type=int,
        default=FEATURE_PASSES,
        help="a feature-level draft's passes per batch: 1 on the target's features, then each "
        "further pass on its own predictions of the pass before (trains one tree level deeper)",
    )
    b.add_argument(
        "--level-context",
        choices=["chain", "own"],
        default=LEVEL_CONTEXT,
        help="what a feature-level draft's deeper passes attend to: 'chain' as when drafting "
        "(the committed context and the node's chain), 'own' every pair of the pass",
    )
    e = sub.add_parser(
        "eval", help="evaluate the token-level drafts against the target (feature-level: levels)"
    )
    e.add_argument("--drafts", type=Path, default=DRAFTS_DIR)
    e.add_argument("--cache", type=Path, default=data.CACHE_ROOT)
    e.add_argument("--n", type=int, default=40, help="evaluation prompts per kind")
    e.add_argument("--max-new-tokens", type=int, default=128)
    e.add_argument("--out", type=Path, default=None)
    e.add_argument("--threads", type=int, default=2)
    t = sub.add_parser("trees", help="tree drafting through the real engine, a few requests")
    t.add_argument("--drafts", type=Path, default=DRAFTS_DIR)
    t.add_argument("--names", default=",".join(ALL_DRAFT_NAMES))
    t.add_argument("--cache", type=Path, default=data.CACHE_ROOT)
    t.add_argument("--n", type=int, default=40)
    t.add_argument("--per-kind", type=int, default=4)
    t.add_argument("--max-new-tokens", type=int, default=128)
    t.add_argument("--threads", type=int, default=2)
    k = sub.add_parser("kinds", help="drafts through the real engine, per prompt kind")
    k.add_argument("--drafts", type=Path, default=DRAFTS_DIR)
    k.add_argument("--names", default="draft-e")
    k.add_argument("--cache", type=Path, default=data.CACHE_ROOT)
    k.add_argument("--n", type=int, default=40, help="evaluation prompts per kind")
    k.add_argument("--max-new-tokens", type=int, default=128)
    k.add_argument("--threads", type=int, default=2)
    k.add_argument(
        "--methods",
        default=",".join(METHOD_KEYS),
        help="subset of " + ",".join(METHOD_KEYS),
    )
    draft_weights_option(k)
    w = sub.add_parser("winners", help="fastest draft per request, through the real engine")
    w.add_argument("--drafts", type=Path, default=DRAFTS_DIR)
    w.add_argument("--names", default=",".join(ALL_DRAFT_NAMES))
    w.add_argument("--cache", type=Path, default=data.CACHE_ROOT)
    w.add_argument("--n", type=int, default=20, help="evaluation prompts per kind")
    w.add_argument("--max-new-tokens", type=int, default=128)
    w.add_argument("--chain", type=int, default=4)
    w.add_argument("--threads", type=int, default=2)
    draft_weights_option(w)
    lv = sub.add_parser("levels", help="a feature-level draft's held-out top-1 per tree level")
    lv.add_argument("drafts", type=Path, nargs="+", help="draft directories")
    lv.add_argument("--model-set", choices=MODEL_SETS, default=SMOLLM2)
    lv.add_argument(
        "--cache", type=Path, default=None, help=f"default: {data.CACHE_ROOT}[/<model set>]"
    )
    lv.add_argument("--levels", type=int, default=4)
    lv.add_argument("--threads", type=int, default=2)
    fusion.add_parser(sub)
    args = parser.parse_args()
    if args.cmd == "build":
        build(args)
    elif args.cmd == "trees":
        trees_cmd(args)
    elif args.cmd == "kinds":
        kinds_cmd(args)
    elif args.cmd == "winners":
        winners_cmd(args)
    elif args.cmd == "levels":
        levels_cmd(args)
    elif args.cmd == "fusion":
        fusion.run(args)
    else:
        evaluate_cmd(args)


if __name__ == "__main__":
    main()
