"""Speed of speculative decoding on this machine, as ratios against transformers' `generate`.

One process, same prompts, same models, batch 1, greedy:
  (a) transformers `generate`                    (the baseline, ratio 1.00)
  (b) our plain decoding                          (no draft)
  (c) our speculative decoding, each draft x each method (chain and tree)
  (d) transformers assisted generation (`assistant_model`) with the same draft

    python bench/bench_engine.py --per-kind 4 --max-tokens 96 --markdown docs/bench_engine.md

Prompts are real and disjoint from the drafts' distillation text: ShareGPT chats, HumanEval
code, GSM8K math (`shared.datasets.eval_prompts`).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import AutoTokenizer, GenerationConfig, LlamaForCausalLM

from bench.hf_draft import hf_llama_from_draft
from shared.datasets import eval_prompts
from shared.drafting import Drafter, DraftMethod
from shared.engine import AcceptanceStats, SpecEngine
from shared.model import load_model
from shared.model_set import draft_dirs, target_dir
from shared.runner import ModelRunner
from shared.sampling import SamplingParams
from shared.verifier import Verifier

METHODS = {
    "chain4": DraftMethod("chain", k=4),
    "tree": DraftMethod("dynamic", budget=10, max_size=10, max_depth=6, max_width=2),
}
KINDS = ("chat", "code", "math")


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


def chat_prompts(tokenizer, per_kind: int) -> list[list[int]]:
    prompts = []
    for kind in KINDS:
        for text in eval_prompts(kind, per_kind):
            ids = tokenizer.apply_chat_template(
                [{"role": "user", "content": text}],
                add_generation_prompt=True,
                tokenize=True,
                return_dict=False,
            )
            prompts.append(list(ids)[-768:])  # keep long chats within a CPU-friendly prefill
    return prompts


def timed(
    run: Callable[[list[int]], list[int]],
    prompts: list[list[int]],
    desc: str,
    after_warmup: Callable[[], None] = lambda: None,
):
    run(prompts[0][:16])  # warm-up
    after_warmup()
    outputs, seconds = [], 0.0
    for p in tqdm(prompts, desc=desc, leave=False):
        start = time.perf_counter()
        outputs.append(run(p))
        seconds += time.perf_counter() - start
    return outputs, seconds


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--per-kind", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--drafts", nargs="+", default=["draft-s", "draft-m", "draft-l"])
    ap.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    ap.add_argument("--no-assisted", action="store_true", help="skip (d)")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--markdown", type=Path)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    tdir = target_dir()
    tokenizer = AutoTokenizer.from_pretrained(tdir)
    prompts = chat_prompts(tokenizer, args.per_kind)
    eos = tokenizer.eos_token_id
    n = args.max_tokens
    gen_cfg = GenerationConfig(
        max_new_tokens=n, do_sample=False, eos_token_id=eos, pad_token_id=eos
    )
    hf_target = LlamaForCausalLM.from_pretrained(tdir, dtype=torch.float32).eval()
    target = load_model(tdir)
    params = SamplingParams(max_tokens=n)
    rows: list[Row] = []

    def hf_run(p: list[int], **kw) -> list[int]:
        with torch.inference_mode():
            out = hf_target.generate(torch.tensor([p]), generation_config=gen_cfg, **kw)
        toks = out[0, len(p) :].tolist()
        return toks[: toks.index(eos)] if eos in toks else toks

    outs, secs = timed(hf_run, prompts, "(a) transformers generate")
    rows.append(Row("(a) transformers generate", sum(map(len, outs)), secs))

    def engine_run(engine: SpecEngine) -> Callable[[list[int]], list[int]]:
        return lambda p: engine.generate([p], params)[0].output

    plain_engine = SpecEngine(Verifier(ModelRunner(target)), eos_token_ids=[eos])
    plain, secs = timed(engine_run(plain_engine), prompts, "(b) ours plain")
    rows.append(Row("(b) ours, plain decoding", sum(map(len, plain)), secs))
    rows[0].matches_plain = outs == plain

    drafts = draft_dirs()
    for name in args.drafts:
        drafter = Drafter(ModelRunner(load_model(drafts[name])))
        for method_name in args.methods:
            engine = SpecEngine(
                Verifier(ModelRunner(target)), drafter, METHODS[method_name], eos_token_ids=[eos]
            )
            spec, secs = timed(
                engine_run(engine),
                prompts,
                f"(c) {name} {method_name}",
                after_warmup=lambda e=engine: setattr(e, "stats", AcceptanceStats()),
            )
            rows.append(
                Row(
                    f"(c) ours, {name}, {method_name}",
                    sum(map(len, spec)),
                    secs,
                    engine.stats.mean_accepted_length,
                    spec == plain,
                )
            )
        if not args.no_assisted:
            assistant = hf_llama_from_draft(drafts[name])
            assisted, secs = timed(
                lambda p, a=assistant: hf_run(p, assistant_model=a), prompts, f"(d) {name}"
            )
            rows.append(
                Row(
                    f"(d) transformers assisted, {name}",
                    sum(map(len, assisted)),
                    secs,
                    matches_plain=assisted == plain,
                )
            )

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
        "max_tokens": n,
        "threads": torch.get_num_threads(),
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
