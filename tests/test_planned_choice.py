"""The planner's choice of draft model (`scheduler.draft_chooser = planned`): each request drafts
with the model whose plan promises the most tokens per millisecond, by its own acceptance on
each; a request switching back resumes the drafter it left (parked), appending only the tokens
it missed, and every parked state is released when the request finishes."""

from __future__ import annotations

from collections.abc import Mapping

from shared.scheduling.core import CoreConfig, SchedulerCore
from shared.scheduling.core_types import DraftPlan
from shared.scheduling.draft_choice import PlannedChoice
from shared.scheduling.request import RequestState
from shared.values.methods import DraftMethod
from shared.values.tree import TokenTree
from tests.test_scheduler_core import (
    VOCAB,
    FakeDrafters,
    FakeKV,
    check_releases,
    executor,
    greedy,
    make_request,
)
from tests.test_speculation import two_draft_cost

CHAIN = DraftMethod("chain", k=4)


class PerModelDrafters(FakeDrafters):
    """Trees whose tokens agree with the target with a probability per (model, request)."""

    def __init__(self, base: FakeDrafters, agree: Mapping[tuple[str, str], float]) -> None:
        super().__init__(0.0, base.rng)
        self.by_model = dict(agree)
        self._model = ""

    def p_agree(self, request_id: str) -> float:
        return self.by_model[(self._model, request_id)]

    def _tree(self, plan: DraftPlan, request: RequestState) -> TokenTree:
        self._model = plan.model
        return super()._tree(plan, request)


def planned_run(
    agree: Mapping[tuple[str, str], float], max_tokens: int = 400, switch_margin: float = 0.0
):
    core = SchedulerCore(
        CoreConfig(
            vocab_size=VOCAB,
            max_context=8192,
            method=CHAIN,
            token_budget=64,
            switch_margin=switch_margin,
        ),
        chooser=PlannedChoice(["d", "e"]),
        cost=two_draft_cost(),  # "d" costs half of "e"
    )
    core.set_drafters({"d": ["d0"], "e": ["e0"]})
    ex = executor(core, FakeKV())
    ex.drafters = PerModelDrafters(ex.drafters, agree)
    rids = sorted({rid for _, rid in agree})
    for rid in rids:
        core.add(make_request(rid, 6, max_tokens=max_tokens))
    return core, ex, rids


def models_by_step(ex, rid: str) -> list[str]:
    return [plans[rid].model for plans in ex.plans if rid in plans]


def test_each_request_ends_on_the_draft_that_agrees_with_it() -> None:
    agree = {
        ("d", "d-only"): 1.0, ("e", "d-only"): 0.0,
        ("d", "e-only"): 0.0, ("e", "e-only"): 1.0,
    }  # fmt: skip
    core, ex, rids = planned_run(agree)
    ex.run()
    for rid in rids:
        assert ex.streamed[rid] == greedy(make_request(rid, 6).prompt, 400)
    for rid, model in (("d-only", "d"), ("e-only", "e")):
        steps = models_by_step(ex, rid)
        assert set(steps[-50:]) == {model}, steps
        assert steps.count(model) >= len(steps) - 10, steps
    check_releases(ex, rids)


def test_equal_drafts_the_cheaper_one() -> None:
    core, ex, rids = planned_run({("d", "r"): 1.0, ("e", "r"): 1.0})
    ex.run()
    assert set(models_by_step(ex, "r")) == {"d"}  # "d" drafts at half of "e"'s cost
    check_releases(ex, rids)


def test_a_draft_whose_first_step_missed_is_tried_again() -> None:
    """The cheaper "d" misses on its first step only, "e" agrees 70% of the time: "d" is tried
    again and kept (its first miss once ruled it out for the rest of the run)."""
    core, ex, rids = planned_run({("d", "r"): 0.0, ("e", "r"): 0.7}, max_tokens=300)
    drafters = ex.drafters
    while "d" not in models_by_step(ex, "r"):
        ex.step()
    drafters.by_model[("d", "r")] = 1.0
    ex.run()
    steps = models_by_step(ex, "r")
    assert steps[-20:] == ["d"] * 20, steps
    check_releases(ex, rids)


def switches(steps: list[str]) -> int:
    return sum(a != b for a, b in zip(steps, steps[1:], strict=False))


def test_a_switch_margin_keeps_a_near_tie_from_flipping() -> None:
    """Two drafts whose goodput is about level for the request: with no margin the choice
    follows each step's noise in the estimates; a margin keeps the current draft through it,
    and the output is the target's either way."""
    agree = {("d", "r"): 0.55, ("e", "r"): 0.65}
    counts = {}
    for margin in (0.0, 0.3):
        core, ex, rids = planned_run(agree, max_tokens=300, switch_margin=margin)
        ex.run()
        assert ex.streamed["r"] == greedy(make_request("r", 6).prompt, 300)
        counts[margin] = switches(models_by_step(ex, "r"))
        check_releases(ex, rids)
    assert counts[0.0] >= 4, counts
    assert counts[0.3] < counts[0.0] / 2, counts


def test_a_switch_back_resumes_the_parked_drafter() -> None:
    """A request leaves "d" when it stops agreeing and returns when "e" does too: the return
    appends only what "d" missed (the fake drafter checks its state against the plan), and
    both drafters' states are released once, at the end."""
    agree = {("d", "r"): 1.0, ("e", "r"): 1.0}
    core, ex, rids = planned_run(agree, max_tokens=300)
    drafters = ex.drafters
    for _ in range(15):
        ex.step()
    drafters.by_model[("d", "r")] = 0.0  # "d" goes wrong: the planner tries "e"
    for _ in range(40):
        ex.step()
    assert models_by_step(ex, "r")[-10:] == ["e"] * 10
    drafters.by_model[("e", "r")] = 0.0
    drafters.by_model[("d", "r")] = 1.0  # and back
    ex.run()
    steps = models_by_step(ex, "r")
    assert steps[-10:] == ["d"] * 10, steps
    plans = [plans["r"] for plans in ex.plans if "r" in plans]
    back = next(
        i for i in range(len(plans) - 1, 0, -1) if plans[i].model == "d" != plans[i - 1].model
    )
    resumed = plans[back]
    left = max(i for i in range(back) if plans[i].model == "d")  # its last step before
    assert resumed.base_len == plans[left].base_len + len(plans[left].new_tokens) > 0
    assert core.switches["warm"] >= 1
    check_releases(ex, rids)
