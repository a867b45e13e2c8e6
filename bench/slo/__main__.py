"""SLO-customized speculation measured: every tree selector under AdaServe's three-class mix,
simulated (rate sweep and urgent-share sweep) and as real replays through the services.

    python -m bench.slo rates  [--rates 0.25 0.5 1 2 4] [--requests 120] [--draws 3]
    python -m bench.slo urgent [--rate 1] [--shares 0.2 0.4 0.6 0.8]
    python -m bench.slo real   [--rates 0.2 0.4 0.8] [--requests 24] [--selectors ...]
    python -m bench.slo rates --model-set qwen2.5-coder [--rates ...]   (simulated only)

Results go to `--out` (default `docs/results/slo/`): one JSON per experiment and machine with the
command that made it, and a markdown table. Simulations use every committed cost profile of the
model set's target (`--profile` to choose) and its committed acceptance recordings
(`bench/model_set_files.py`; another set's serve the held-out prompts with SmolLM2's answer
lengths); the classes' objectives are 1.0x, 2.4x and 8x each profile's baseline latency (one
plain-decoding step at batch 8).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.model_set_files import SET_FILES, default_draft, load_recording
from shared.model.model_set import REPO_ROOT, SMOLLM2

OUT = REPO_ROOT / "docs" / "results" / "slo"


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    from bench.slo.experiments import SELECTORS

    parser = argparse.ArgumentParser(prog="python -m bench.slo", description=__doc__)
    sub = parser.add_subparsers(dest="experiment", required=True)

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("--out", type=Path, default=OUT)
        p.add_argument("--model-set", choices=tuple(SET_FILES), default=SMOLLM2)
        p.add_argument("--draft", help="default: draft-s for SmolLM2, else the recording's")
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--batch-size", type=int, default=16, help="running-set limit")
        p.add_argument("--selectors", nargs="+", default=list(SELECTORS), choices=SELECTORS)

    def simulated(p: argparse.ArgumentParser) -> None:
        common(p)
        p.add_argument(
            "--admission", choices=("urgent-first", "feasible-first"), default="urgent-first"
        )
        p.add_argument(
            "--throughput-phase", choices=("budget", "goodput"), default="budget",
            help="adaserve's throughput phase: spend the hardware budget (the paper) or stop "
            "where nodes stop paying for their verification",
        )  # fmt: skip
        p.add_argument(
            "--profile", type=Path, action="append", help="cost profile(s); default: committed"
        )
        p.add_argument(
            "--step-overhead-ms", type=float, default=0.0,
            help="per-step time outside the forwards, on CPU profiles (tools.sim.calibrate)",
        )  # fmt: skip
        p.add_argument("--requests", type=int, default=120, help="requests per trace")
        p.add_argument("--draws", type=int, default=3, help="random draws of the trace")
        p.add_argument(
            "--beam-recording", type=Path,
            help="adaserve's candidates: a recording of unpruned beams (tools.sim.acceptance "
            "--beam 8 4; default: the model set's committed one)",
        )  # fmt: skip

    p = sub.add_parser("rates", help="AdaServe Fig. 4-5: attainment and goodput per rate")
    simulated(p)
    p.add_argument("--rates", type=float, nargs="+", help="req/s (default: per machine)")

    p = sub.add_parser("urgent", help="AdaServe Fig. 6: the urgent share swept")
    simulated(p)
    p.add_argument("--rate", type=float, help="req/s (default: per machine)")
    p.add_argument("--shares", type=float, nargs="+", default=[0.2, 0.4, 0.6, 0.8])

    p = sub.add_parser("real", help="the rate sweep as real replays through the services")
    common(p)
    p.add_argument("--rates", type=float, nargs="+", default=[0.2, 0.4, 0.8])
    p.add_argument("--requests", type=int, default=24)
    p.add_argument("--timeout-s", type=float, default=900.0)
    p.set_defaults(batch_size=8)
    args = parser.parse_args(argv)
    if args.experiment == "real" and args.model_set != SMOLLM2:
        parser.error("real replays serve SmolLM2 only; simulate another set (rates, urgent)")
    return args


# Rates that run from light load to overload on each kind of machine (requests per second).
DEFAULT_RATES = {"cpu": [0.125, 0.25, 0.5, 1.0, 2.0], "cuda": [8.0, 16.0, 32.0, 64.0, 128.0]}
DEFAULT_URGENT_RATE = {"cpu": 0.25, "cuda": 32.0}


def machines(args: argparse.Namespace) -> list[Any]:
    from bench.scheduling.experiments import Machine
    from shared.scheduling.cost_model import CostModel, CostProfile

    prefix = SET_FILES[args.model_set].prefix
    paths = args.profile or SET_FILES[args.model_set].profiles()
    out = []
    for path in paths:
        cost = CostModel(CostProfile.load(path))
        is_cpu = cost.profile.target.key.device.startswith("cpu")
        overhead = args.step_overhead_ms if is_cpu else 0.0
        out.append(Machine(Path(path).stem.removeprefix(f"{prefix}-"), cost, overhead))
    return out


def machine_kind(machine: Any) -> str:
    return "cpu" if machine.shared_device else "cuda"


def write(args: argparse.Namespace, name: str, result: dict[str, Any]) -> Path:
    args.out.mkdir(parents=True, exist_ok=True)
    result["command"] = "python -m bench.slo " + " ".join(sys.argv[1:])
    path = args.out / f"{name}.json"
    path.write_text(json.dumps(result, indent=1, default=str) + "\n")
    print(f"wrote {path}", file=sys.stderr)
    return path


def main(argv: Sequence[str] | None = None) -> int:
    from transformers import AutoTokenizer

    from bench.scheduling.experiments import log_progress
    from bench.scheduling.workloads import load_heldout
    from bench.slo import experiments, reports
    from bench.slo.workloads import Workload
    from shared.model.model_set import model_set_target
    from shared.settings import SloSettings
    from tools.sim.acceptance import AcceptanceModel

    args = parse_args(argv)
    files = SET_FILES[args.model_set]
    started = time.monotonic()
    # the held-out chat prompts in the set's chat template; their answer lengths are SmolLM2's
    # (the only target labelled): another set's requests run as long as SmolLM2's answers
    tokenizer = AutoTokenizer.from_pretrained(model_set_target(args.model_set))
    workload = Workload(tokenizer, load_heldout(tokenizer), seed=args.seed)
    # a recording with text follows it, and drafts nothing accepted past its end: the SLO
    # workload's requests run longer than the recorded answers, so the steps replay round
    acceptance = load_recording(files.recording).without_text()
    args.draft = args.draft or default_draft(args.model_set)
    slo = SloSettings()
    if args.experiment != "real":  # the services take their defaults
        slo = SloSettings(admission=args.admission, throughput_phase=args.throughput_phase)
    if args.experiment == "real":
        from bench.slo.real import real

        result = real(
            args.selectors, args.rates, num_requests=args.requests, batch_size=args.batch_size,
            draft=args.draft, seed=args.seed, timeout_s=args.timeout_s, out_dir=args.out,
            acceptance=acceptance, progress=log_progress,
        )  # fmt: skip
        write(args, "real", result)
        reports.write_markdown(args.out / "real.md", reports.real_markdown(result))
        return 0
    beams = AcceptanceModel.load(args.beam_recording or files.beams).without_text()
    for machine in machines(args):
        setup = experiments.Setup(
            machine, acceptance, batch_size=args.batch_size, draft=args.draft, slo=slo,
            requests=args.requests, draws=args.draws, beam_acceptance=beams,
        )  # fmt: skip
        kind = machine_kind(machine)
        if args.experiment == "rates":
            rates = args.rates or DEFAULT_RATES[kind]
            result = experiments.rates(workload, setup, rates, args.selectors, log_progress)
        else:
            rate = args.rate or DEFAULT_URGENT_RATE[kind]
            shares = args.shares
            result = experiments.urgent(workload, setup, rate, shares, args.selectors, log_progress)
        result["machine"] = machine.label
        result["step_overhead_ms"] = machine.step_overhead_ms
        if args.experiment == "rates":
            markdown = reports.rates_markdown(machine.label, result)
        else:
            markdown = reports.urgent_markdown(machine.label, result)
        name = f"{args.experiment}-{machine.label}"
        write(args, name, result)
        reports.write_markdown(args.out / f"{name}.md", markdown)
        reports.plot(args.out / f"{name}.png", args.experiment, machine.label, result)
    print(f"done in {time.monotonic() - started:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
