"""LAPS-SD and its baselines measured: simulated (the paper's experiments and a load sweep), on
the real engine (Eq. 6's error) and as real replays through the services.

    python -m bench.scheduling paper  [--sizes 10 20 30 40 50] [--draws 5] [--workloads ...]
    python -m bench.scheduling queues [--sizes 10 30 50] [--queues 2 3 4 5 6 7 8 9 10]
    python -m bench.scheduling load   [--batch-size 8] [--loads 0.8 0.9 1.0] [--requests 200]
    python -m bench.scheduling estimate [--requests 30] [--workload mix]
    python -m bench.scheduling real   [--requests 24] [--workload mix] [--policies ...]

Results go to `--out` (default `docs/results/scheduling/`): one JSON per experiment with the
command that made it, a markdown table, and a plot. Simulations use every committed cost profile
of the default target (`--profile` to choose) and the committed acceptance recording; with
`--model-set qwen2.5-coder` (simulations only) the 1.5B target's profiles and its recording
with the 0.5B serve the same trace: SmolLM2's held-out prompts and answer lengths, which the
length predictor was trained on.
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
from tools.simulate import add_laps_arguments, laps_settings

OUT = REPO_ROOT / "docs" / "results" / "scheduling"


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    from bench.scheduling.experiments import POLICY_RUNS
    from bench.scheduling.workloads import WORKLOADS

    parser = argparse.ArgumentParser(prog="python -m bench.scheduling", description=__doc__)
    sub = parser.add_subparsers(dest="experiment", required=True)
    labels = [run.label for run in POLICY_RUNS]

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("--out", type=Path, default=OUT)
        p.add_argument("--model-set", choices=tuple(SET_FILES), default=SMOLLM2)
        p.add_argument("--draft", help="default: draft-s for SmolLM2, else the recording's")
        p.add_argument("--seed", type=int, default=0)
        add_laps_arguments(p)

    def simulated(p: argparse.ArgumentParser) -> None:
        common(p)
        p.add_argument(
            "--profile", type=Path, action="append", help="cost profile(s); default: committed"
        )
        p.add_argument(
            "--step-overhead-ms", type=float, default=0.0,
            help="per-step time outside the forwards, on CPU profiles (tools.sim.calibrate)",
        )  # fmt: skip
        p.add_argument("--request-overhead-ms", type=float, default=0.0)
        p.add_argument("--draws", type=int, default=5, help="random draws of the requests")
        p.add_argument("--policies", nargs="+", default=labels, choices=labels)

    p = sub.add_parser("paper", help="B = 1, 10 to 50 requests at once (the paper's Fig. 5)")
    simulated(p)
    p.add_argument("--workloads", nargs="+", default=["chat", "code", "long"], choices=WORKLOADS)
    p.add_argument("--sizes", nargs="+", type=int, default=[10, 20, 30, 40, 50])

    p = sub.add_parser("queues", help="LAPS-SD's K from 2 to 10 (the paper's Fig. 6)")
    simulated(p)
    p.add_argument("--workloads", nargs="+", default=["chat", "code", "long"], choices=WORKLOADS)
    p.add_argument("--sizes", nargs="+", type=int, default=[10, 30, 50])
    p.add_argument("--queues", nargs="+", type=int, default=list(range(2, 11)))

    p = sub.add_parser("load", help="B > 1 under Poisson arrivals near capacity")
    simulated(p)
    p.add_argument("--workload", default="mix", choices=WORKLOADS)
    p.add_argument("--requests", type=int, default=200)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--loads", nargs="+", type=float, default=[0.8, 0.9, 1.0])

    p = sub.add_parser("estimate", help="Eq. 6 against real execution times (the engine, B = 1)")
    common(p)
    p.add_argument("--workload", default="mix", choices=WORKLOADS)
    p.add_argument("--requests", type=int, default=30)
    p.add_argument("--threads", type=int, default=2)

    p = sub.add_parser("real", help="real replays through the services, one policy at a time")
    common(p)
    p.add_argument("--workload", default="mix", choices=WORKLOADS)
    p.add_argument("--requests", type=int, default=24)
    p.add_argument("--policies", nargs="+", default=["fcfs", "las", "lp-sjf", "laps-sd"])
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--timeout-s", type=float, default=1800)
    args = parser.parse_args(argv)
    if args.experiment in ("estimate", "real") and args.model_set != SMOLLM2:
        parser.error(f"{args.experiment} runs SmolLM2 only; simulate another set")
    args.draft = args.draft or default_draft(args.model_set)
    return args


def tokenizer() -> Any:
    from transformers import AutoTokenizer

    from shared.model.model_set import target_dir

    return AutoTokenizer.from_pretrained(target_dir())


def machines(args: argparse.Namespace) -> list[Any]:
    from bench.scheduling.experiments import Machine
    from shared.scheduling.cost_model import CostModel, CostProfile

    paths = args.profile or SET_FILES[args.model_set].profiles()
    out = []
    for path in paths:
        cost = CostModel(CostProfile.load(path))
        key = cost.profile.target.key
        on_cpu = key.device.startswith("cpu")
        out.append(
            Machine(
                f"{key.device}",
                cost,
                args.step_overhead_ms if on_cpu else 0.0,
                args.request_overhead_ms if on_cpu else 0.0,
            )
        )
    return out


def acceptance_model(args: argparse.Namespace) -> Any:
    return load_recording(SET_FILES[args.model_set].recording)


def write(out: Path, name: str, result: dict[str, Any], argv: Sequence[str]) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    result = {"command": "python -m bench.scheduling " + " ".join(argv), **result}
    path = out / f"{name}.json"
    path.write_text(json.dumps(result, indent=1) + "\n")
    return path


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    started = time.perf_counter()
    from bench.scheduling.reports import SIMULATED, markdown
    from bench.scheduling.workloads import load_heldout

    laps = laps_settings(args)
    items = load_heldout(tokenizer())
    if args.experiment in SIMULATED:
        result = SIMULATED[args.experiment](
            args, machines(args), acceptance_model(args), items, laps
        )
    elif args.experiment == "estimate":
        from bench.scheduling.estimate import estimate

        result = estimate(args, items, laps)
    else:
        from bench.scheduling.real import real

        result = real(args, items, laps, acceptance_model(args))
    result["wall_s"] = round(time.perf_counter() - started, 1)
    path = write(args.out, args.experiment, result, argv)
    table = markdown(args.experiment, result)
    (args.out / f"{args.experiment}.md").write_text(table)
    print(table)
    print(f"wrote {path} in {result['wall_s']} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
