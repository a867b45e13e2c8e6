"""Simulate serving a trace: the scheduler core and its policies on a virtual clock.

    python -m tools.simulate --trace trace.jsonl --out runs/sim [--profile PATH]
        [--policy fcfs] [--selector goodput] [--draft-chooser fixed] [--micro-batches 1]
        [--batch-size 64] [--drafts draft-s] [--rate-scale 1.0]

Step latencies come from a cost profile (`python -m tools.profile`): `--profile PATH`, else the
stored profile matching this machine's models, else one is measured. Acceptance comes from a
recording of the real engine (`python -m tools.sim.acceptance`). Policies are named as in the
services' settings. The report (`report.json`, `report.md`, plots) has the same form as a real
replay's (`python -m tools.replay run`), so the two compare with `python -m tools.replay compare`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from shared.scheduling.config import SchedulerConfig
from shared.scheduling.cost_model import CostModel, CostProfile, ProfileMismatchError
from shared.scheduling.draft_choice import CHOOSERS
from shared.scheduling.laps import PREDICTORS
from shared.scheduling.ordering import POLICIES
from shared.scheduling.tree_selection import SELECTORS
from shared.settings import LapsSettings
from tools.load.trace import TraceError, TraceRequest
from tools.sim.acceptance import AcceptanceModel
from tools.sim.simulator import SimConfig, SimRequest, Simulator

LAPS = LapsSettings()  # the defaults of the services' settings
PROFILES_DIR = Path(__file__).resolve().parent.parent / "profiles"


class UsageError(Exception):
    """Bad input: reported as one line, exit code 2."""


NESTED = ("scheduler", "method", "oracle")  # SimConfig fields not written as they are


def add_laps_arguments(parser: argparse.ArgumentParser) -> None:
    """LAPS-SD's parameters as flags, defaulting to the services' settings."""
    parser.add_argument("--laps-queues", type=int, default=LAPS.num_queues, help="K")
    parser.add_argument("--laps-first-threshold-ms", type=float, default=LAPS.first_threshold_ms)
    parser.add_argument("--laps-threshold-base", type=float, default=LAPS.threshold_base)
    parser.add_argument("--laps-stable-rounds", type=int, default=LAPS.stable_rounds)
    parser.add_argument("--laps-stable-delta", type=float, default=LAPS.stable_delta)


def laps_settings(args: argparse.Namespace) -> LapsSettings:
    """The settings `add_laps_arguments`' flags give (validated as the services' are)."""
    return LapsSettings(
        num_queues=args.laps_queues,
        first_threshold_ms=args.laps_first_threshold_ms,
        threshold_base=args.laps_threshold_base,
        stable_rounds=args.laps_stable_rounds,
        stable_delta=args.laps_stable_delta,
    )


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    from shared.engine.presets import DEFAULT_DRAFT

    parser = argparse.ArgumentParser(
        prog="python -m tools.simulate",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--trace", type=Path, required=True, help="trace file (.jsonl/.csv/.json)")
    parser.add_argument("--out", type=Path, required=True, help="directory for the report")
    parser.add_argument("--profile", type=Path, help="cost profile (default: this machine's)")
    parser.add_argument("--acceptance", type=Path, help="acceptance recording (default: stored)")
    parser.add_argument("--target", type=Path, help="target model directory (tokenizer, limits)")
    parser.add_argument("--policy", default="fcfs", choices=POLICIES)
    parser.add_argument(
        "--length-predictor",
        choices=sorted(PREDICTORS),
        default="learned",
        help="output lengths for lp-sjf and laps-sd: learned (from the prompt's tokens; a "
        "length-only trace has none to read) or oracle (the trace's, an upper bound)",
    )
    add_laps_arguments(parser)
    parser.add_argument("--selector", default="goodput", choices=sorted(SELECTORS))
    parser.add_argument("--draft-chooser", default="fixed", choices=sorted(CHOOSERS))
    parser.add_argument("--planner", default="goodput", choices=["goodput", "fixed"])
    parser.add_argument("--micro-batches", type=int, default=1, help="M micro-batches in flight")
    parser.add_argument("--batch-size", type=int, default=64, help="running-set limit")
    parser.add_argument("--token-budget", type=int, default=512, help="tokens per verify step")
    parser.add_argument("--drafts", nargs="*", default=[DEFAULT_DRAFT], help="draft models")
    parser.add_argument("--rate-scale", type=float, default=1.0, help="arrival rate multiplier")
    parser.add_argument("--duration", type=float, help="only requests arriving before this (s)")
    parser.add_argument("--max-requests", type=int, help="only the first N requests")
    parser.add_argument("--rate", type=float, help="arrival rate for ShareGPT traces (req/s)")
    devices = parser.add_mutually_exclusive_group()
    devices.add_argument(
        "--shared-device",
        dest="shared_device",
        action="store_true",
        default=None,
        help="drafters and verifier take turns on one device (default on a CPU profile)",
    )
    devices.add_argument(
        "--separate-devices",
        dest="shared_device",
        action="store_false",
        help="each draft model and the verifier on a device of its own (default on GPUs)",
    )
    parser.add_argument(
        "--step-overhead-ms",
        type=float,
        default=0.0,
        help="time per micro-batch outside the forwards (scheduling, messaging); the scheduler "
        "service logs it per micro-batch with --log-level DEBUG",
    )
    parser.add_argument(
        "--request-overhead-ms",
        type=float,
        default=0.0,
        help="more time per micro-batch outside the forwards: this times the square root of "
        "its decoding requests (python -m tools.sim.calibrate measures both)",
    )
    parser.add_argument(
        "--prefix-caching",
        action="store_true",
        help="model the verifier's prefix cache (shared prompt prefixes, Mooncake hash_ids)",
    )
    parser.add_argument(
        "--prefix-cache-blocks", type=int, default=1 << 20, help="the cache's 16-token blocks"
    )
    parser.add_argument("--label", help="label of this run in comparisons")
    parser.add_argument("--no-plots", action="store_true")
    args = parser.parse_args(argv)
    if args.rate_scale <= 0:
        parser.error("--rate-scale must be > 0")
    if args.micro_batches < 1 or args.batch_size < 1 or args.token_budget < 1:
        parser.error("--micro-batches, --batch-size and --token-budget must be >= 1")
    return args


def target_dir(args: argparse.Namespace) -> Path:
    if args.target is not None:
        return args.target
    from shared.model.model_set import target_dir as default_target

    return default_target()


def load_cost(args: argparse.Namespace, target: Path) -> CostModel:
    if args.profile is not None:
        try:
            return CostModel(CostProfile.load(args.profile))
        except (OSError, ValueError) as error:
            raise UsageError(f"cannot read the profile {args.profile}: {error}") from None
    # this machine's: load the models only to know their keys (and measure if none is stored)
    from shared.model import load_model
    from shared.model.cost_profiles import load_or_measure
    from shared.model.model_set import draft_dirs
    from shared.model.runner import ModelRunner

    runner = ModelRunner(load_model(target), kv_memory_bytes=64 << 20)
    dirs = draft_dirs()
    drafts = {}
    for name in args.drafts:
        if name not in dirs:
            raise UsageError(f"unknown draft model {name!r} (known: {sorted(dirs)})")
        drafts[name] = ModelRunner(
            load_model(dirs[name], target_path=target), kv_memory_bytes=64 << 20
        )
    cost = load_or_measure(
        runner, drafts, target_name=target.name, directory=PROFILES_DIR, check_stored=False
    )
    if cost is None:
        raise UsageError("no cost profile for this machine and none could be measured")
    return cost


def load_acceptance(args: argparse.Namespace, target: Path) -> AcceptanceModel:
    path = args.acceptance or PROFILES_DIR / f"acceptance-{target.name}.json.gz"
    if not path.is_file():
        raise UsageError(
            f"no acceptance recording at {path}: record one with "
            f"python -m tools.sim.acceptance --out {path}"
        )
    try:
        return AcceptanceModel.load(path)
    except (OSError, ValueError, KeyError) as error:
        raise UsageError(f"cannot read the acceptance recording {path}: {error}") from None


def load_trace(args: argparse.Namespace) -> list[TraceRequest]:
    """The trace's requests the replay would send with the same flags, in send order."""
    from tools.load.client import schedule
    from tools.load.readers import read_trace

    if not args.trace.is_file():
        raise UsageError(f"no trace at {args.trace}")
    try:
        requests = read_trace(args.trace, rate=args.rate)
    except TraceError as error:
        raise UsageError(str(error)) from None
    plan = schedule(
        requests,
        rate_scale=args.rate_scale,
        duration_s=args.duration,
        max_requests=args.max_requests,
    )
    return [requests[index] for index, _ in plan]


def to_sim_requests(
    requests: Sequence[TraceRequest], rate_scale: float, target: Path
) -> list[SimRequest]:
    """Token counts of each request; texts are counted with the target's chat template."""
    tokenizer = None
    out = []
    for i, r in enumerate(requests):
        num_prompt = r.input_length
        ids: list[int] | None = None
        if num_prompt is None:
            if tokenizer is None:
                from transformers import AutoTokenizer

                tokenizer = AutoTokenizer.from_pretrained(target)
            messages = [{"role": role, "content": text} for role, text in r.messages or ()]
            if r.prompt is not None:
                messages = [{"role": "user", "content": r.prompt}]
            ids = tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=True, return_dict=False
            )
            num_prompt = len(ids)
        num_output = r.num_output_tokens
        if num_output is None or num_output < 1:
            raise UsageError(f"trace request {i} has no output length")
        out.append(
            SimRequest(
                r.arrival_s / rate_scale,
                num_prompt,
                num_output,
                kind=r.kind,
                slo_class=r.slo_class,
                tpot_slo_ms=r.tpot_slo_ms,
                priority=r.priority,
                prompt_tokens=tuple(ids) if ids is not None else None,
                hash_ids=r.hash_ids,
            )
        )
    return out


def target_limits(target: Path) -> tuple[int, int]:
    config = json.loads((target / "config.json").read_text())
    return int(config["vocab_size"]), int(config.get("max_position_embeddings", 8192))


def simulate(args: argparse.Namespace) -> dict[str, Any]:
    from tools.load.report import write_report

    target = target_dir(args)
    trace = load_trace(args)
    requests = to_sim_requests(trace, args.rate_scale, target)
    cost = load_cost(args, target)
    acceptance = load_acceptance(args, target)
    device = cost.profile.target.key.device
    shared = device.startswith("cpu") if args.shared_device is None else args.shared_device
    vocab, max_context = target_limits(target)
    config = SimConfig(
        vocab_size=vocab,
        max_context=max_context,
        scheduler=SchedulerConfig(
            max_tokens_per_step=args.token_budget,
            max_running_requests=args.batch_size,
            micro_batches=args.micro_batches,
            policy=args.policy,
            length_predictor=args.length_predictor,
            laps=laps_settings(args),
            tree_selection=args.selector,
            draft_chooser=args.draft_chooser,
            planner=args.planner,
        ),
        drafts=tuple(args.drafts),
        shared_device=shared,
        step_overhead_ms=args.step_overhead_ms,
        request_overhead_ms=args.request_overhead_ms,
        prefix_caching=args.prefix_caching,
        prefix_cache_blocks=args.prefix_cache_blocks,
    )
    try:
        simulator = Simulator(config, cost, acceptance)
    except ValueError as error:
        raise UsageError(str(error)) from None
    started = time.perf_counter()
    records = simulator.run(requests)
    wall = time.perf_counter() - started
    meta = {
        "command": "python -m tools.simulate " + " ".join(sys.argv[1:]),
        "label": args.label or args.out.name,
        "trace": str(args.trace),
        "rate_scale": args.rate_scale,
        "simulated": True,
        "device": device,
        "config": {k: v for k, v in vars(config).items() if k not in NESTED}
        | config.scheduler.model_dump(),
        "wall_s": round(wall, 2),
    }
    summary = write_report(args.out, records, meta=meta, plots=not args.no_plots)
    print(f"simulated {len(records)} requests in {wall:.1f} s ({device})", file=sys.stderr)
    if args.prefix_caching:
        rate = simulator.cached_prompt_tokens / max(1, simulator.prompt_tokens)
        print(
            f"prefix cache: {simulator.cached_prompt_tokens} of {simulator.prompt_tokens} "
            f"prefilled prompt tokens found cached ({rate:.1%})",
            file=sys.stderr,
        )
    return summary


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        simulate(args)
    except (UsageError, ProfileMismatchError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print((args.out / "report.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
