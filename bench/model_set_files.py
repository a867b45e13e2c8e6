"""What the simulated scheduling and SLO experiments (`bench.scheduling`, `bench.slo`) replay for
each model set: its committed cost profiles and acceptance recordings. The trace stays
SmolLM2's held-out prompts and answer lengths whatever the set (the only target labelled)."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

from shared.model.model_set import REPO_ROOT, SMOLLM2
from tools.sim.acceptance import AcceptanceModel

PROFILES = REPO_ROOT / "profiles"


@dataclass(frozen=True)
class SetFiles:
    prefix: str  # the cost profiles: profiles/<prefix>-*.json
    recording: Path  # the default method's trees, verified by the target
    beams: Path  # AdaServe's candidates: unpruned beams of depth 8 and width 4

    def profiles(self) -> list[Path]:
        return sorted(PROFILES.glob(f"{self.prefix}-*.json"))


SET_FILES = {
    SMOLLM2: SetFiles(
        "SmolLM2-135M-Instruct",
        PROFILES / "acceptance-SmolLM2-135M-Instruct.json.gz",
        PROFILES / "acceptance-SmolLM2-135M-Instruct-beam.json.gz",
    ),
    # the 0.5B over the 1.5B: chat, code and math trees; beams on the same 3 chat prompts
    "qwen2.5-coder": SetFiles(
        "Qwen2.5-Coder-1.5B",
        PROFILES / "acceptance-Qwen2.5-Coder-1.5B-Instruct.json.gz",
        PROFILES / "acceptance-Qwen2.5-Coder-1.5B-Instruct-beam.json.gz",
    ),
}


@functools.cache
def load_recording(path: Path) -> AcceptanceModel:
    """A recording, read once per process."""
    return AcceptanceModel.load(path)


def default_draft(model_set: str) -> str:
    """SmolLM2's default draft; another set's, the draft its recording was made with."""
    from shared.engine.presets import DEFAULT_DRAFT

    if model_set == SMOLLM2:
        return DEFAULT_DRAFT
    return load_recording(SET_FILES[model_set].recording).drafts[0]
