"""The draft choosers measured: Spin's Fig. 11 in the simulator.

    python -m bench.drafters fig11 [--profile PATH] [--batch-size 8] [--copies 2]
    python -m bench.drafters fig13 [--profile PATH] [--batch-size 16] [--max-micro-batches 6]
                                   [--split policy|per-draft]
    python -m bench.drafters real [--requests 24] [--max-tokens 64] [--batch-size 8]
    python -m bench.drafters real --model-set qwen2.5-coder --target-dtype bfloat16 \
        --drafts qwen2.5-coder-0.5b ngram --choosers fixed default counterfactual \
        --kinds code-edit revision chat everyday --per-kind 4
    python -m bench.drafters mixed [--profile PATH] [--drafts draft-s ngram suffix] [--per-kind N]

Results go to `--out` (default `docs/results/drafters/`): a JSON with the command that made it and
a markdown table per cost profile. The default profile is the committed H100 one (one device per
draft model, as Spin runs its drafts); the acceptance is the 3-draft recording.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from shared.datasets import EVAL_KINDS
from shared.model.model_set import DRAFT_NAMES, MODEL_SETS, REPO_ROOT, SMOLLM2
from tools.workloads import COPY_KINDS

OUT = REPO_ROOT / "docs" / "results" / "drafters"
PROFILE = (
    REPO_ROOT / "profiles" / "SmolLM2-135M-Instruct-cuda-nvidia-h100-80gb-hbm3-bfloat16-t0.json"
)
RECORDING = REPO_ROOT / "profiles" / "acceptance-SmolLM2-135M-Instruct-3drafts.json.gz"
# chat and the copy-heavy kinds with their text kept (`tools.sim.acceptance --tokens`)
MIXED_RECORDING = REPO_ROOT / "profiles" / "acceptance-SmolLM2-135M-Instruct-mixed.json.gz"


def lbss_options(p: argparse.ArgumentParser, prune_help: str) -> None:
    from shared.settings import LbssSettings

    defaults = LbssSettings()
    p.add_argument("--alpha", type=int, default=defaults.alpha, help="LBSS exploration slots")
    p.add_argument("--beta", type=int, default=defaults.beta, help="LBSS slots per chunk")
    p.add_argument("--prune-z", type=float, default=defaults.prune_z, help=prune_help)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.drafters", description=__doc__)
    sub = parser.add_subparsers(dest="experiment", required=True)

    def common(p: argparse.ArgumentParser, batch_size: int) -> None:
        p.add_argument("--profile", type=Path, default=PROFILE)
        p.add_argument("--recording", type=Path, default=RECORDING)
        p.add_argument("--batch-size", type=int, default=batch_size, help="running-set limit")
        p.add_argument("--max-tokens", type=int, default=128, help="output tokens per request")
        p.add_argument("--copies", type=int, default=2, help="requests per recorded prompt")
        p.add_argument("--drafts", nargs="+", default=list(DRAFT_NAMES))
        lbss_options(p, "LBSS explores no model confidently worse than the best (0: Spin's Alg. 2)")
        p.add_argument(
            "--planner",
            choices=("goodput", "fixed"),
            default="goodput",
            help="fixed: every step drafts the whole tree (on a CPU profile the goodput planner "
            "finds no draft worth verifying at these batch sizes)",
        )
        p.add_argument("--out", type=Path, default=OUT)

    p = sub.add_parser("fig11", help="goodput of each draft chooser per workload")
    common(p, 8)
    p.add_argument(
        "--oracle-passes", type=int, default=2,
        help="the batch-aware oracle's passes over the requests (each tries every other draft)",
    )  # fmt: skip
    p = sub.add_parser("fig13", help="goodput against the number of micro-batches")
    common(p, 16)
    p.add_argument("--chooser", default="lbss", choices=("fixed", "lbss", "eps-greedy"))
    p.add_argument("--max-micro-batches", type=int, default=6)
    p.add_argument(
        "--split",
        choices=("policy", "per-draft"),
        default="policy",
        help="scheduler.micro_batch_split: which requests each micro-batch takes",
    )
    p = sub.add_parser("mixed", help="copy-heavy and chat requests together: choosers, oracle")
    p.add_argument("--profile", type=Path, default=PROFILE)
    p.add_argument("--recording", type=Path, default=MIXED_RECORDING)
    p.add_argument("--batch-size", type=int, default=8, help="running-set limit")
    p.add_argument("--max-tokens", type=int, default=64, help="output tokens per request (cap)")
    p.add_argument("--per-kind", type=int, default=None, help="prompts per kind (default: all)")
    p.add_argument("--copies", type=int, default=1, help="rounds of the prompts, one after another")
    p.add_argument("--drafts", nargs="+", default=["draft-s", "ngram", "suffix"])
    lbss_options(p, "LBSS explores no model confidently worse than the best (0: Spin's Alg. 2)")
    p.add_argument("--planner", choices=("goodput", "fixed"), default="goodput")
    p.add_argument("--oracle-passes", type=int, default=2)
    p.add_argument("--out", type=Path, default=OUT)
    p = sub.add_parser("real", help="the choosers as real replays through the services")
    p.add_argument("--requests", type=int, default=24)
    p.add_argument("--max-tokens", type=int, default=64, help="answer length cap")
    p.add_argument("--batch-size", type=int, default=8, help="running-set limit")
    p.add_argument(
        "--drafts",
        nargs="+",
        default=list(DRAFT_NAMES),
        help="model drafts of the set and model-free ones (ngram, suffix)",
    )
    p.add_argument(
        "--choosers",
        nargs="+",
        default=["fixed", "eps-greedy", "lbss"],
        choices=(
            "fixed",
            "default",
            "greedy-length",
            "eps-greedy",
            "lbss",
            "counterfactual",
            "eps-greedy+fast",
            "lbss+fast",
            "lbss+pruned",
        ),
        help="draft choosers; fixed: once per draft, served alone; default: the services' "
        "default over every draft (the first model draft, the first model-free one merged); "
        "NAME+fast: that chooser with fast switching; lbss+pruned: LBSS with pruned "
        "exploration (--prune-z)",
    )
    p.add_argument("--model-set", choices=MODEL_SETS, default=SMOLLM2)
    p.add_argument("--target-dtype", choices=("float32", "bfloat16"))
    p.add_argument(
        "--kinds",
        nargs="+",
        choices=(*COPY_KINDS, *EVAL_KINDS),
        help="a trace of these kinds in turn (--per-kind each, --max-tokens each) "
        "instead of SmolLM2's held-out mix",
    )
    p.add_argument("--per-kind", type=int, default=4, help="with --kinds")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--planner", choices=("goodput", "fixed"), default="goodput")
    lbss_options(p, "z of the lbss+pruned runs (lbss runs explore every model)")
    p.add_argument("--timeout-s", type=float, default=900.0)
    p.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    for name in (
        "batch_size", "max_tokens", "copies", "alpha", "beta", "max_micro_batches", "requests",
        "per_kind",
    ):  # fmt: skip
        if (getattr(args, name, 1) or 1) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    return args


def prompt_lengths(per_kind: int) -> dict[str, list[int]]:
    """Token counts of the recorded evaluation prompts, chat-templated as they were recorded."""
    from transformers import AutoTokenizer

    from shared.datasets import eval_prompts
    from shared.model.model_set import target_dir
    from tools.prompts import chat_ids

    tokenizer = AutoTokenizer.from_pretrained(target_dir())
    return {
        kind: [len(chat_ids(tokenizer, text)) for text in eval_prompts(kind, per_kind)]
        for kind in ("chat", "code", "math")
    }


def table(results: Sequence[object], drafts: Sequence[str]) -> str:
    from bench.drafters.experiments import KindResult, chooser_runs, ratios

    labels = [run.label for run in chooser_runs(drafts)]
    lines = [
        "| workload | "
        + " | ".join(labels)
        + " | LBSS / best fixed | LBSS / eps-greedy | LBSS / oracle | oracle / best fixed"
        " | per-request best / best fixed | fast switching / LBSS |",
        "|---|" + "---:|" * (len(labels) + 6),
    ]
    for result in results:
        assert isinstance(result, KindResult)
        r = ratios(result, drafts)
        cells = [f"{result.goodput[label]:.1f}" for label in labels]
        keys = (
            "lbss / best fixed", "lbss / eps-greedy", "lbss / oracle", "oracle / best fixed",
            "per-request best / best fixed", "fast / lbss",
        )  # fmt: skip
        cells += [f"{r[k]:.2f}x" for k in keys]
        lines.append(f"| {result.kind} | " + " | ".join(cells) + " |")
    lines += ["", switch_table(results)]
    return "\n".join(lines)


def switch_table(results: Sequence[object]) -> str:
    """What LBSS's draft switches cost the new drafter, without and with fast switching: the
    committed tokens it still had to append when the switch happened (a prefill on the step's
    critical path), per switch."""
    from bench.drafters.experiments import FAST, KindResult

    lines = [
        "| workload | switches (LBSS) | tokens to append per switch | switches (fast) | "
        "of which warm | tokens to append per switch |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for result in results:
        assert isinstance(result, KindResult)
        cells = []
        for label in ("lbss", FAST):
            s = result.switches.get(label, {})
            count = s.get("warm", 0) + s.get("cold", 0)
            tokens = s.get("warm_tokens", 0) + s.get("cold_tokens", 0)
            cells.append(str(count))
            if label == FAST:
                cells.append(str(s.get("warm", 0)))
            cells.append(f"{tokens / count:.1f}" if count else "-")
        lines.append(f"| {result.kind} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def pipeline_table(results: Sequence[object]) -> str:
    from bench.drafters.experiments import PipelineResult

    rows = [r for r in results if isinstance(r, PipelineResult)]
    counts = sorted(rows[0].goodput) if rows else []
    lines = [
        "| workload | " + " | ".join(f"M={m}" for m in counts) + " | auto | auto / best |",
        "|---|" + "---:|" * (len(counts) + 2),
    ]
    for r in rows:
        cells = [f"{r.goodput[m]:.1f}" + (" (best)" if m == r.best else "") for m in counts]
        ratio = r.auto / r.goodput[r.best]
        lines.append(f"| {r.kind} | " + " | ".join(cells) + f" | {r.auto:.1f} | {ratio:.2f}x |")
    return "\n".join(lines)


def command_line(argv: Sequence[str] | None) -> str:
    return "python -m bench.drafters " + " ".join(argv if argv is not None else sys.argv[1:])


def write_results(out: Path, stem: str, data: dict[str, Any], markdown: str) -> int:
    """`<stem>.json` (the data) and `<stem>.md` (the table) in `out`; the table to stdout."""
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(data, indent=1) + "\n")
    (out / f"{stem}.md").write_text(markdown + "\n")
    print(markdown)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.experiment == "real":
        return main_real(args, argv)
    if args.experiment == "mixed":
        return main_mixed(args, argv)
    from bench.drafters.experiments import Setup, fig11, fig13
    from shared.scheduling.cost_model import CostModel, CostProfile
    from shared.settings import LbssSettings
    from tools.sim.acceptance import AcceptanceModel

    acceptance = AcceptanceModel.load(args.recording)
    per_kind = min(
        len({s.prompt for s in acceptance.sessions if s.kind == kind}) for kind in acceptance.kinds
    )
    profile = CostProfile.load(args.profile)
    setup = Setup(
        CostModel(profile),
        acceptance,
        batch_size=args.batch_size,
        max_tokens=args.max_tokens,
        lbss=LbssSettings(alpha=args.alpha, beta=args.beta, prune_z=args.prune_z),
        planner=args.planner,
    )
    started = time.monotonic()
    say = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    command = command_line(argv)
    if args.experiment == "fig13":
        pipeline = fig13(
            setup,
            prompt_lengths(per_kind),
            args.drafts,
            chooser=args.chooser,
            max_micro_batches=args.max_micro_batches,
            copies=args.copies,
            split=args.split,
            say=say,
        )
        data13 = {
            "command": command.strip(),
            "profile": args.profile.name,
            "batch_size": args.batch_size,
            "chooser": args.chooser,
            "split": args.split,
            "seconds": round(time.monotonic() - started, 1),
            "results": [
                {"kind": r.kind, "goodput_tps": r.goodput, "auto_tps": r.auto, "best": r.best}
                for r in pipeline
            ],
        }
        stem = f"fig13-{args.profile.stem}" + ("-per-draft" if args.split == "per-draft" else "")
        return write_results(args.out, stem, data13, pipeline_table(pipeline))
    results = fig11(
        setup,
        prompt_lengths(per_kind),
        args.drafts,
        copies=args.copies,
        oracle_passes=args.oracle_passes,
        say=say,
    )
    data = {
        "command": command.strip(),
        "profile": args.profile.name,
        "recording": args.recording.name,
        "batch_size": args.batch_size,
        "max_tokens": args.max_tokens,
        "copies": args.copies,
        "lbss": {"alpha": args.alpha, "beta": args.beta, "prune_z": args.prune_z},
        "planner": args.planner,
        "seconds": round(time.monotonic() - started, 1),
        "results": [
            {
                "kind": r.kind,
                "goodput_tps": r.goodput,
                "lbss_settled": r.settled,
                "oracle_assignment": r.oracle,
                "per_request_best": r.per_request_best,
                "switches": r.switches,
            }
            for r in results
        ],
    }
    return write_results(args.out, f"fig11-{args.profile.stem}", data, table(results, args.drafts))


def main_mixed(args: argparse.Namespace, argv: Sequence[str] | None) -> int:
    from bench.drafters.experiments import Setup
    from bench.drafters.mixed import mixed, mixed_requests, mixed_table
    from shared.scheduling.cost_model import CostModel, CostProfile
    from shared.settings import LbssSettings
    from tools.sim.acceptance import AcceptanceModel

    acceptance = AcceptanceModel.load(args.recording)
    setup = Setup(
        CostModel(CostProfile.load(args.profile)),
        acceptance,
        batch_size=args.batch_size,
        max_tokens=args.max_tokens,
        lbss=LbssSettings(alpha=args.alpha, beta=args.beta, prune_z=args.prune_z),
        planner=args.planner,
    )
    requests = mixed_requests(acceptance, args.max_tokens, args.per_kind, args.copies)
    started = time.monotonic()
    say = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    result = mixed(setup, requests, args.drafts, oracle_passes=args.oracle_passes, say=say)
    data = {
        "command": command_line(argv).strip(),
        "profile": args.profile.name,
        "recording": args.recording.name,
        "requests": {
            k: sum(r.kind == k for r in requests) for k in dict.fromkeys(r.kind for r in requests)
        },
        "copies": args.copies,
        "batch_size": args.batch_size,
        "max_tokens": args.max_tokens,
        "planner": args.planner,
        "seconds": round(time.monotonic() - started, 1),
        "goodput_tps": result.goodput,
        "ratios": result.ratios(),
        "histogram": result.histogram,
        "counterfactual_steps": result.counterfactual_steps,
        "tokens_per_forward": result.per_forward,
    }
    stem = f"mixed-{args.profile.stem}"
    return write_results(args.out, stem, data, mixed_table(result, args.drafts))


def main_real(args: argparse.Namespace, argv: Sequence[str] | None) -> int:
    from bench.drafters.real import heldout_trace, kinds_trace, real

    started = time.monotonic()
    if args.kinds:
        trace = kinds_trace(args.kinds, args.per_kind, args.max_tokens)
    elif args.model_set != SMOLLM2:
        raise SystemExit("the held-out mix is SmolLM2's recording: with --model-set, give --kinds")
    else:
        trace = heldout_trace(args.requests, args.max_tokens, args.seed)
    result = real(
        trace,
        args.drafts,
        args.choosers,
        batch_size=args.batch_size,
        planner=args.planner,
        timeout_s=args.timeout_s,
        out_dir=args.out,
        alpha=args.alpha,
        beta=args.beta,
        prune_z=args.prune_z,
        model_set=args.model_set,
        target_dtype=args.target_dtype,
    )
    command = command_line(argv).strip()
    result = {"command": command, "seconds": round(time.monotonic() - started, 1)} | result
    lines = ["| run | goodput (tok/s) | failed | most used draft per kind |", "|---|---:|---:|---|"]
    for label, row in result["runs"].items():
        where = "; ".join(
            f"{kind}: " + ", ".join(f"{d} {n}" for d, n in sorted(counts.items()))
            for kind, counts in row["settled"].items()
        )
        lines.append(f"| {label} | {row['goodput_tok_s']:.1f} | {row['failed']} | {where} |")
    return write_results(args.out, "real", result, "\n".join(lines))


if __name__ == "__main__":
    raise SystemExit(main())
