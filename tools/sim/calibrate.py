"""The simulator's overheads, measured from a running scheduler service.

A cost profile times the models' forwards alone. A step of the services also spends time outside
them: the verifier's acceptance and KV commit, messages through Redis, scheduling, and on a CPU
host the other services' threads taking turns on the same cores. The scheduler service logs
every micro-batch at DEBUG level (`python -m services all --log-level DEBUG`): its members, the
drafters' and verifier's own times and the whole step's. This fits what the profile does not
explain as a fixed part per micro-batch plus a part growing with the decoding requests:

    step - draft - profile.verify_ms(tokens, context, requests) ~ a + b * sqrt(decoding requests)

The square root is what fitted on this 2-core CPU (all services in one process): the excess per
step grows with the requests but less than linearly (a fit linear in the requests on a run of
1 to 16 requests predicted 1.7x the excess measured at 16 to 64). Calibrate on a run that spans
the batch sizes you will simulate (an overloaded one does).

    python -m tools.sim.calibrate services.log --profile PATH
    -> --step-overhead-ms a --request-overhead-ms b  (the simulator's flags)
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from shared.scheduling.cost_model import CostModel, CostProfile

LINE = re.compile(
    r"micro-batch \d+: (?P<decoding>\d+) decoding \((?P<nodes>\d+) tree nodes"
    r"(?:, (?P<planned>\d+) planned drafts)?\), (?P<prefilling>\d+) prefilling "
    r"\((?P<prefill_tokens>\d+) tokens\), context (?P<context>\d+)"
    r"(?:, (?P<committed>\d+) tokens committed)?; draft (?P<draft>[\d.]+) ms, "
    r"verify (?P<verify>[\d.]+) ms, step (?P<step>[\d.]+) ms"
)


@dataclass(frozen=True)
class StepTiming:
    num_decoding: int
    num_tree_nodes: int
    num_prefilling: int
    num_prefill_tokens: int
    context: int
    draft_ms: float
    verify_ms: float
    step_ms: float
    # logged since 2026-11-27 (None in older logs): requests with a draft plan, tokens committed
    num_planned_drafts: int | None = None
    num_committed: int | None = None


def parse_log(lines: Iterable[str]) -> list[StepTiming]:
    """The scheduler's per-micro-batch DEBUG lines among `lines`."""
    steps = []
    for line in lines:
        m = LINE.search(line)
        if m is None:
            continue
        g = m.groupdict()
        steps.append(
            StepTiming(
                *(int(g[k]) for k in ("decoding", "nodes", "prefilling", "prefill_tokens")),
                int(g["context"]),
                float(g["draft"]),
                float(g["verify"]),
                float(g["step"]),
                None if g["planned"] is None else int(g["planned"]),
                None if g["committed"] is None else int(g["committed"]),
            )
        )
    return steps


def unexplained_ms(steps: Sequence[StepTiming], cost: CostModel) -> np.ndarray:
    """Per step: its time minus the drafters' and what the profile says its verify takes."""
    return np.array(
        [
            s.step_ms
            - s.draft_ms
            - cost.verify_ms(
                s.num_tree_nodes + s.num_prefill_tokens,
                s.context,
                s.num_decoding + s.num_prefilling,
            )
            for s in steps
        ]
    )


def fit_overheads(steps: Sequence[StepTiming], cost: CostModel) -> tuple[float, float]:
    """(a, b): least squares of step - draft - predicted verify on a + b * sqrt(decoding)."""
    if len({s.num_decoding for s in steps}) < 2:
        raise ValueError("need steps with at least two different numbers of decoding requests")
    design = np.c_[np.ones(len(steps)), np.sqrt([s.num_decoding for s in steps])]
    (a, b), *_ = np.linalg.lstsq(design, unexplained_ms(steps, cost), rcond=None)
    return float(a), float(b)


def mean_overhead(steps: Sequence[StepTiming], cost: CostModel) -> float:
    """The mean of step - draft - predicted verify: the one overhead of a run whose steps all
    had the same number of decoding requests (one at a time, say), where `fit_overheads` has
    nothing to fit."""
    if not steps:
        raise ValueError("no micro-batch timings in the log (was it at DEBUG level?)")
    return float(np.mean(unexplained_ms(steps, cost)))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.sim.calibrate", description=__doc__)
    parser.add_argument("log", type=Path, help="a scheduler service's log at DEBUG level")
    parser.add_argument(
        "--profile", type=Path, required=True, help="the cost profile the simulator will use"
    )
    args = parser.parse_args(argv)
    try:
        steps = parse_log(args.log.read_text().splitlines())
        cost = CostModel(CostProfile.load(args.profile))
        a, b = fit_overheads(steps, cost)
    except (OSError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    decoding = np.array([s.num_decoding for s in steps])
    print(
        f"{len(steps)} micro-batches, {decoding.mean():.1f} decoding requests on average "
        f"(max {decoding.max()})",
        file=sys.stderr,
    )
    print(f"--step-overhead-ms {a:.1f} --request-overhead-ms {b:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
