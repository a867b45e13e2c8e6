"""Command line for load-test traces: synthesize one, convert one to our JSONL, summarize one.

    python -m tools.traces synth --rate 4 --duration 300 --slo tight=60 loose=200 --out t.jsonl
    python -m tools.traces convert AzureLLMInferenceTrace_conv.csv --out azure.jsonl --target
    python -m tools.traces show t.jsonl

Traces are read by `tools.load.readers.read_trace` (our .jsonl, Azure .csv, ShareGPT .json) and
written as our JSONL. Errors print one line and exit with status 2.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from shared.datasets import KINDS
from tools.load.arrivals import PROCESSES
from tools.load.prompts import TRACE_KINDS, PromptBuilder, synthesize
from tools.load.readers import CountTokens, read_trace, write_trace
from tools.load.trace import TraceError, TraceRequest
from tools.sim.prefix import MOONCAKE_BLOCK

_DEFAULT_TARGET = "default"  # --target without a directory: the SmolLM2 target


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return args.run(args)
    except (TraceError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def summary(requests: Sequence[TraceRequest]) -> list[str]:
    """Lines describing a trace: size, span, rate, token lengths, kinds and SLO classes."""
    if not requests:
        return ["0 requests"]
    span = requests[-1].arrival_s - requests[0].arrival_s
    rate = f"{(len(requests) - 1) / span:.3f} req/s" if span > 0 else "- req/s"
    lines = [f"{len(requests)} requests over {span:.3f} s ({rate} mean rate)"]
    inputs = [r.input_length for r in requests if r.input_length is not None]
    texts = sum(r.input_length is None for r in requests)
    lines.append(f"input tokens:  {_stats(inputs)}" + (f"; {texts} as text" if texts else ""))
    outputs = [r.num_output_tokens for r in requests if r.num_output_tokens is not None]
    lines.append(f"output tokens: {_stats(outputs)}")
    kinds = Counter(r.kind or "-" for r in requests)
    lines.append("kinds: " + ", ".join(f"{k} {n}" for k, n in sorted(kinds.items())))
    classes = Counter((r.slo_class or "-", r.tpot_slo_ms) for r in requests)
    lines.append("SLO classes: " + ", ".join(_slo(c, ms, n) for (c, ms), n in classes.items()))
    return lines


def _stats(values: Sequence[int]) -> str:
    if not values:
        return "none"
    a = np.asarray(values)
    p50, p90, p99 = np.percentile(a, [50, 90, 99])
    return (
        f"{len(a)} given, min {a.min()}, mean {a.mean():.1f}, p50 {p50:.0f}, p90 {p90:.0f}, "
        f"p99 {p99:.0f}, max {a.max()}"
    )


def _slo(name: str, tpot_ms: float | None, n: int) -> str:
    return f"{name} ({'no TPOT objective' if tpot_ms is None else f'TPOT {tpot_ms:g} ms'}) {n}"


# ---- commands ----------------------------------------------------------------------------------


def _synth(args: argparse.Namespace) -> int:
    _check_out(args.out)
    if args.cv is not None and args.arrivals != "gamma":
        raise ValueError("--cv needs --arrivals gamma (Poisson gaps have cv 1)")
    requests = synthesize(
        args.rate,
        duration_s=args.duration,
        count=args.count,
        process=args.arrivals,
        cv=1.0 if args.cv is None else args.cv,
        kinds=args.kinds,
        input_length=args.input_length,
        input_range=_pair(args.input_range),
        output_length=args.output_length,
        output_range=_pair(args.output_range),
        slo_classes=args.slo,
        slo_assignment=args.slo_assign,
        seed=args.seed,
        app_per_kind=args.app_per_kind,
    )
    if args.system_prompt_tokens is not None and args.target is None:
        raise ValueError("--system-prompt-tokens needs --target (to count its tokens)")
    if args.target is not None:
        builder = PromptBuilder(_tokenizer(args.target), seed=args.seed)
        requests = builder.fill(requests)
        if args.system_prompt_tokens is not None:
            system = builder.text("chat", args.system_prompt_tokens)
            requests = with_system_prompt(requests, system)
    return _write(args.out, requests)


def with_system_prompt(requests: Sequence[TraceRequest], system: str) -> list[TraceRequest]:
    """Every request with the same system message in front (a shared prompt prefix, as an
    application's instructions make one: what prefix caching computes once)."""
    out = []
    for request in requests:
        turns = request.messages or (("user", request.prompt or ""),)
        messages = (("system", system), *turns)
        out.append(replace(request, messages=messages, prompt=None, input_length=None))
    return out


def _convert(args: argparse.Namespace) -> int:
    _check_out(args.out)
    tokenizer = _tokenizer(args.target) if args.target is not None else None
    requests = read_trace(
        args.trace,
        rate=args.rate,
        seed=args.seed,
        limit=args.limit,
        count_tokens=_counter(tokenizer) if tokenizer is not None else None,
    )
    if args.hash_block_tokens is not None:
        requests = scale_hash_blocks(requests, args.hash_block_tokens)
    if tokenizer is not None:
        block = args.hash_block_tokens or MOONCAKE_BLOCK
        requests = PromptBuilder(tokenizer, seed=args.seed, hash_block=block).fill(requests)
    return _write(args.out, requests)


def scale_hash_blocks(requests: Sequence[TraceRequest], block: int) -> list[TraceRequest]:
    """Requests with `hash_ids` made to `block` tokens per id instead of Mooncake's 512 (input
    lengths scaled, kept within their ids' blocks): the same sharing in shorter prompts."""
    out = []
    for request in requests:
        ids, length = request.hash_ids, request.input_length
        if not ids or length is None:
            out.append(request)
            continue
        scaled = round(length * block / MOONCAKE_BLOCK)
        scaled = min(len(ids) * block, max((len(ids) - 1) * block + 1, scaled))
        out.append(replace(request, input_length=scaled))
    return out


def _show(args: argparse.Namespace) -> int:
    requests = read_trace(args.trace, rate=args.rate, seed=args.seed, limit=args.limit)
    print(f"{args.trace}:")
    for line in summary(requests):
        print(f"  {line}")
    return 0


def _write(out: Path, requests: Sequence[TraceRequest]) -> int:
    write_trace(out, requests)
    print(f"wrote {out}:")
    for line in summary(requests):
        print(f"  {line}")
    return 0


def _check_out(out: Path) -> None:
    if out.suffix != ".jsonl":
        raise ValueError(f"--out must be a .jsonl file (our trace format), got {out}")


def _pair(values: list[int] | None) -> tuple[int, int] | None:
    return None if values is None else (values[0], values[1])


def _tokenizer(target: str) -> Any:
    from transformers import AutoTokenizer

    if target == _DEFAULT_TARGET:
        from shared.model.smollm2 import ensure_smollm2

        return AutoTokenizer.from_pretrained(ensure_smollm2())
    if not Path(target).is_dir():
        raise ValueError(f"--target {target}: no such model directory")
    return AutoTokenizer.from_pretrained(target)


def _counter(tokenizer: Any) -> CountTokens:
    return lambda text: max(1, len(tokenizer.encode(text, add_special_tokens=False)))


# ---- arguments ---------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m tools.traces",
        description="Make, convert and inspect load-test traces (our JSONL, Azure CSV, ShareGPT).",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_synth(commands)
    _add_convert(commands)
    _add_show(commands)
    return parser


def _add_synth(commands: Any) -> None:
    p = commands.add_parser(
        "synth",
        help="synthesize a trace of real dataset prompts",
        description="Synthesize a trace: arrivals of a Poisson or gamma process, real prompts "
        "of the evaluation datasets (chat: ShareGPT, code: HumanEval, math: GSM8K), output "
        "lengths fixed, uniform in a range, or those of the datasets' reference answers.",
    )
    p.add_argument("--rate", type=_positive_float, required=True, help="mean requests/s")
    stop = p.add_mutually_exclusive_group(required=True)
    stop.add_argument("--duration", type=_positive_float, metavar="S", help="seconds of arrivals")
    stop.add_argument("--count", type=_positive_int, metavar="N", help="number of requests")
    p.add_argument(
        "--arrivals",
        choices=PROCESSES,
        default="poisson",
        help="arrival process (default: %(default)s)",
    )
    p.add_argument(
        "--cv",
        type=_positive_float,
        metavar="X",
        help="coefficient of variation of gamma gaps: >1 bursty, <1 smooth (default: 1)",
    )
    p.add_argument(
        "--kinds",
        type=_kinds,
        default=list(KINDS),
        metavar="K,K",
        help=f"prompt kinds, taking turns, of {','.join(TRACE_KINDS)} (default: "
        f"{','.join(KINDS)}); code-edit, revision, passage-qa and agent are the copy-heavy "
        "workloads of tools/workloads.py",
    )
    p.add_argument(
        "--app-per-kind",
        action="store_true",
        help="each request names its kind as its application (augury.app), so a suffix draft "
        "shares its cache within a kind",
    )
    _add_lengths(p, "input", "prompt tokens under the chat template (text built with --target)")
    _add_lengths(p, "output", "output tokens (default: the dataset's reference answer length)")
    p.add_argument(
        "--slo",
        type=_slo_class,
        action="extend",
        nargs="+",
        default=[],
        metavar="NAME=MS",
        help="SLO classes with their TPOT objective in ms, e.g. --slo tight=60 loose=200",
    )
    p.add_argument(
        "--slo-assign",
        choices=("round_robin", "random"),
        default="round_robin",
        help="how requests get SLO classes (default: %(default)s)",
    )
    _add_target(p, "build prompt texts for --input-length/--input-range with this tokenizer")
    p.add_argument(
        "--system-prompt-tokens",
        type=_positive_int,
        metavar="N",
        help="put one system message of about N tokens in front of every request (a shared "
        "prefix; needs --target)",
    )
    p.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")
    p.add_argument("--out", type=Path, required=True, help="trace to write (.jsonl)")
    p.set_defaults(run=_synth)


def _add_convert(commands: Any) -> None:
    p = commands.add_parser(
        "convert",
        help="convert a trace to our JSONL",
        description="Read a trace (our .jsonl, Azure LLM inference .csv, ShareGPT .json) and "
        "write it as our JSONL, optionally with prompt texts of the trace's lengths.",
    )
    _add_reading(p)
    p.add_argument("--out", type=Path, required=True, help="trace to write (.jsonl)")
    _add_target(
        p,
        "give requests with only a length a prompt text of that many tokens under this target's "
        "chat template (and measure ShareGPT answers in its tokens)",
    )
    p.add_argument(
        "--hash-block-tokens",
        type=_positive_int,
        metavar="N",
        help="Mooncake hash_ids: N tokens per id instead of 512 (input lengths scaled; "
        "with --target, prompt texts share what the ids share)",
    )
    p.set_defaults(run=_convert)


def _add_show(commands: Any) -> None:
    p = commands.add_parser(
        "show",
        help="summarize a trace",
        description="Print a trace's request count, span, mean rate, input and output token "
        "lengths, kinds and SLO classes.",
    )
    _add_reading(p)
    p.set_defaults(run=_show)


def _add_reading(p: argparse.ArgumentParser) -> None:
    """The trace to read and how to read it (convert's and show's)."""
    p.add_argument("trace", type=Path, help="trace to read (.jsonl, .csv or .json)")
    p.add_argument(
        "--rate",
        type=_positive_float,
        help="ShareGPT only (required there): requests/s of the synthesized Poisson arrivals",
    )
    p.add_argument("--seed", type=int, default=0, help="random seed (default: 0)")
    p.add_argument("--limit", type=_positive_int, metavar="N", help="read the first N requests")


def _add_lengths(p: argparse.ArgumentParser, what: str, meaning: str) -> None:
    group = p.add_mutually_exclusive_group()
    group.add_argument(f"--{what}-length", type=_positive_int, metavar="N", help=meaning)
    group.add_argument(
        f"--{what}-range",
        type=_positive_int,
        nargs=2,
        metavar=("LOW", "HIGH"),
        help=f"{what} tokens drawn uniformly from LOW..HIGH (inclusive)",
    )


def _add_target(p: argparse.ArgumentParser, meaning: str) -> None:
    p.add_argument(
        "--target",
        nargs="?",
        const=_DEFAULT_TARGET,
        metavar="DIR",
        help=f"{meaning}; DIR: a model directory (default: the SmolLM2 target)",
    )


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return value


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text}")
    return value


def _kinds(text: str) -> list[str]:
    kinds = [k.strip() for k in text.split(",") if k.strip()]
    unknown = [k for k in kinds if k not in TRACE_KINDS]
    if not kinds or unknown:
        raise argparse.ArgumentTypeError(
            f"kinds are a comma list of {','.join(TRACE_KINDS)}: {text!r}"
        )
    return kinds


def _slo_class(text: str) -> tuple[str, float]:
    name, sep, ms = text.partition("=")
    try:
        tpot_ms = float(ms)
    except ValueError:
        tpot_ms = 0.0
    if not sep or not name or not tpot_ms > 0:
        raise argparse.ArgumentTypeError(f"expected NAME=MS with MS > 0, got {text!r}")
    return name, tpot_ms


if __name__ == "__main__":
    sys.exit(main())
