"""Did drafting pay? The scheduler's per-step log, summed over its decoding steps.

The scheduler service logs every micro-batch at DEBUG level (`--log-level DEBUG`; its lines are
described in `tools.sim.calibrate`): its decoding requests, the tree nodes it verified, the
requests that had a draft plan and the tokens it committed. This splits the steps that only
decode (no prompt chunk in them) into those that verified draft nodes and those that did not,
and prints for each: how many, tokens committed per request per step, the mean step time and the
tokens per second of those steps alone.

    python -m tools.step_log services.log [more.log ...]
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from tools.sim.calibrate import StepTiming, parse_log


@dataclass
class StepSum:
    steps: int = 0
    request_steps: int = 0  # decoding requests, summed over the steps
    committed: int = 0
    planned: int = 0
    step_ms: float = 0.0
    draft_ms: float = 0.0

    def add(self, s: StepTiming) -> None:
        self.steps += 1
        self.request_steps += s.num_decoding
        self.committed += s.num_committed or 0
        self.planned += s.num_planned_drafts or 0
        self.step_ms += s.step_ms
        self.draft_ms += s.draft_ms

    def row(self, label: str) -> str:
        n = max(1, self.steps)
        return (
            f"| {label} | {self.steps} | {self.committed / max(1, self.request_steps):.2f} | "
            f"{self.planned / n:.2f} | {self.draft_ms / n:.1f} | {self.step_ms / n:.0f} | "
            f"{1000 * self.committed / max(1e-9, self.step_ms):.1f} |"
        )


def summarize(steps: Sequence[StepTiming]) -> dict[str, StepSum]:
    """Decoding-only steps with committed counts, by whether they verified draft nodes."""
    sums = {"drafted": StepSum(), "plain": StepSum()}
    for s in steps:
        if s.num_prefilling or not s.num_decoding or s.num_committed is None:
            continue
        drafted = s.num_tree_nodes > s.num_decoding
        sums["drafted" if drafted else "plain"].add(s)
    return sums


def report(sums: dict[str, StepSum]) -> str:
    lines = [
        "| steps | count | tokens per request-step | planned drafts per step | draft ms "
        "| step ms | tokens/s in these steps |",
        "|---|---|---|---|---|---|---|",
    ]
    lines += [s.row(label) for label, s in sums.items()]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.step_log", description=__doc__)
    parser.add_argument("logs", nargs="+")
    args = parser.parse_args(argv)
    for path in args.logs:
        with open(path, encoding="utf-8", errors="replace") as f:
            steps = parse_log(f)
        if not any(s.num_committed is not None for s in steps):
            print(f"{path}: no step lines with committed counts (a log from before 2026-11-27?)")
            continue
        print(f"{path}\n\n{report(summarize(steps))}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
