"""Measure this machine's forward latencies (target and drafts) and save them as a cost profile.

    python -m tools.profile --threads 2                         # CPU, fp32, the default models
    python -m tools.profile --device cuda --dtype bfloat16 --max-tokens 512 --random-weights
    python -m tools.profile --model-set qwen2.5-coder --target-dtype bfloat16 --threads 2
    python -m tools.profile --device cuda --dtype bfloat16 --random-weights \
        --target bench/shapes/Qwen2.5-Coder-1.5B-shape \
        --drafts qwen2.5-coder-0.5b=bench/shapes/Qwen2.5-Coder-0.5B-shape

The profile (`shared/scheduling/cost_model.py`) goes to
`profiles/<model>-<device>-<dtype>-t<threads>.json` unless `--out` says otherwise; the
scheduler's `CostModel` reads it. Latency depends on shapes only, so `--random-weights` builds
each model from its checkpoint's config.json with random weights (a GPU machine without the
target's weights can still be profiled). The table at the end gives, per model and context, each
forward's latency and its ratio to a forward of 1 token: the ratio is what decides how many
tokens a speculative step can verify almost for free.
"""

from __future__ import annotations

import argparse
import json
import platform
from datetime import UTC, datetime
from pathlib import Path

import torch

from shared.model import LlamaModel, load_model
from shared.model.cuda_graphs import DEFAULT_MAX_TOKENS as DEFAULT_GRAPH_TOKENS
from shared.model.loader import read_config
from shared.model.model_set import MODEL_SETS, SMOLLM2, model_set_drafts, model_set_target
from shared.model.profile_files import DEFAULT_PROFILES_DIR
from shared.model.profiling import measure_profile, profile_key
from shared.model.quantized import DRAFT_WEIGHTS, uses_int8
from shared.model.runner import ModelRunner
from shared.scheduling.cost_model import CostModel, CostProfile


def random_model(path: Path, dtype: torch.dtype, device: str) -> LlamaModel:
    """A model with the checkpoint's architecture and random weights (no target needed)."""
    torch.manual_seed(0)
    # Built on the device in the target dtype: an 8B model in fp32 on the host would take 32 GB
    # and minutes of initialization.
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaModel(read_config(path))
    finally:
        torch.set_default_dtype(previous)
    model.output_token_ids = model.output_token_ids.long()
    model.init_rope(torch.device(device))
    return model.eval()


def kv_bytes_for(model: LlamaModel, dtype: torch.dtype, contexts, max_tokens, requests) -> int:
    """KV room for `requests` requests at every context plus their tokens, with slack."""
    cfg = model.cfg
    per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * dtype.itemsize
    tokens = requests * sum(c + max_tokens + 32 for c in contexts)
    return max(16 << 20, int(per_token * tokens * 1.1))


def draft_dir(arg: str, named: dict[str, Path]) -> tuple[str, Path]:
    """A `--drafts` entry as (name, directory): a set's draft name, a folder, or NAME=FOLDER
    (a shape folder profiled under the name the set gives its draft)."""
    if "=" in arg:
        name, folder = arg.split("=", 1)
        return name, Path(folder)
    return Path(arg).name, named.get(arg, Path(arg))


def table(profile: CostProfile) -> str:
    """Per model: tokens x context, ms and the ratio to n = 1 at the same context."""
    lines = []
    models = [(profile.target.key.model + " (target)", profile.target)]
    models += list(profile.drafts.items())
    for name, mp in models:
        c = mp.curve
        lines.append(f"\n{name}: ms per forward (ratio to n=1)")
        head = f"{'tokens':>7} " + " ".join(f"{'ctx ' + str(x):>19}" for x in c.contexts)
        lines.append(head)
        lines.append("-" * len(head))
        for i, n in enumerate(c.tokens):
            cells = [
                f"{c.ms_grid[i][j]:9.2f} ({c.ms_grid[i][j] / c.ms_grid[0][j]:5.2f}x)"
                for j in range(len(c.contexts))
            ]
            lines.append(f"{n:7d} " + " ".join(f"{cell:>19}" for cell in cells))
        if c.rel_spread is not None:
            worst = max(v for row in c.rel_spread for v in row)
            median = sorted(v for row in c.rel_spread for v in row)[
                len(c.contexts) * len(c.tokens) // 2
            ]
            lines.append(f"relative spread (IQR / median): median {median:.2f}, worst {worst:.2f}")
    cost = CostModel(profile)
    lines.append(
        f"\nknee (largest n with verify_ms(n) <= 1.1 x verify_ms(1), context 256): "
        f"{cost.knee_tokens(0.1)} tokens; 1.5x: {cost.knee_tokens(0.5)} tokens"
    )
    for name in cost.draft_models:
        ratio = cost.draft_cost_per_token_ms(name) / cost.verify_ms(1, 256)
        lines.append(
            f"{name}: {cost.draft_cost_per_token_ms(name):.2f} ms per 1-token forward at context "
            f"256 = {ratio:.3f} x the target's"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-set", choices=MODEL_SETS, default=SMOLLM2)
    ap.add_argument("--target", type=Path, help="target checkpoint (default: the set's target)")
    ap.add_argument(
        "--drafts",
        nargs="*",
        help="names, directories or NAME=DIRECTORY (default: the set's drafts)",
    )
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32")
    ap.add_argument(
        "--target-dtype",
        choices=["float32", "bfloat16", "float16", "int8"],
        help="the target's own dtype (default: --dtype), as AUGURY_ENGINE__TARGET_DTYPE "
        "(int8: int8 weights, fp32 elsewhere)",
    )
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch default)")
    ap.add_argument("--max-tokens", type=int, help="largest forward (default 64 CPU, 512 CUDA)")
    ap.add_argument("--contexts", type=int, nargs="+", default=[0, 256, 1024])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--max-requests", type=int, default=8)
    ap.add_argument("--quick", action="store_true", help="the services' quick grid instead")
    ap.add_argument("--random-weights", action="store_true")
    ap.add_argument(
        "--no-kernel-plan",
        action="store_true",
        help="on a CPU, measure plain F.linear instead of the measured per-shape kernel plan "
        "(the plan is stored in the profile and applied by whoever loads it)",
    )
    ap.add_argument(
        "--cuda-graph-max-tokens",
        type=int,
        default=DEFAULT_GRAPH_TOKENS,
        help="on CUDA, forwards of up to this many tokens replay CUDA graphs, as the services "
        "run them (0: every forward eager)",
    )
    ap.add_argument(
        "--draft-weights",
        choices=DRAFT_WEIGHTS,
        default="auto",
        help="the drafts' linear layers with int8 weights, as the services run them "
        "(AUGURY_ENGINE__DRAFT_WEIGHTS; auto: on a CPU that has the kernels)",
    )
    ap.add_argument("--notes", default="", help="free text stored in the profile")
    ap.add_argument("--out", type=Path, help="default: profiles/<model>-<device>-<dtype>-t<n>")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device visible to torch")
    dtype = getattr(torch, args.dtype)
    target_int8 = args.target_dtype == "int8"
    target_dtype = torch.float32 if target_int8 else getattr(torch, args.target_dtype or args.dtype)
    max_tokens = args.max_tokens or (512 if args.device == "cuda" else 64)

    tdir = args.target or model_set_target(args.model_set)
    named = model_set_drafts(args.model_set)
    draft_names = list(named) if args.drafts is None else args.drafts
    ddirs = dict(draft_dir(d, named) for d in draft_names)

    draft_int8 = uses_int8(args.draft_weights, args.device)

    def build(path: Path, *, is_draft: bool = True) -> ModelRunner:
        model_dtype = dtype if is_draft else target_dtype
        if args.random_weights:
            model = random_model(path, model_dtype, args.device)
        else:
            model = load_model(path, dtype=model_dtype, device=args.device, target_path=tdir)
        if is_draft and draft_int8:
            model.quantize_int8()
        elif not is_draft and target_int8:
            model.quantize_int8(per_token=True)
        elif args.device == "cpu" and not args.no_kernel_plan:
            model.plan_kernels()
        kv = kv_bytes_for(model, model_dtype, args.contexts, max_tokens, args.max_requests)
        return ModelRunner(
            model, kv_memory_bytes=kv, cuda_graph_max_tokens=args.cuda_graph_max_tokens
        )

    target = build(tdir, is_draft=False)
    drafts = {name: build(path) for name, path in ddirs.items()}
    when = datetime.now(UTC).isoformat(timespec="seconds")
    notes = "; ".join(
        filter(
            None,
            [
                f"measured {when} on {platform.node()} by python -m tools.profile",
                f"torch {torch.__version__}",
                "random weights" if args.random_weights else "",
                f"CUDA graphs up to {target.graphs.max_tokens} tokens" if target.graphs else "",
                args.notes,
            ],
        )
    )
    profile = measure_profile(
        target,
        drafts,
        target_name=tdir.name,
        max_tokens=max_tokens,
        quick=args.quick,
        contexts=args.contexts if not args.quick else None,
        repeats=args.repeats if not args.quick else None,
        max_requests=args.max_requests,
        progress=True,
        notes=notes,
    )
    out = args.out or DEFAULT_PROFILES_DIR / f"{profile_key(target, tdir.name).file_stem}.json"
    profile.save(out)
    print(table(profile))
    print(f"\nsaved {out}")
    print(json.dumps(profile.target.key.model_dump()))


if __name__ == "__main__":
    main()
