"""Speed of speculative decoding on this machine, as ratios against transformers' `generate`.

One process, same prompts, same models, batch 1, greedy:
  (a) transformers `generate`                    (the baseline, ratio 1.00)
  (b) our plain decoding                          (no draft)
  (c) our speculative decoding, each draft x each method (chain and tree; `defaults`: the
      default tree sized every step by the goodput planner, as `augury generate` runs), with
      the drafts' weights as trained and/or int8 (`--draft-weights native int8`)
  (d) transformers assisted generation (`assistant_model`) with the same draft (token-level
      drafts only: transformers has no assistant that reads the target's features)
  (e) with `--merge A B`: our speculative decoding drafting with A, each step's tree merged
      with B's (SpecInfer's merge-based trees, `scheduler.merge_drafts`), each method

    python -m bench.bench_engine --per-kind 4 --max-tokens 96 --markdown docs/bench_engine.md

Prompts are real and disjoint from the drafts' distillation text: ShareGPT chats, HumanEval
code, GSM8K math (`shared.datasets.eval_prompts`).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import AutoTokenizer, GenerationConfig, LlamaForCausalLM

from bench.hf_draft import hf_llama_from_draft
from shared.datasets import EVAL_KINDS, eval_prompts
from shared.engine.drafting import Drafter
from shared.engine.presets import DEFAULT_METHOD
from shared.engine.spec_engine import SpecEngine
from shared.engine.verifier import Verifier
from shared.model import load_model
from shared.model.cost_profiles import load_or_measure
from shared.model.model_set import all_draft_dirs, target_dir
from shared.model.runner import ModelRunner
from shared.scheduling.config import SchedulerConfig
from shared.scheduling.request import AcceptanceStats
from shared.values.methods import DraftMethod
from shared.values.sampling import SamplingParams
from tools.prompts import chat_ids

METHODS = {
    "chain4": DraftMethod("chain", k=4),
    "tree16": DraftMethod("dynamic", budget=16, max_size=16, max_depth=6, max_width=4),
    # cost-aware: draft only what the draft itself expects the target to accept
    "chain8-p0.4": DraftMethod("chain", k=8, min_path_prob=0.4),
    "tree16-p0.2": DraftMethod(
        "dynamic", budget=16, max_size=16, max_depth=8, max_width=4, min_path_prob=0.2
    ),
    "tree16-p0.3": DraftMethod(
        "dynamic", budget=16, max_size=16, max_depth=8, max_width=4, min_path_prob=0.3
    ),
    "tree8-p0.2": DraftMethod(
        "dynamic", budget=8, max_size=8, max_depth=8, max_width=2, min_path_prob=0.2
    ),
    "chain8-p0.3": DraftMethod("chain", k=8, min_path_prob=0.3),
}
# the defaults of `augury generate`: DEFAULT_METHOD as the upper bound, sized every step by the
# goodput planner from this machine's cost profile (loaded or measured as the CLI does)
DEFAULTS = "defaults"
KINDS = ("chat", "code", "math")
KV_BYTES = 64 << 20


@dataclass
class Row:
    name: str
    tokens: int
    seconds: float
    mean_accepted: float | None = None
    matches_plain: bool | None = None

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds


def chat_prompts(tokenizer, per_kind: int, kinds: tuple[str, ...] = KINDS) -> list[list[int]]:
    prompts = []
    for kind in kinds:
        prompts += [chat_ids(tokenizer, text) for text in eval_prompts(kind, per_kind)]
    return prompts


@dataclass
class Config:
    name: str
    run: Callable[[list[int]], list[int]]
    engine: SpecEngine | None = None  # ours: its acceptance statistics are reported
    outputs: list[list[int]] = field(default_factory=list)
    seconds: float = 0.0


def measure(configs: list[Config], prompts: list[list[int]]) -> None:
    """Prompt by prompt, every configuration in turn: drift in background load hits all alike."""
    for c in configs:  # warm-up, then count only the measured prompts
        c.run(prompts[0][:16])
        if c.engine is not None:
            c.engine.core.stats = AcceptanceStats()
    for p in tqdm(prompts, desc="prompts"):
        for c in configs:
            start = time.perf_counter()
            c.outputs.append(c.run(p))
            c.seconds += time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--per-kind", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--drafts", nargs="+", default=["draft-s", "draft-m", "draft-l"])
    ap.add_argument(
        "--methods", nargs="+", default=["chain4", "tree16"], choices=[*METHODS, DEFAULTS]
    )
    ap.add_argument("--no-assisted", action="store_true", help="skip (d)")
    ap.add_argument(
        "--merge", nargs=2, metavar=("A", "B"), help="(e): draft with A, merge B's trees in"
    )
    ap.add_argument(
        "--kinds",
        nargs="+",
        default=list(KINDS),
        choices=list(EVAL_KINDS),
        help="prompt kinds, per-kind prompts of each (everyday: the project's short questions)",
    )
    ap.add_argument(
        "--plan-kernels",
        action="store_true",
        help="measure and apply the linear-kernel plan to our target and drafts first, as "
        "`augury generate` and the services do on a CPU (transformers keeps its own kernels)",
    )
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--markdown", type=Path)
    ap.add_argument(
        "--draft-weights",
        nargs="+",
        choices=["native", "int8"],
        default=["native"],
        help="run each draft with these weights (int8: its linear layers int8, as the services "
        "do on a CPU by default); both: side by side",
    )
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    tdir = target_dir()
    tokenizer = AutoTokenizer.from_pretrained(tdir)
    prompts = chat_prompts(tokenizer, args.per_kind, tuple(args.kinds))
    eos = tokenizer.eos_token_id
    n = args.max_tokens
    gen_cfg = GenerationConfig(
        max_new_tokens=n, do_sample=False, eos_token_id=eos, pad_token_id=eos
    )
    dtype = getattr(torch, args.dtype)
    hf_target = LlamaForCausalLM.from_pretrained(tdir, dtype=dtype).eval()
    target = load_model(tdir, dtype=dtype)
    if args.plan_kernels:
        target.plan_kernels()
    params = SamplingParams(max_tokens=n)
    rows: list[Row] = []

    def hf_run(p: list[int], **kw) -> list[int]:
        with torch.inference_mode():
            out = hf_target.generate(torch.tensor([p]), generation_config=gen_cfg, **kw)
        toks = out[0, len(p) :].tolist()
        return toks[: toks.index(eos)] if eos in toks else toks

    def ours(engine: SpecEngine) -> Callable[[list[int]], list[int]]:
        return lambda p: engine.generate([p], params)[0].output

    configs = [
        Config("(a) transformers generate", hf_run),
        Config(
            "(b) ours, plain decoding",
            ours(
                plain := SpecEngine(
                    Verifier(ModelRunner(target, kv_memory_bytes=KV_BYTES)), eos_token_ids=[eos]
                )
            ),
            plain,
        ),
    ]
    drafts = all_draft_dirs()
    for weights, name in ((w, d) for d in args.drafts for w in args.draft_weights):
        is_int8 = weights == "int8"
        draft = load_model(drafts[name], dtype=dtype, target_path=tdir, int8=is_int8)
        if args.plan_kernels and not is_int8:
            draft.plan_kernels()
        label = f"{name} int8" if is_int8 else name
        for method_name in args.methods:
            verifier = Verifier(ModelRunner(target, kv_memory_bytes=KV_BYTES))
            drafter = Drafter(ModelRunner(draft, kv_memory_bytes=KV_BYTES), name=name)
            cost = None
            if method_name == DEFAULTS:
                cost = load_or_measure(
                    verifier.runner, {name: drafter.runner}, target_name=tdir.name
                )
            engine = SpecEngine(
                verifier,
                drafter,
                DEFAULT_METHOD if method_name == DEFAULTS else METHODS[method_name],
                eos_token_ids=[eos],
                cost=cost,
            )
            configs.append(Config(f"(c) ours, {label}, {method_name}", ours(engine), engine))
        if not args.no_assisted and not is_int8 and not draft.cfg.feature_size:
            assistant = hf_llama_from_draft(drafts[name], tdir).to(dtype)
            configs.append(
                Config(
                    f"(d) transformers assisted, {name}",
                    lambda p, a=assistant: hf_run(p, assistant_model=a),
                )
            )
    if args.merge:
        pair = {
            name: Drafter(
                ModelRunner(
                    load_model(drafts[name], dtype=dtype, target_path=tdir),
                    kv_memory_bytes=KV_BYTES,
                ),
                name=name,
            )
            for name in args.merge
        }
        for method_name in args.methods:
            engine = SpecEngine(
                Verifier(ModelRunner(target, kv_memory_bytes=KV_BYTES)),
                pair,  # "fixed" drafts every request with the first, A
                METHODS[method_name],
                SchedulerConfig(merge_drafts="standby"),
                eos_token_ids=[eos],
            )
            label = f"(e) ours, {'+'.join(args.merge)} merged, {method_name}"
            configs.append(Config(label, ours(engine), engine))
    measure(configs, prompts)
    reference = configs[1].outputs
    rows = [
        Row(
            c.name,
            sum(map(len, c.outputs)),
            c.seconds,
            c.engine.stats.mean_accepted_length if c.engine and c.engine.drafter else None,
            None if c is configs[1] else c.outputs == reference,
        )
        for c in configs
    ]

    base = rows[0].tokens_per_s
    cols = ("tokens", "tok/s", "vs (a)", "acc.len", "=plain")
    header = f"{'configuration':40} " + " ".join(f"{c:>7}" for c in cols)
    lines = [header, "-" * len(header)]
    for r in rows:
        acc = f"{r.mean_accepted:.2f}" if r.mean_accepted is not None else ""
        same = "" if r.matches_plain is None else ("yes" if r.matches_plain else "NO")
        lines.append(
            f"{r.name:40} {r.tokens:7d} {r.tokens_per_s:7.1f} {r.tokens_per_s / base:6.2f}x "
            f"{acc:>8} {same:>7}"
        )
    table = "\n".join(lines)
    print(table)
    meta = {
        "prompts": len(prompts),
        "per_kind": args.per_kind,
        "kinds": args.kinds,
        "kernel_plan": args.plan_kernels,
        "max_tokens": n,
        "threads": torch.get_num_threads(),
        "dtype": args.dtype,
        "draft_weights": args.draft_weights,
        "torch": torch.__version__,
    }
    if args.json:
        args.json.write_text(
            json.dumps({"meta": meta, "rows": [asdict(r) for r in rows]}, indent=2)
        )
    if args.markdown:
        args.markdown.write_text(f"```\n{table}\n```\n\n{json.dumps(meta)}\n")


if __name__ == "__main__":
    main()
