"""One scheduling configuration for every executor: the engine, the scheduler service and the
simulator each pass a `SchedulerConfig` (`factory.make_core` turns it into the core's
`CoreConfig`, with what the executor knows of its target). Its names are the settings' own
(`scheduler.*`, and `engine.max_tokens_per_step`); `from_settings` reads them."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from shared.scheduling.core import (
    MergePolicy,
    MicroBatchSplit,
    ModelBesideCopy,
    SpeculationPlanner,
)
from shared.settings import (
    AugurySettings,
    LapsSettings,
    LbssSettings,
    SloSettings,
    draft_chooser,
)


class SchedulerConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    max_tokens_per_step: int = Field(512, ge=1)  # B: prompt chunks and trees of one forward
    max_running_requests: int = Field(64, ge=1)
    # M micro-batches in flight; "auto": from the cost profile, 2 up to `max_micro_batches`
    micro_batches: Annotated[int, Field(ge=1)] | Literal["auto"] = 1
    max_micro_batches: int = Field(8, ge=1)
    micro_batch_drop: float = Field(0.1, ge=0, lt=1)
    micro_batch_split: MicroBatchSplit = "policy"
    policy: str = "fcfs"
    length_predictor: str | None = None  # for lp-sjf and laps-sd; None: "learned"
    laps: LapsSettings = LapsSettings()
    draft_chooser: str = "fixed"  # fixed, lbss, greedy-length, eps-greedy, counterfactual, planned
    lbss: LbssSettings = LbssSettings()
    fast_switching: bool = False  # keep a standby draft's KV in step (Spin's fast switching)
    # the standby (or, "model-free", a model-free draft) also drafts a tree, merged (SpecInfer);
    # "auto": "model-free" where there is a model-free draft beside a model draft, else off
    merge_drafts: MergePolicy | Literal["auto"] = "auto"
    model_beside_copy: ModelBesideCopy = "planned"  # with model-free merges (settings)
    replica_matcher: str = "least-loaded"
    tree_selection: str = "goodput"
    planner: SpeculationPlanner = "goodput"
    calibrate_costs: bool = False  # measured step parts scale the cost model (settings)
    switch_margin: float = Field(0.0, ge=0)  # the planned choice's margin to switch (settings)
    slo: SloSettings = SloSettings()  # SLO classes (request intake) and the SLO-aware selectors

    @property
    def most_micro_batches(self) -> int:
        """M, or with "auto" the most micro-batches in flight."""
        return self.max_micro_batches if self.micro_batches == "auto" else self.micro_batches

    @classmethod
    def from_settings(cls, settings: AugurySettings) -> SchedulerConfig:
        s = settings.scheduler
        return cls(
            max_tokens_per_step=settings.engine.max_tokens_per_step,
            max_running_requests=s.max_running_requests,
            micro_batches=s.micro_batches,
            max_micro_batches=s.max_micro_batches,
            micro_batch_drop=s.micro_batch_drop,
            micro_batch_split=s.micro_batch_split,
            policy=s.policy,
            length_predictor=s.length_predictor,
            laps=s.laps,
            draft_chooser=draft_chooser(settings),
            lbss=s.lbss,
            fast_switching=s.fast_switching,
            merge_drafts=s.merge_drafts,
            model_beside_copy=s.model_beside_copy,
            replica_matcher=s.replica_matcher,
            tree_selection=s.tree_selection,
            planner=s.speculation.planner,
            calibrate_costs=s.speculation.calibrate_costs,
            switch_margin=s.speculation.switch_margin,
            slo=s.slo,
        )
