"""The cost model calibrated by measured steps: a scale per model that follows measured over
modeled time, drafting priced as the planner prices it, the planner drafting less where a draft
costs more than its profile says, and the engine calibrating from its own drafter calls and
verifications (and not where configured off)."""

from __future__ import annotations

import pytest

from shared.engine.spec_engine import SpecEngine
from shared.engine.verifier import Verifier
from shared.scheduling.config import SchedulerConfig
from shared.scheduling.cost_calibration import DraftTiming, note_drafting
from shared.scheduling.cost_model import SCALE_RATIO_CLIP, TARGET_ROLE
from shared.scheduling.speculation import plan_depths
from shared.values.methods import DraftMethod
from shared.values.sampling import SamplingParams
from shared.values.tree import TokenTree
from tests.test_model_free_engine import model_draft, runner
from tests.test_scheduler_core import cost_model
from tests.test_speculation import query

CPU = [(1, 10.0), (4, 10.8), (16, 20.0), (64, 60.0)]  # a flat start: four rows cost one row's
DRAFT = [(1, 1.9), (64, 4.0)]


def chain(length: int) -> TokenTree:
    return TokenTree.build(list(range(length + 1)), list(range(-1, length)), [0.0] * (length + 1))


def test_a_scale_follows_measured_over_modeled_time() -> None:
    cost = cost_model(CPU, DRAFT)
    modeled = cost.draft_forward_ms("d", 1, 0)
    for _ in range(60):
        cost.calibrate("d", cost.draft_forward_ms("d", 1, 0), 1.5 * modeled)
    assert cost.scales["d"] == pytest.approx(1.5, rel=1e-2)
    assert cost.draft_forward_ms("d", 1, 0) == pytest.approx(1.5 * modeled, rel=1e-2)
    assert cost.verify_ms(1, 0) == 10.0  # the target is not touched
    # one measurement far off (a step that waited on something else) moves it by a bounded step
    cost.calibrate(TARGET_ROLE, 10.0, 1000.0)
    assert cost.scales[TARGET_ROLE] == pytest.approx(0.9 + 0.1 * SCALE_RATIO_CLIP[1])
    assert cost.fresh().scales == {} and cost.fresh().verify_ms(1, 0) == 10.0


def test_drafting_is_modeled_as_the_planner_prices_it() -> None:
    """Two requests' chains of depth 3 after 4 and 1 appended tokens: the root chain forward of
    5 tokens and two layer forwards of 2 (the deepest layer needs none)."""
    cost = cost_model(CPU, DRAFT)
    modeled = cost.draft_tree_ms("d", 5, [2, 2, 2], 100, 2)
    expected = sum(cost.draft_forward_ms("d", n, 100, 2) for n in (5, 2, 2))
    assert modeled == pytest.approx(expected)
    timing = DraftTiming("d", ((4, chain(3)), (1, chain(3))), measured_ms=2 * modeled)
    note_drafting(cost, timing, context=100)
    assert cost.scales["d"] == pytest.approx(0.9 + 0.1 * 2)
    note_drafting(cost, DraftTiming("ngram", ((4, chain(8)),), 5.0), context=100)
    assert "ngram" not in cost.scales  # a model-free draft has no profile: it stays free


def test_a_draft_that_costs_more_than_its_profile_is_drafted_less() -> None:
    step = {"prefill_tokens": 0, "budget": 512, "context": 100}
    cost = cost_model(CPU, DRAFT)
    good = query("r", 0.75)
    as_profiled = plan_depths([good], cost, **step)["r"]
    for _ in range(40):  # its drafter calls take three times the profile's forwards
        cost.calibrate("d", cost.draft_forward_ms("d", 1, 100), 3 * 1.9)
    assert as_profiled >= 2 and plan_depths([good], cost, **step)["r"] < as_profiled


@pytest.mark.parametrize("calibrate", [True, False])
def test_the_engine_calibrates_from_its_own_steps(
    tiny_target_dir, tiny_draft_dir, calibrate: bool
) -> None:
    # a profile ten times the synthetic one: the tiny models' forwards stay far below it even
    # on a machine loaded by the other test worker (at 1.9 ms a drafter call could exceed it)
    cost = cost_model([(n, 10 * ms) for n, ms in CPU], [(n, 10 * ms) for n, ms in DRAFT])
    engine = SpecEngine(
        Verifier(runner(tiny_target_dir)),
        {"d": model_draft(tiny_draft_dir, name="d")},
        DraftMethod("chain", k=4),
        SchedulerConfig(calibrate_costs=calibrate, planner="fixed"),
        cost=cost,
    )
    engine.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=24))
    if not calibrate:
        assert cost.scales == {}
        return
    # the tiny models' forwards take well under the profile's 100 ms and 19 ms
    assert set(cost.scales) == {TARGET_ROLE, "d"}
    assert all(scale < 1.0 for scale in cost.scales.values())


def test_the_scheduler_service_times_each_replica_by_what_it_grew() -> None:
    from types import SimpleNamespace

    from services.scheduler.service import SchedulerService

    def job(rid: str, appended: int) -> SimpleNamespace:
        return SimpleNamespace(entry=SimpleNamespace(request_id=rid, new_tokens=(0,) * appended))

    def drafted(rid: str, tree: TokenTree | None) -> SimpleNamespace:
        return SimpleNamespace(request_id=rid, tree=tree)

    asked = [job("a", 4), job("b", 1), job("c", 2)]
    answer = SimpleNamespace(
        entries=[drafted("a", chain(3)), drafted("b", chain(2)), drafted("c", None)], draft_ms=7.5
    )
    [timing] = SchedulerService._timing("d", asked, answer)  # type: ignore[arg-type]
    assert timing.model == "d" and timing.measured_ms == 7.5
    assert [(n, t.num_nodes) for n, t in timing.drafted] == [(4, 4), (1, 3)]
    unmeasured = SimpleNamespace(entries=answer.entries, draft_ms=0.0)
    assert SchedulerService._timing("d", asked, unmeasured) == []  # type: ignore[arg-type]


def test_a_rebuilt_cost_model_keeps_the_scales_of_unchanged_profiles() -> None:
    from services.scheduler.drafters import kept_scales

    was = {"target": "t1", "draft:a": "a1", "draft:b": "b1"}
    now = {"target": "t1", "draft:a": "a2", "draft:b": "b1", "draft:c": "c1"}
    scales = {TARGET_ROLE: 0.8, "a": 1.5, "b": 1.2}
    # a's profile was republished: its measured steps no longer speak for it
    assert kept_scales(scales, was, now) == {TARGET_ROLE: 0.8, "b": 1.2}
    assert kept_scales(scales, {}, now) == {}
