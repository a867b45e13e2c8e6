"""Which draft model speculates for a request, with feedback from what each step achieved.

The chooser sees the request (its per-model acceptance statistics), the live draft models and the
cost model, and learns from `observe` after every verified step. Fixed (the first preferred
live model) is the baseline; Spin's LBSS bandit implements the same interface.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from shared.scheduling.cost_model import CostModel
from shared.scheduling.request import RequestState


@dataclass(frozen=True)
class DraftOutcome:
    """What one verified step of a request achieved with a draft model."""

    request_id: str
    draft_model: str
    num_draft_tokens: int
    num_accepted: int
    step_ms: float  # the step's wall time as the executor saw it


class DraftChooser(Protocol):
    name: str

    def choose(
        self, request: RequestState, live_models: Sequence[str], cost: CostModel | None
    ) -> str | None:
        """A live draft model for the request; None when there is none."""
        ...

    def observe(self, outcome: DraftOutcome) -> None:
        """Feedback after a verified step that used a draft."""
        ...

    def forget(self, request_id: str) -> None:
        """The request finished."""
        ...


class FixedDraftModel:
    """The first of the preferred models that is alive (configured order), else any live one."""

    name = "fixed"

    def __init__(self, preferred: Sequence[str] = ()) -> None:
        self.preferred = list(preferred)

    def choose(
        self, request: RequestState, live_models: Sequence[str], cost: CostModel | None
    ) -> str | None:
        for model in self.preferred:
            if model in live_models:
                return model
        return min(live_models) if live_models else None

    def observe(self, outcome: DraftOutcome) -> None:
        pass

    def forget(self, request_id: str) -> None:
        pass


CHOOSERS = {"fixed": FixedDraftModel}


def make_chooser(name: str, preferred: Sequence[str]) -> DraftChooser:
    try:
        return CHOOSERS[name](preferred)
    except KeyError:
        raise ValueError(f"unknown draft chooser {name!r}; known: {sorted(CHOOSERS)}") from None
