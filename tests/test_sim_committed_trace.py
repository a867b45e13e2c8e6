"""The simulator's numbers on the committed trace (`docs/results/load-testing/trace.jsonl`) with
the committed profile and acceptance recordings are pinned: a change to the scheduler core, the
executor contract or the simulator that moves any request's record fails here. Regenerate them
only for a change meant to move the numbers, and say so in the commit (last: a drafted path
that ends at a leaf above the depth the planner asked for counts a failure in its per-depth
estimate; the three goodput-planned configurations moved, their throughput within 0.3%)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Any

import pytest

from shared.scheduling.config import SchedulerConfig
from shared.scheduling.cost_model import CostModel, CostProfile
from tools.load.readers import read_trace
from tools.sim.acceptance import AcceptanceModel
from tools.sim.simulator import SimConfig, Simulator
from tools.simulate import to_sim_requests

REPO = Path(__file__).resolve().parents[1]
TRACE = REPO / "docs/results/load-testing/trace.jsonl"
PROFILE = REPO / "profiles/SmolLM2-135M-Instruct-cpu-amd-epyc-float32-t2.json"
ONE_DRAFT = REPO / "profiles/acceptance-SmolLM2-135M-Instruct.json.gz"
THREE_DRAFTS = REPO / "profiles/acceptance-SmolLM2-135M-Instruct-3drafts.json.gz"
NUM_REQUESTS = 60
DRAFTS = ("draft-s", "draft-m", "draft-l")

CONFIGS: dict[str, tuple[Path, SchedulerConfig, dict[str, Any]]] = {
    "default": (
        ONE_DRAFT,
        SchedulerConfig(),
        {"step_overhead_ms": 12.4, "request_overhead_ms": 16.5},
    ),
    "two-micro-batches-lbss": (
        THREE_DRAFTS,
        SchedulerConfig(micro_batches=2, draft_chooser="lbss"),
        {"drafts": DRAFTS, "shared_device": False},
    ),
    "fast-switching": (
        THREE_DRAFTS,
        SchedulerConfig(fast_switching=True, draft_chooser="lbss"),
        {"drafts": DRAFTS},
    ),
    "prefix-adaserve-laps": (
        ONE_DRAFT,
        SchedulerConfig(
            tree_selection="adaserve",
            policy="laps-sd",
            max_tokens_per_step=256,
            max_running_requests=16,
        ),
        {"prefix_caching": True},
    ),
}
GOLDEN = {
    "default": "41e90fa0f370f4a90cdd26b360e2f768d63d710e4b1fa0823b06d531805656b1",
    "two-micro-batches-lbss": "8090d29200478fd7518e744a07ec6bd0de04c8caa93bc25be5014bc9e2d7a4a3",
    "fast-switching": "b9d232d3638dd50f4e583b91f85149b5f3c1efdb869e8d4d0470aafd6d745bdb",
    "prefix-adaserve-laps": "954fb99c9ed1d1a97e5ddb64c5656e880e4234fd81bc1b7456b847947c59f807",
}


def _rounded(value: Any) -> Any:
    """Floats to 9 significant digits: the digest pins the schedule, not the last ulp."""
    if isinstance(value, float):
        return float(f"{value:.9g}")
    if isinstance(value, (list, tuple)):
        return [_rounded(v) for v in value]
    if isinstance(value, dict):
        return {k: _rounded(v) for k, v in value.items()}
    return value


def digest(name: str) -> str:
    acceptance, scheduler, fields = CONFIGS[name]
    requests = to_sim_requests(read_trace(TRACE)[:NUM_REQUESTS], 1.0, REPO)
    cost = CostModel(CostProfile.load(PROFILE))
    sim = Simulator(SimConfig(scheduler, **fields), cost, AcceptanceModel.load(acceptance))
    lines = [json.dumps(_rounded(dataclasses.asdict(r)), sort_keys=True) for r in sim.run(requests)]
    extra = {"switches": dict(sim.core.switches), "cached": sim.cached_prompt_tokens}
    lines.append(json.dumps(extra, sort_keys=True))
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()


@pytest.mark.parametrize("name", list(CONFIGS))
def test_the_simulators_records_on_the_committed_trace_are_unchanged(name: str) -> None:
    assert digest(name) == GOLDEN[name]
