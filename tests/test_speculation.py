"""The goodput planner and selector with synthetic cost models: speculation where it pays, plain
decoding where it does not, and learning from what the target accepted."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.scheduling.core import CoreConfig, SchedulerCore
from shared.scheduling.cost_model import (
    CostModel,
    CostProfile,
    ForwardCurve,
    ModelProfile,
    ProfileKey,
)
from shared.scheduling.speculation import (
    FIRST_PROBE_INTERVAL,
    MAX_PROBE_INTERVAL,
    PRIOR_RATE,
    RECENT_ESTIMATE_DECAY,
    AcceptanceEstimate,
    CopyEstimate,
    CopyRuns,
    DepthQuery,
    plan_depths,
    select_by_goodput,
)
from shared.values.methods import DraftMethod
from shared.values.tree import TokenTree
from tests.test_scheduler_core import VOCAB, FakeKV, cost_model, executor, make_request

CHAIN = DraftMethod("chain", k=4)
# GPU-like: a forward of 64 tokens costs 63% more than one of 1 (0.1 ms a token on 10 ms)
FLAT = [(1, 10.0), (64, 16.3)]
# every token costs as much as the first: verification never pays
STEEP = [(1, 10.0), (64, 640.0)]
# CPU-like: 5 tokens cost 1.7x one token
CPU = [(1, 10.0), (5, 17.0), (64, 120.25)]
CHEAP_DRAFT = [(1, 0.5), (64, 0.6)]


def query(rid: str, rate: float, method: DraftMethod = CHAIN, max_depth: int = 4) -> DepthQuery:
    return DepthQuery(rid, "d", method, max_depth, rate, new_tokens=1)


def plan(queries, curve, *, budget: int = 512, prefill: int = 0) -> dict[str, int]:
    cost = cost_model(curve, CHEAP_DRAFT)
    return plan_depths(queries, cost, prefill_tokens=prefill, budget=budget, context=100)


def test_a_drafters_backlog_is_spread_over_the_steps_the_request_has_left() -> None:
    steady = DepthQuery("r", "d", CHAIN, 4, 0.5, new_tokens=5, tokens_left=100)
    assert steady.root_tokens() == 5  # at most one step's commit: charged in full
    behind = DepthQuery("r", "d", CHAIN, 4, 0.5, new_tokens=400, tokens_left=100)
    per_step = 1 + 0.5 + 0.25 + 0.125 + 0.0625  # committed tokens a step expects
    assert behind.root_tokens() == pytest.approx(5 + 395 / (100 / per_step))
    long = DepthQuery("r", "d", CHAIN, 4, 0.5, new_tokens=400, tokens_left=4000)
    assert long.root_tokens() == pytest.approx(5 + 395 / (128 / per_step))  # length unknown
    ending = DepthQuery("r", "d", CHAIN, 4, 0.5, new_tokens=400, tokens_left=1)
    assert ending.root_tokens() == 400  # no later step to share it
    assert DepthQuery("r", "d", CHAIN, 4, 0.5, new_tokens=400).root_tokens() == 400


def test_a_request_that_sat_out_drafts_again_once_its_backlog_pays_over_its_life() -> None:
    # a draft forward over a prompt-sized backlog costs three target steps here; charged to one
    # step it never pays, and every plain step would add to it
    cost = cost_model(CPU, [(1, 0.5), (8, 0.8), (512, 30.0)])
    step = {"prefill_tokens": 0, "budget": 512, "context": 100}
    behind = DepthQuery("r", "d", CHAIN, 4, 0.8, new_tokens=400, tokens_left=100)
    assert plan_depths([behind], cost, **step) == {"r": 4}
    unknown = DepthQuery("r", "d", CHAIN, 4, 0.8, new_tokens=400)
    assert plan_depths([unknown], cost, **step) == {"r": 0}


def test_cost_curves_are_what_they_claim() -> None:
    cpu = cost_model(CPU)
    assert cpu.verify_ms(5, 0) == pytest.approx(1.7 * cpu.verify_ms(1, 0))
    steep = cost_model(STEEP)
    assert all(steep.verify_ms(n, 0) == pytest.approx(n * 10.0) for n in (1, 2, 7, 64))
    flat = cost_model(FLAT)
    assert flat.verify_ms(32, 0) < 1.35 * flat.verify_ms(1, 0)


def test_flat_curve_and_high_acceptance_draft_the_full_depth() -> None:
    depths = plan([query(f"r{i}", 0.9) for i in range(4)], FLAT)
    assert depths == {f"r{i}": 4 for i in range(4)}
    # limited by the request (tokens left) and by the method's layers
    depths = plan([query("short", 0.9, max_depth=2), query("tree", 0.9, DraftMethod("beam"))], FLAT)
    assert depths == {"short": 2, "tree": 4}


def test_steep_curve_means_plain_decoding_for_everyone() -> None:
    queries = [query(f"r{i}", rate) for i, rate in enumerate([0.2, 0.6, 0.9, 0.99])]
    assert plan(queries, STEEP) == {f"r{i}": 0 for i in range(4)}
    many = [query(f"m{i}", 0.95) for i in range(12)]
    assert set(plan(many, STEEP).values()) == {0}


def test_a_prompt_chunk_in_the_step_does_not_make_drafts_look_cheap() -> None:
    """Prompt chunks are paid for whatever is speculated: with a steep curve a step that also
    prefills still decodes plainly, and with a flat one it still drafts the full depth."""
    queries = [query(f"r{i}", 0.9) for i in range(3)]
    for prefill in (0, 5, 40):
        assert set(plan(queries, STEEP, prefill=prefill).values()) == {0}
        assert set(plan(queries, FLAT, prefill=prefill).values()) == {4}


def test_cpu_curve_drafts_deeper_for_the_better_draft() -> None:
    depths = plan([query("good", 0.9), query("bad", 0.2)], CPU)
    assert depths["good"] > depths["bad"]
    assert depths["good"] >= 2 and depths["bad"] == 0


def test_a_model_beside_a_copying_partner_drafts_only_what_the_copy_leaves() -> None:
    """A model-free partner merged with the model's tree: the model's level d adds only where
    the partner's path does not reach d; inside a copy the model sits out, outside it drafts."""
    alone = query("r", 0.8)
    copying = replace(alone, partner_rate=0.95, partner_depth=8)
    missing = replace(alone, partner_rate=0.1, partner_depth=8)
    assert alone.level_gains() == pytest.approx([0.8**d for d in range(1, 5)])
    raw = [0.8**d * (1 - 0.95**d) for d in range(1, 5)]  # rises with depth: pooled
    gains = copying.level_gains()
    assert gains == sorted(gains, reverse=True) and sum(gains) == pytest.approx(sum(raw))
    assert copying.partner_tokens() == pytest.approx(sum(0.95**d for d in range(1, 9)))
    # a draft forward costs a third of the target's (the 0.5B beside the 1.5B)
    cost = cost_model(CPU, [(1, 3.3), (64, 6.0)])
    step = {"prefill_tokens": 0, "budget": 512, "context": 100}
    assert plan_depths([alone], cost, **step)["r"] >= 2
    assert plan_depths([missing], cost, **step)["r"] >= 2
    assert plan_depths([copying], cost, **step)["r"] == 0
    # past the partner's depth the model's levels count in full
    shallow = replace(copying, partner_depth=1)
    expected = 0.8 * 0.05 + sum(0.8**d for d in range(2, 5))
    assert sum(shallow.level_gains()) == pytest.approx(expected)


def test_by_runs_a_copy_the_target_left_does_not_keep_the_model_quiet() -> None:
    """Open text where the copy now and then finds a short run (a phrase of the question):
    three tokens accepted, then the target leaves it, and the next matches are junk. Planned by
    the copy's reach as a run after such stops (`model_beside_copy = "runs"`), the model drafts
    on the step after the short copy; by the copy's last few steps (the default) that step reads
    as a copy in progress and the model sits out. Inside a copy that runs through its tree, the
    model sits out by either."""
    # the bf16 1.5B on a CPU whose four-row products cost about what one row's do, and the
    # 0.5B-32k's forward at a fifth of its one-token forward
    cost = cost_model([(1, 10.0), (4, 10.8), (16, 20.0), (64, 60.0)], [(1, 1.9), (64, 4.0)])
    step = {"prefill_tokens": 0, "budget": 512, "context": 100}
    alone = query("r", 0.8)

    def planned_after(trials: list[tuple[int, int]]) -> tuple[int, int, float]:
        runs, recent = CopyRuns(), AcceptanceEstimate()
        for trial in trials:
            runs.observe(*trial)
            recent.observe(*trial, decay=RECENT_ESTIMATE_DECAY)
        first, deeper = runs.current().rates()
        by_runs = replace(alone, partner_rate=deeper, partner_first=first, partner_depth=16)
        by_recent = replace(alone, partner_rate=recent.rate(weight=1.0), partner_depth=16)
        depth = plan_depths([by_runs], cost, **step)["r"]
        return depth, plan_depths([by_recent], cost, **step)["r"], by_runs.partner_tokens()

    short_copies = ([(0, 1)] * 5 + [(3, 4)]) * 3
    planned, recent, expected = planned_after(short_copies)
    assert planned >= 2 and recent == 0
    assert expected < 1.0  # half a token a step is what the copy delivered after a stop
    assert plan_depths([alone], cost, **step)["r"] == planned
    planned, recent, expected = planned_after([(16, 16)] * 8)
    assert planned == 0 and recent == 0 and expected > 8


def test_a_copy_estimate_reads_a_run_as_one_trial_and_its_continuation() -> None:
    estimate = CopyEstimate()
    estimate.observe(3, 4)  # three accepted, the fourth rejected
    estimate.observe(0, 1)  # rejected at once
    estimate.observe(5, 5)  # accepted to the end of its tree
    # first: 1, 0, 1 of one trial each, decayed by 0.9 a step
    first = (estimate.first.successes, estimate.first.trials)
    assert first == pytest.approx((0.81 + 1, 0.81 + 0.9 + 1))
    # deeper: 2 of 3 (the first step), then 4 of 4; the junk step adds nothing there
    deeper = (estimate.deeper.successes, estimate.deeper.trials)
    assert deeper == pytest.approx((0.9 * 2 + 4, 0.9 * 3 + 4))
    runs = CopyRuns()
    runs.observe(5, 5)
    assert runs.running and runs.after_stopped.first.trials == 1
    runs.observe(2, 3)
    assert not runs.running and runs.after_running.first.trials == 1


@settings(max_examples=150, deadline=None)
@given(
    rates=st.lists(st.floats(0.0, 1.0), min_size=1, max_size=12),
    budget=st.integers(1, 80),
    prefill=st.integers(0, 40),
    method=st.sampled_from(
        [
            CHAIN,
            DraftMethod("static", expansion=(3, 2, 1)),
            DraftMethod("beam", depth=3, width=3),
            DraftMethod("dynamic", max_size=8, budget=8, max_depth=5, max_width=3),
        ]
    ),
    curve=st.sampled_from([FLAT, CPU, STEEP]),
)
def test_the_plan_never_exceeds_the_budget(rates, budget, prefill, method, curve) -> None:
    queries = [query(f"r{i}", r, method, max_depth=5) for i, r in enumerate(rates)]
    depths = plan(queries, curve, budget=budget, prefill=prefill)
    assert set(depths) == {q.request_id for q in queries}
    nodes = len(queries) + prefill
    for q in queries:
        d = depths[q.request_id]
        assert 0 <= d <= min(q.max_depth, method.num_layers)
        nodes += d  # the budget binds the verifier: about a node per level is planned for it
        if q.rate == 0:
            assert d == 0
    if any(depths.values()):
        assert nodes <= budget


def chain(rid_prob: float, depth: int = 4) -> TokenTree:
    return TokenTree.chain(1, list(range(2, 2 + depth)), [math.log(rid_prob)] * depth)


def select(trees, curve, calibration=None, budget=512) -> int:
    return select_by_goodput(
        trees,
        {rid: 8 for rid in trees},
        calibration or {},
        cost_model(curve),
        prefill_tokens=0,
        budget=budget,
        context=100,
    )


def test_select_by_goodput_keeps_what_pays() -> None:
    unlikely = {"a": chain(1e-3), "b": chain(1e-3)}
    certain = {"a": chain(0.99), "b": chain(0.99)}
    assert select(unlikely, FLAT) == 0
    assert select(certain, FLAT) == 8
    assert select(certain, STEEP) == 0
    assert select(certain, FLAT, budget=5) == 3  # two roots, then the budget
    # calibration: a request whose draft was over-confident is trusted less
    assert select({"a": chain(0.5)}, CPU) > select({"a": chain(0.5)}, CPU, {"a": 0.25})


def test_acceptance_estimate_moves_toward_observed_rates() -> None:
    est = AcceptanceEstimate()
    assert est.rate() == PRIOR_RATE
    rates = []
    for _ in range(30):
        est.observe(4, 4)  # everything accepted
        rates.append(est.rate())
    assert rates == sorted(rates) and rates[-1] > 0.9
    for _ in range(60):
        est.observe(0, 4)  # nothing accepted
    assert est.rate() < 0.2
    mixed = AcceptanceEstimate()
    for _ in range(60):
        mixed.observe(3, 4)  # three levels accepted, the fourth refused: 3 of 4 trials
    assert mixed.rate() == pytest.approx(0.75, abs=0.03)
    assert AcceptanceEstimate().rate(prior=0.8) == 0.8  # the prior stands in before anything


# ---- through the core ----------------------------------------------------------------------------
def run_core(agree: dict[str, float], curve, steps: int, max_tokens: int = 2000):
    core = SchedulerCore(
        CoreConfig(vocab_size=VOCAB, max_context=8192, method=CHAIN, token_budget=64),
        cost=cost_model(curve, CHEAP_DRAFT),
    )
    ex = executor(core, FakeKV())
    ex.drafters.agree = agree
    for rid in agree:
        core.add(make_request(rid, 4, max_tokens=max_tokens))
    for _ in range(steps):
        assert ex.step()
    depth = {
        rid: [plans[rid].max_depth if rid in plans else 0 for plans in ex.plans] for rid in agree
    }
    return core, ex, depth


def test_a_draft_that_is_always_wrong_stops_but_probes_at_doubling_intervals() -> None:
    core, ex, depth = run_core({"wrong": 0.0}, CPU, steps=160)
    wrong = depth["wrong"][1:]  # the first step prefills
    assert wrong[0] > 0  # the prior says try
    stopped = wrong.index(0)
    assert stopped <= 5, wrong[:10]
    probes = [i for i in range(stopped, len(wrong)) if wrong[i] > 0]
    assert all(wrong[i] == 1 for i in probes)  # a probe is one level
    gaps = np.diff([stopped - 1, *probes]).tolist()
    expected = [FIRST_PROBE_INTERVAL]
    while len(expected) < len(gaps):
        expected.append(min(2 * expected[-1], MAX_PROBE_INTERVAL))
    assert gaps == expected, wrong
    assert len(probes) >= 4
    # every probe was verified: it is what keeps the estimate honest
    request = core.requests["wrong"]
    assert request.stats.num_draft_tokens == sum(wrong)
    assert len(request.output) == 160  # one token a step: nothing accepted, the bonus each time


def test_no_probe_where_even_a_good_draft_would_not_pay() -> None:
    """On a curve where every verified token costs a whole forward, a probe could only cost:
    a wrong draft stops and is never probed again."""
    _, _, depth = run_core({"wrong": 0.0}, STEEP, steps=120)
    wrong = depth["wrong"][1:]
    assert set(wrong) == {0}, wrong


def test_a_draft_that_is_always_right_keeps_the_full_depth() -> None:
    _, ex, depth = run_core({"right": 1.0}, CPU, steps=40)
    right = depth["right"][1:]  # the first step prefills
    warm = right.index(4)
    assert warm <= 4 and right[:warm] == sorted(right[:warm])  # up from the prior
    assert right[warm:] == [4] * (len(right) - warm)


def test_right_and_wrong_drafts_in_one_batch() -> None:
    core, ex, depth = run_core({"right": 1.0, "wrong": 0.0}, CPU, steps=80)
    assert depth["right"][10:] == [4] * 70
    late = depth["wrong"][40:]
    assert sum(d > 0 for d in late) <= 3 and max(late) <= 1  # only probes
    right, wrong = core.requests["right"], core.requests["wrong"]
    assert right.stats.acceptance_rate == 1.0 and wrong.stats.num_accepted == 0
    assert len(right.output) > 3 * len(wrong.output)


GPU_LIKE = ([(1, 10.0), (8, 10.5), (64, 14.0)], [(1, 10.0), (8, 10.2), (64, 12.0)])
CPU_LIKE = ([(1, 10.0), (8, 30.0), (64, 200.0)], [(1, 10.0), (8, 12.0), (64, 90.0)])


def two_draft_cost(target: tuple[list, list] = CPU_LIKE) -> CostModel:
    """Curves that depend on the request count (a one-request curve beside the spread one) and
    two draft models, so every term of a step's price matters."""
    key = ProfileKey(model="t", fingerprint="f", device="cpu: fake", dtype="float32", threads=1)

    def curve(points: list[tuple[int, float]]) -> ForwardCurve:
        return ForwardCurve(
            tokens=[n for n, _ in points], contexts=[0], ms_grid=[[m] for _, m in points]
        )

    def model(name: str, spread: list[tuple[int, float]], single: list[tuple[int, float]]):
        mk = key.model_copy(update={"model": name})
        return ModelProfile(key=mk, curve=curve(spread), single=curve(single), max_requests=8)

    return CostModel(
        CostProfile(
            target=model("t", *target),
            drafts={
                "d": model("d", [(1, 0.5), (8, 2.5), (64, 12.0)], [(1, 0.5), (8, 0.7), (64, 3.0)]),
                "e": model("e", [(1, 1.0), (8, 5.0), (64, 25.0)], [(1, 1.0), (8, 1.4), (64, 6.0)]),
            },
        )
    )


def reference_goodput(queries, depths, cost, *, prefill, context, num_requests) -> float:
    """Expected tokens per ms of a plan, priced term by term with `draft_tree_ms`."""
    tokens = len(queries) + sum(
        q.rate**d for q in queries for d in range(1, depths[q.request_id] + 1)
    )
    nodes = sum(depths.values()) + len(queries)
    ms = cost.verify_ms(max(nodes, 1), context, num_requests)
    for model in {q.draft_model for q in queries}:
        mine = [q for q in queries if q.draft_model == model and depths[q.request_id] > 0]
        if not mine:
            continue
        deepest = max(depths[q.request_id] for q in mine)
        layers = [
            sum(min(q.method.tokens_at_depth(d), q.method.max_draft_tokens)
                for q in mine if depths[q.request_id] >= d)
            for d in range(1, deepest + 1)
        ]  # fmt: skip
        root = sum(q.root_tokens() for q in mine)  # a backlog spread over the request's life
        ms += cost.draft_tree_ms(model, root, layers, context, len(mine))
    return tokens / ms


@settings(max_examples=60, deadline=None)
@given(
    rates=st.lists(st.floats(0.0, 0.99), min_size=1, max_size=12),
    models=st.lists(st.sampled_from(["d", "e"]), min_size=12, max_size=12),
    new_tokens=st.lists(st.integers(1, 400), min_size=12, max_size=12),
    tokens_left=st.lists(st.none() | st.integers(1, 300), min_size=12, max_size=12),
    num_requests=st.none() | st.integers(1, 20),
    method=st.sampled_from(
        [CHAIN, DraftMethod("dynamic", max_size=8, budget=8, max_depth=5, max_width=3)]
    ),
    target=st.sampled_from([GPU_LIKE, CPU_LIKE]),
)
def test_the_plan_is_the_best_prefix_of_the_greedy_order(
    rates, models, new_tokens, tokens_left, num_requests, method, target
) -> None:
    # the vectorized planner against a plain pricing of every prefix of the same order
    cost = two_draft_cost(target)
    queries = [
        DepthQuery(f"r{i}", models[i], method, 5, rate, new_tokens[i], tokens_left[i])
        for i, rate in enumerate(rates)
    ]
    step = {"prefill": 0, "context": 0, "num_requests": num_requests}
    planned = plan_depths(
        queries, cost, prefill_tokens=0, budget=512, context=0, num_requests=num_requests
    )
    order = sorted(
        (-(q.rate**d), i, d)
        for i, q in enumerate(queries)
        if q.rate > 0
        for d in range(1, min(q.max_depth, method.num_layers) + 1)
    )
    best = 0.0
    depths = {q.request_id: 0 for q in queries}
    for k in range(len(order) + 1):
        if k:
            depths[queries[order[k - 1][1]].request_id] += 1
        best = max(best, reference_goodput(queries, depths, cost, **step))
    assert reference_goodput(queries, planned, cost, **step) == pytest.approx(best, rel=1e-9)
