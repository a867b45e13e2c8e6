"""The cost model calibrated by what a step's forwards took (`CostModel.calibrate`).

The executor measures each drafter call and the verification; here each measurement is set
against the profile's figure for the same work, priced as the planner prices it: a drafter's
root chain forward and one forward per tree layer but the deepest (`CostModel.draft_tree_ms`),
the verifier's one forward of every tree node of the micro-batch. Only the work the planner
prices every step is measured: not a verification with prompt chunks in it, nor a drafter call
that appended more tokens than its profile measured (a drafter new to a request forwards the
whole prompt): past the profile's grid its figures are extrapolated, and a prefill's ratio
says little about a decoding step's.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from shared.scheduling.core_types import MicroBatch, mean_context
from shared.scheduling.cost_model import TARGET_ROLE, CostModel
from shared.values.tree import TokenTree


@dataclass(frozen=True)
class DraftTiming:
    """One drafter call as measured: `model` appended each request's committed tokens and grew
    its tree."""

    model: str
    drafted: tuple[tuple[int, TokenTree], ...]  # (committed tokens appended, tree) per request
    measured_ms: float


def note_drafting(cost: CostModel, timing: DraftTiming, context: int) -> None:
    """Calibrate `timing.model`'s drafting (a draft without a profile is taken as free)."""
    if not timing.drafted or not cost.has_draft(timing.model):
        return
    layers: Counter[int] = Counter()
    for _, tree in timing.drafted:
        layers.update(int(d) for d in tree.depths()[1:])
    root_tokens = sum(appended for appended, _ in timing.drafted)
    if root_tokens > cost.draft_max_tokens(timing.model):
        return
    modeled = cost.draft_tree_ms(
        timing.model,
        root_tokens,
        [layers[d] for d in sorted(layers)],
        context,
        len(timing.drafted),
    )
    cost.calibrate(timing.model, modeled, timing.measured_ms)


def note_verification(cost: CostModel, batch: MicroBatch, measured_ms: float) -> None:
    """Calibrate the target by the micro-batch's verification forward (a decoding one)."""
    nodes = sum(tree.num_nodes for tree in batch.trees.values())
    if nodes == 0 or batch.prefill_tokens > 0 or nodes > cost.max_tokens:
        return
    modeled = cost.verify_ms(nodes, mean_context(batch.members), len(batch.members))
    cost.calibrate(TARGET_ROLE, modeled, measured_ms)


def note_step_costs(
    cost: CostModel,
    batch: MicroBatch,
    drafting: Sequence[DraftTiming],
    verify_ms: float | None,
) -> None:
    """Every measurement of one micro-batch's step (`verify_ms` None: not measured)."""
    context = mean_context(batch.decode)  # as the planner looks drafting up
    for timing in drafting:
        note_drafting(cost, timing, context)
    if verify_ms is not None:
        note_verification(cost, batch, verify_ms)
