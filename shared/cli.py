"""`augury generate`: stream one completion with speculative decoding, then its statistics.

augury generate "Explain how a hash table works." --draft draft-l --method chain
augury generate "Fix the bug: ..." --draft ngram          # a model-free draft alone
augury generate "Fix the bug: ..." --model-free none      # the model draft alone (default: + ngram)
augury generate "Fix the bug: ..." --model-free suffix    # suffix beside the model draft, merged
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from shared.engine.drafting import Drafter
from shared.engine.model_free import MODEL_FREE_KINDS, ModelFreeDrafter
from shared.engine.presets import DEFAULT_GENERATE_DRAFT, DEFAULT_METHOD
from shared.engine.spec_engine import SpecEngine
from shared.engine.verifier import Verifier
from shared.errors import AuguryError
from shared.model import load_model, load_target
from shared.model.cost_profiles import load_or_measure
from shared.model.loader import checkpoint_dir
from shared.model.model_set import MODEL_SETS, SMOLLM2
from shared.model.precision import TARGET_DTYPES, check_target_precision
from shared.model.quantized import DRAFT_WEIGHTS, uses_int8
from shared.model.runner import ModelRunner
from shared.scheduling.config import SchedulerConfig
from shared.scheduling.request import AcceptanceStats
from shared.settings import MODEL_SET_CHOOSERS
from shared.values.logprobs import TokenLogprobs
from shared.values.methods import DraftMethod
from shared.values.sampling import SamplingParams

DEFAULT_PROMPT = "Explain in a few sentences how a hash table works."
M = DEFAULT_METHOD  # the CLI's defaults are the presets'


def build_method(args: argparse.Namespace) -> DraftMethod:
    return DraftMethod(
        args.method,
        k=args.k,
        expansion=tuple(args.expansion),
        depth=args.depth,
        width=args.width,
        budget=args.budget,
        max_size=args.budget,
        max_depth=args.depth,
        max_width=args.width,
        min_path_prob=args.min_path_prob,
    )


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="augury", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="stream a completion for a prompt")
    gen.add_argument("prompt", nargs="?", default=DEFAULT_PROMPT)
    _add_model_args(gen)
    _add_method_args(gen)
    _add_sampling_args(gen)
    _add_run_args(gen)
    return parser.parse_args(argv)


def _add_model_args(gen: argparse.ArgumentParser) -> None:
    """The target, the draft and the target's precision."""
    gen.add_argument(
        "--model-set",
        choices=MODEL_SETS,
        default=SMOLLM2,
        help="the target and drafts to use by default (qwen2.5-coder: install it first with "
        "scripts/install-qwen-coder.sh)",
    )
    gen.add_argument(
        "--target", help="target checkpoint dir or .gguf file (default: the model set's target)"
    )
    gen.add_argument(
        "--draft",
        help="a draft of the model set (ngram and suffix load no model), a checkpoint dir or a "
        f".gguf file (default: the model set's served drafts, chosen per step as its services "
        f"choose; {DEFAULT_GENERATE_DRAFT} for {SMOLLM2})",
    )
    gen.add_argument(
        "--model-free",
        choices=[*MODEL_FREE_KINDS, "none"],
        default="ngram",
        help="also draft with this model-free draft, its tree merged with the model draft's "
        "(default: ngram; none: the model draft alone)",
    )
    gen.add_argument("--no-spec", action="store_true", help="plain decoding, no draft")
    gen.add_argument(
        "--dtype",
        choices=TARGET_DTYPES,
        default="float32",
        help="the target's precision (bfloat16: CPUs with AMX or AVX-512 BF16; int8: int8 "
        "weights, fp32 elsewhere); speculation gives the greedy output of plain decoding at "
        "this precision",
    )
    gen.add_argument(
        "--exact-attention",
        action="store_true",
        help="trees attend row by row, so a bf16 or int8 target's speculation rounds as plain "
        "decoding does (slower verification)",
    )


def _add_method_args(gen: argparse.ArgumentParser) -> None:
    """The drafting method and its shape."""
    gen.add_argument("--method", choices=["chain", "static", "beam", "dynamic"], default=M.kind)
    gen.add_argument("--k", type=int, default=M.k, help="chain length")
    gen.add_argument("--expansion", type=int, nargs="+", default=list(M.expansion))
    gen.add_argument("--depth", type=int, default=M.max_depth, help="beam/dynamic depth")
    gen.add_argument("--width", type=int, default=M.max_width, help="beam/dynamic width")
    gen.add_argument("--budget", type=int, default=M.max_size, help="dynamic tree: draft tokens")
    gen.add_argument(
        "--min-path-prob",
        type=float,
        default=M.min_path_prob,
        help="draft no node the draft expects the target to accept with less probability",
    )


def _add_sampling_args(gen: argparse.ArgumentParser) -> None:
    """Sampling, stops, and what to print beside the text."""
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int, help="reproducible sampling (Gumbel-coupled)")
    gen.add_argument("--presence-penalty", type=float, default=0.0)
    gen.add_argument("--frequency-penalty", type=float, default=0.0)
    gen.add_argument("--repetition-penalty", type=float, default=1.0)
    gen.add_argument("--min-p", type=float, default=0.0)
    gen.add_argument("--min-tokens", type=int, default=0, help="no EOS before this many tokens")
    gen.add_argument(
        "--logit-bias", nargs="+", default=[], metavar="ID=BIAS", help="e.g. 198=-100 13=2.5"
    )
    gen.add_argument(
        "--logprobs", type=int, help="print each token's log-probability and N alternatives"
    )
    gen.add_argument(
        "--prompt-logprobs",
        type=int,
        help="print each prompt token's log-probability and N alternatives (no cached prefix)",
    )
    gen.add_argument(
        "--stop",
        action="append",
        default=[],
        help="a stop string (repeat for several): the output ends before it",
    )
    gen.add_argument(
        "--include-stop-str", action="store_true", help="keep the stop string in the output"
    )


def _add_run_args(gen: argparse.ArgumentParser) -> None:
    """How the engine runs: chat template, threads, tensor parallelism, planner, int8 drafts."""
    gen.add_argument("--raw", action="store_true", help="no chat template")
    gen.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: default)")
    gen.add_argument(
        "--tp",
        type=int,
        default=1,
        help="split the target over this many ranks, one process each (gloo on this CPU; "
        "docs/tensor-parallel.md)",
    )
    gen.add_argument(
        "--planner",
        choices=["goodput", "fixed"],
        default="goodput",
        help="goodput: size speculation each step by this machine's cost profile (plain decoding "
        "when drafts do not pay); fixed: always draft the whole tree",
    )
    gen.add_argument(
        "--draft-weights",
        choices=DRAFT_WEIGHTS,
        default="auto",
        help="the draft's linear layers with int8 weights (auto: on a CPU that has the kernels); "
        "outputs are the same either way",
    )


def resolve_models(args: argparse.Namespace) -> tuple[str, str | None]:
    """Checkpoint directories of the target and the draft (GGUF files converted once)."""
    from shared.model.model_set import ALL_DRAFT_NAMES, model_set_drafts, model_set_target

    target = str(checkpoint_dir(args.target or model_set_target(args.model_set)))
    if args.no_spec:
        return target, None
    if args.draft is None:
        if args.model_set != SMOLLM2:
            return target, str(next(iter(model_set_drafts(args.model_set, served=True).values())))
        args.draft = DEFAULT_GENERATE_DRAFT
    if args.draft in MODEL_FREE_KINDS:
        return target, args.draft
    drafts = model_set_drafts(args.model_set)
    if args.draft in ALL_DRAFT_NAMES or (args.model_set != SMOLLM2 and args.draft in drafts):
        found = drafts.get(args.draft)
        if found is None and args.model_set != SMOLLM2:
            raise SystemExit(f"draft {args.draft!r} is not in model set {args.model_set!r}")
        if found is None:
            rebuild = "rebuild it with `python -m distill build`"
            raise SystemExit(f"draft {args.draft!r} is missing; {rebuild}")
        return target, str(found)
    return target, str(checkpoint_dir(args.draft))


def load_drafter(args: argparse.Namespace, draft_path: str, target_path: str) -> Drafter:
    model = load_model(
        draft_path, target_path=target_path, int8=uses_int8(args.draft_weights, "cpu")
    )
    return Drafter(ModelRunner(model), name=Path(draft_path).name)


def _served_others(model_set: str) -> list[Path]:
    """The model set's served model drafts after its first, which `resolve_models` gives."""
    from shared.model.model_set import model_set_drafts

    return list(model_set_drafts(model_set, served=True).values())[1:]


def generate(args: argparse.Namespace) -> int:
    from transformers import AutoTokenizer

    if args.threads:
        torch.set_num_threads(args.threads)
    served_set = args.draft is None and not args.no_spec and args.model_set != SMOLLM2
    target_path, draft_path = resolve_models(args)
    tokenizer = AutoTokenizer.from_pretrained(target_path)
    try:
        precision = check_target_precision(args.dtype, "cpu", setting="--dtype")
    except ValueError as err:
        raise SystemExit(f"augury: error: {err}") from err
    if args.tp > 1 and args.dtype != "float32":
        raise SystemExit("augury: error: --tp runs the target in float32 only")
    drafter: Drafter | ModelFreeDrafter | None = None
    if draft_path in MODEL_FREE_KINDS:
        drafter = ModelFreeDrafter(draft_path)
    elif draft_path:
        drafter = load_drafter(args, draft_path, target_path)
    # the set's other served model drafts, beside its first (the planner picks per step)
    others = [
        load_drafter(args, str(path), target_path)
        for path in (_served_others(args.model_set) if served_set else [])
    ]
    group = None
    if args.tp > 1:
        from shared.model.rank_group import start_local_group

        group = start_local_group(target_path, args.tp, threads=args.threads)
        verifier = Verifier(group.runner)  # type: ignore[arg-type]
    else:
        target = load_target(target_path, precision)
        verifier = Verifier(ModelRunner(target, exact_attention=args.exact_attention))
    try:
        return _generate(args, tokenizer, target_path, draft_path, drafter, verifier, others)
    finally:
        if group is not None:
            group.close()


def _generate(
    args: argparse.Namespace,
    tokenizer: Any,
    target_path: str,
    draft_path: str | None,
    drafter: Drafter | ModelFreeDrafter | None,
    verifier: Verifier,
    others: Sequence[Drafter] = (),
) -> int:
    drafters = {drafter.name: drafter} if drafter is not None else {}
    drafters |= {other.name: other for other in others}
    if args.model_free != "none" and isinstance(drafter, Drafter):  # a model draft's partner
        drafters[args.model_free] = ModelFreeDrafter(args.model_free)
    # the cost profile brings the kernel plan it was measured with: plain decoding uses it too
    cost = load_or_measure(
        verifier.runner,
        {name: d.runner for name, d in drafters.items() if isinstance(d, Drafter)},
        target_name=Path(target_path).name,
    )
    chooser = MODEL_SET_CHOOSERS[args.model_set] if others else "fixed"
    engine = SpecEngine(
        verifier,
        drafters,
        build_method(args) if drafter else None,
        SchedulerConfig(planner=args.planner, draft_chooser=chooser),
        eos_token_ids=verifier.runner.cfg.eos_token_ids,
        cost=cost if args.planner == "goodput" else None,
        tokenizer=tokenizer,
    )
    prompt = _encode_prompt(args, tokenizer)
    params = _sampling_params(args)
    start = time.perf_counter()
    rid = engine.add_request(
        prompt, params, stop=args.stop, include_stop_str_in_output=args.include_stop_str
    )
    output, first_token_at = _stream(engine, rid)
    request = engine.requests.pop(rid)
    engine.texts.pop(rid)
    _print_timing(len(prompt), len(output), start, first_token_at)
    if request.prompt_logprobs is not None:
        print("prompt", end=" ")  # the first prompt token has none
        _print_logprobs(tokenizer, prompt[1:], request.prompt_logprobs)
    if request.logprobs is not None:
        _print_logprobs(tokenizer, output, request.logprobs)
    stats = engine.stats
    print(f"target forwards       {stats.num_target_forwards} (after prefill)")
    if drafter is not None:
        beside = "".join(f", {other.name}" for other in others)
        chosen = f"; {chooser} choice among it{beside}" if others else ""
        merged = f", merged with {args.model_free}" if args.model_free in drafters else ""
        print(f"draft                 {draft_path} ({args.method}{merged}{chosen})")
        _print_draft_stats(stats)
    return 0


def _encode_prompt(args: argparse.Namespace, tokenizer: Any) -> list[int]:
    if args.raw:
        return tokenizer.encode(args.prompt)
    messages = [{"role": "user", "content": args.prompt}]
    return list(
        tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=False
        )
    )


def _sampling_params(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        max_tokens=args.max_tokens,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        repetition_penalty=args.repetition_penalty,
        min_p=args.min_p,
        min_tokens=args.min_tokens,
        logit_bias=_logit_bias(args.logit_bias),
        logprobs=args.logprobs,
        prompt_logprobs=args.prompt_logprobs,
    )


def _stream(engine: SpecEngine, rid: str) -> tuple[list[int], float | None]:
    """Step the engine until the request finishes, printing its text as it comes; its output
    tokens, and when the first came (None: none did)."""
    output: list[int] = []
    printed = 0
    first_token_at = None
    text = engine.texts[rid]  # detokenized by the engine, cut at a stop string
    while engine.requests[rid].finish_reason is None:
        for out in engine.step():
            if out.request_id == rid and out.new_tokens:
                first_token_at = first_token_at or time.perf_counter()
                output.extend(out.new_tokens)
        sys.stdout.write(text.text[printed:])
        sys.stdout.flush()
        printed = len(text.text)
    return output, first_token_at


def _print_timing(
    num_prompt: int, num_output: int, start: float, first_token_at: float | None
) -> None:
    elapsed = time.perf_counter() - start
    print("\n")
    print(f"prompt tokens         {num_prompt}")
    print(
        f"generated tokens      {num_output} in {elapsed:.2f} s: "
        f"{num_output / elapsed:.1f} tokens/s"
    )
    if first_token_at is not None:
        decode_s = time.perf_counter() - first_token_at
        rest = max(num_output - 1, 0)
        print(f"time to first token   {1000 * (first_token_at - start):.0f} ms")
        if rest and decode_s > 0:
            print(f"decode                {rest / decode_s:.1f} tokens/s after the first")


def _print_draft_stats(stats: AcceptanceStats) -> None:
    print(f"draft tokens          {stats.num_draft_tokens}, accepted {stats.num_accepted}")
    print(f"acceptance rate       {stats.acceptance_rate:.1%}")
    print(f"mean accepted length  {stats.mean_accepted_length:.2f} tokens per target forward")
    if stats.accepted_per_position and stats.num_drafts:
        rates = " ".join(f"{n / stats.num_drafts:.2f}" for n in stats.accepted_per_position)
        print(f"accepted by position  {rates}")


def _logit_bias(pairs: Sequence[str]) -> dict[int, float]:
    bias = {}
    for pair in pairs:
        token, _, value = pair.partition("=")
        try:
            bias[int(token)] = float(value)
        except ValueError:
            raise SystemExit(f"--logit-bias takes ID=BIAS pairs, got {pair!r}") from None
    return bias


def _print_logprobs(tokenizer: Any, output: Sequence[int], logprobs: TokenLogprobs) -> None:
    print("token logprobs (the target's raw log-probabilities):")
    for token, logprob, alternatives, values in zip(
        output, logprobs.logprobs, logprobs.top_ids, logprobs.top_logprobs, strict=False
    ):
        top = ", ".join(
            f"{tokenizer.decode([a])!r} {v:.3f}" for a, v in zip(alternatives, values, strict=True)
        )
        print(f"  {tokenizer.decode([token])!r:>16} {logprob:8.3f}   {top}")


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        return generate(args)
    except (AuguryError, FileNotFoundError) as err:
        print(f"augury: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
