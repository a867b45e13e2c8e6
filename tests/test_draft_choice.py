"""Draft-model choosers: Spin's LBSS (matching under capacities, epochs and chunks as Alg. 1-2,
an estimator that settles on the best model) and its baselines, greedy output unchanged under
every one of them, and fast switching (the next model's KV kept in step ahead of a switch)."""

from __future__ import annotations

import itertools
import random
from dataclasses import replace

import numpy as np
import pytest

from shared.engine.drafting import Drafter
from shared.engine.spec_engine import SpecEngine
from shared.engine.verifier import Verifier
from shared.model import load_model
from shared.model.runner import ModelRunner
from shared.scheduling.config import SchedulerConfig
from shared.scheduling.core import DraftPlan, draft_request
from shared.scheduling.draft_choice import (
    DraftOutcome,
    EpsilonGreedy,
    FixedDraftModel,
    GoodputTable,
    GreedyByLength,
    Oracle,
)
from shared.scheduling.factory import make_chooser
from shared.scheduling.lbss import Lbss, max_weight_assignment
from shared.scheduling.request import RequestState
from shared.settings import LbssSettings
from shared.values.methods import DraftMethod
from shared.values.sampling import SamplingParams
from tests.test_scheduler_core import (
    FakeKV,
    check_releases,
    executor,
    greedy,
    make_core,
    make_request,
)

MODELS = ["big", "mid", "small"]


def request(rid: str, prompt_len: int = 4, model: str | None = None) -> RequestState:
    r = RequestState(rid, list(range(1, prompt_len + 1)), SamplingParams(max_tokens=64), seed=0)
    r.draft_model = model
    return r


# ---- matching -------------------------------------------------------------------------------
def brute_force(weights: np.ndarray, capacities: list[int]) -> float:
    """The best total weight over every assignment (a request may go without a model)."""
    n, m = weights.shape
    best = 0.0
    for choice in itertools.product([None, *range(m)], repeat=n):
        if any(choice.count(j) > capacities[j] for j in range(m)):
            continue
        best = max(best, sum(weights[i, j] for i, j in enumerate(choice) if j is not None))
    return best


def test_matching_maximizes_weight_within_capacities_against_brute_force() -> None:
    rng = np.random.default_rng(7)
    for _ in range(60):
        n, m = int(rng.integers(1, 6)), int(rng.integers(1, 4))
        weights = rng.uniform(0, 1, size=(n, m))
        capacities = [int(c) for c in rng.integers(0, 4, size=m)]
        assigned = max_weight_assignment(weights, capacities)
        for j in range(m):
            assert assigned.count(j) <= capacities[j]
        total = sum(weights[i, j] for i, j in enumerate(assigned) if j is not None)
        assert total == pytest.approx(brute_force(weights, capacities))
        assert sum(j is not None for j in assigned) == min(n, sum(capacities))


def test_matching_gives_a_contested_model_to_whom_it_matters_most() -> None:
    # both prefer model 0 (capacity 1); request 1 loses more without it
    weights = np.array([[1.0, 0.9], [1.0, 0.2]])
    assert max_weight_assignment(weights, [1, 1]) == [1, 0]
    assert max_weight_assignment(weights, [0, 1]) in ([1, None], [None, 1])


# ---- LBSS's stages ----------------------------------------------------------------------------
def test_epochs_and_chunks_follow_alg_2() -> None:
    lbss = Lbss(settings=LbssSettings(alpha=4, beta=2), seed=1)
    requests = [request(f"r{i}") for i in range(6)]
    stages, draws = [], []
    for _ in range(4 + 2 + 4 + 4 + 4):
        stages.append("explore" if lbss.is_exploring else "exploit")
        draws.append(lbss.assign(requests, MODELS, None))
    # epoch 1: 4 exploration slots, 2^1 exploitation; epoch 2: 4 and 2^2; epoch 3 starts
    assert (
        stages
        == ["explore"] * 4 + ["exploit"] * 2 + ["explore"] * 4 + ["exploit"] * 4 + ["explore"] * 4
    )
    # a request keeps its random draw for a chunk of 2 slots; chunks draw anew
    assert draws[0] == draws[1] and draws[2] == draws[3] and draws[6] == draws[7]
    assert draws[1] != draws[2] or draws[3] != draws[6]
    # every model gets explored
    assert {m for d in draws[:4] for m in d.values()} == set(MODELS)


def test_exploration_respects_capacities() -> None:
    capacities = {"big": 1, "mid": 2, "small": 2}
    lbss = Lbss(settings=LbssSettings(alpha=8, beta=1, capacities=capacities), seed=3)
    requests = [request(f"r{i}") for i in range(12)]
    for _ in range(8):
        chosen = lbss.assign(requests, MODELS, None)
        counts = {m: list(chosen.values()).count(m) for m in MODELS}
        assert all(counts[m] <= capacities[m] for m in MODELS)
        assert sum(counts.values()) == 5  # as many as fit, the others draft nothing


class Environment:
    """Synthetic goodputs: each request has one best model, known only to the test."""

    def __init__(self, num_requests: int, seed: int) -> None:
        self.rng = random.Random(seed)
        self.best = {f"r{i}": self.rng.choice(MODELS) for i in range(num_requests)}

    def outcome(self, rid: str, model: str) -> DraftOutcome:
        mean = 3.0 if self.best[rid] == model else 1.5
        accepted = max(0, round(self.rng.gauss(mean, 0.8)))
        return DraftOutcome(rid, model, 4, accepted, step_ms=10.0)


def run(chooser: object, env: Environment, slots: int) -> float:
    """Share of request-slots spent on each request's best model over the last half."""
    requests = [request(rid) for rid in env.best]
    hits = total = 0
    for slot in range(slots):
        chosen = chooser.assign(requests, MODELS, None)  # type: ignore[attr-defined]
        for r in requests:
            model = chosen.get(r.request_id)
            if model is None:
                continue
            r.draft_model = model
            chooser.observe(env.outcome(r.request_id, model))  # type: ignore[attr-defined]
            if slot >= slots // 2:
                hits += model == env.best[r.request_id]
                total += 1
    return hits / total


def test_lbss_settles_on_each_requests_best_model() -> None:
    env = Environment(8, seed=5)
    lbss = Lbss(settings=LbssSettings(alpha=12, beta=2), seed=5)
    assert run(lbss, env, 300) > 0.85
    # once estimated, exploitation picks exactly the best arm of every request
    if lbss.is_exploring:
        for _ in range(lbss.stage_slots - lbss.slot):
            lbss.assign([request(rid) for rid in env.best], MODELS, None)
    chosen = lbss.assign([request(rid) for rid in env.best], MODELS, None)
    assert chosen == env.best


def test_random_exploration_alone_would_not_settle() -> None:
    env = Environment(8, seed=5)
    always_exploring = EpsilonGreedy(epsilon=1.0, seed=5)
    assert run(always_exploring, env, 300) < 0.5  # about a third: the test can tell


def test_a_model_confidently_worse_over_requests_is_dominated() -> None:
    table = GoodputTable()
    for i, (good, poor) in enumerate([(3.0, 1.0), (3.4, 1.2), (2.8, 0.9), (3.1, 1.1)]):
        table.add(DraftOutcome(f"r{i}", "good", 4, 0, step_ms=1 / good))
        table.add(DraftOutcome(f"r{i}", "poor", 4, 0, step_ms=1 / poor))
        table.add(DraftOutcome(f"r{i}", "close", 4, 0, step_ms=1 / (good - 0.1)))
    models = ["close", "good", "poor"]
    assert table.dominated(models, z=2.0, min_requests=4) == {"poor"}
    assert table.dominated(models, z=2.0, min_requests=5) == set()  # too few requests yet
    assert table.dominated(models, z=40.0, min_requests=4) == set()  # bounds that wide overlap
    for i in range(4):  # finished requests still count, one sample each
        table.forget(f"r{i}")
    assert table.request_means("poor") == pytest.approx([1.0, 1.2, 0.9, 1.1])
    assert table.dominated(models, z=2.0, min_requests=4) == {"poor"}


def test_pruned_exploration_stops_drawing_a_dominated_model() -> None:
    def explored(prune_z: float) -> set[str]:
        """Models drawn in the exploration stages after every request tried every model."""
        lbss = Lbss(settings=LbssSettings(alpha=4, beta=1, prune_z=prune_z), seed=2)
        requests = [request(f"r{i}") for i in range(8)]
        for r in requests:
            for model, goodput in (("small", 2.15), ("mid", 2.2), ("big", 0.5)):
                noise = 0.2 * (int(r.request_id[1:]) % 3)
                lbss.observe(DraftOutcome(r.request_id, model, 4, 0, step_ms=1 / (goodput + noise)))
        drawn: set[str] = set()
        for _ in range(40):
            exploring = lbss.is_exploring
            chosen = lbss.assign(requests, MODELS, None)
            if exploring:
                drawn.update(chosen.values())
        return drawn

    assert explored(0.0) == set(MODELS)  # Spin's Alg. 2: every live model
    assert explored(2.0) == {"mid", "small"}  # `big` is far below for every request


def test_baselines() -> None:
    live = ["draft-l", "draft-m", "draft-s"]
    fixed = FixedDraftModel(["draft-s", "draft-m"])
    assert fixed.assign([request("a"), request("b", model="draft-l")], live, None) == {
        "a": "draft-s",
        "b": "draft-l",  # kept while it lives
    }
    greedy = GreedyByLength(["draft-s", "draft-m", "draft-l"])
    picks = greedy.assign([request(f"p{n}", prompt_len=n) for n in (5, 50, 500)], live, None)
    assert picks == {"p5": "draft-s", "p50": "draft-m", "p500": "draft-l"}
    oracle = Oracle({"a": "draft-m"})
    assert oracle.assign([request("a"), request("z")], live, None) == {
        "a": "draft-m",
        "z": "draft-l",
    }
    with pytest.raises(ValueError, match="oracle"):
        make_chooser("oracle", live)
    assert isinstance(make_chooser("lbss", live), Lbss)


# ---- greedy output under every chooser --------------------------------------------------------
PROMPTS = [[5, 17, 3, 44], [9, 10, 11, 12, 13, 14, 15], [70], [33, 34, 35, 36]]


@pytest.mark.parametrize("chooser", ["fixed", "lbss", "greedy-length", "eps-greedy"])
def test_greedy_output_is_plain_decoding_under_every_chooser(
    tiny_target_dir, tiny_draft_dir, chooser: str
) -> None:
    def runner(path):
        return ModelRunner(load_model(path), block_size=4, kv_memory_bytes=1 << 20)

    plain = SpecEngine(Verifier(runner(tiny_target_dir)))
    expected = [r.output for r in plain.generate(PROMPTS, SamplingParams(max_tokens=24))]
    drafters = {
        "echo": Drafter(runner(tiny_target_dir), name="echo"),  # the target itself: accepted
        "tiny": Drafter(runner(tiny_draft_dir), name="tiny"),
    }
    config = SchedulerConfig(
        draft_chooser=chooser, planner="fixed", lbss=LbssSettings(alpha=4, beta=2)
    )
    engine = SpecEngine(
        Verifier(runner(tiny_target_dir)), drafters, DraftMethod("chain", k=3), config
    )
    reqs = engine.generate(PROMPTS, SamplingParams(max_tokens=24))
    assert [r.output for r in reqs] == expected
    used = {m for r in reqs for m in r.draft_stats}
    assert engine.stats.num_accepted > 0 and used
    if chooser == "lbss":  # its exploration draws both for every request (a seeded draw)
        assert used == {"echo", "tiny"}


# ---- replicas come and go while the bandit runs ------------------------------------------------
def test_a_dead_replica_moves_its_requests_and_the_bandit_keeps_its_statistics() -> None:
    lbss = Lbss(settings=LbssSettings(alpha=4, beta=2), seed=2)
    core = make_core(chooser=lbss, method=DraftMethod("chain", k=3), planner="fixed")
    core.set_drafters({"small": ["s0", "s1"], "big": ["b0"]})
    ex = executor(core, FakeKV(), agree=0.6)
    rids = [f"r{i}" for i in range(6)]
    for rid in rids:
        core.add(make_request(rid, 4, max_tokens=60))
    for _ in range(12):
        while ex.schedule():
            pass
        while ex.inflight:
            ex.finish_one()
    seen = dict(lbss.table.counts)
    on_s0 = [r.request_id for r in core.requests.values() if r.drafter == "s0"]
    assert seen and on_s0, "the run should have used s0 and learned something"
    core.set_drafters({"small": ["s1"], "big": ["b0"]})  # s0's heartbeat expired
    for _ in range(6):
        while ex.schedule():
            pass
        while ex.inflight:
            ex.finish_one()
    assert all(r.drafter != "s0" for r in core.requests.values())
    for key, n in seen.items():  # nothing learned was lost with the replica
        if key[0] in core.requests:
            assert lbss.table.counts[key] >= n
    core.set_drafters({"small": ["s1", "s2"], "big": ["b0"]})  # a replica joins
    while core.has_unfinished():
        while ex.schedule():
            pass
        while ex.inflight:
            ex.finish_one()
    check_releases(ex, rids)


def test_each_request_is_charged_its_own_share_of_the_step() -> None:
    from shared.scheduling.core import MicroBatch
    from shared.scheduling.cost_model import CostModel, CostProfile
    from shared.values.tree import TokenTree
    from tests.test_micro_batches import curve

    # verifying costs 1 ms a token; drafting a forward costs 10 ms on "slow", 1 ms on "fast"
    cost = CostModel(
        CostProfile(
            target=curve("t", 0.0, 1.0, "cuda: test"),
            drafts={
                "slow": curve("slow", 10.0, 0.0, "cuda: test"),
                "fast": curve("fast", 1.0, 0.0, "cuda: test"),
            },
        )
    )
    core = make_core(cost=cost, chooser=Lbss())  # a chooser that learns from the shares
    chain = TokenTree.build([5, 6, 7], [-1, 0, 1], [0.0, -0.1, -0.2])  # root and 2 drafted
    batch = MicroBatch(1, 0.0)
    for rid, model in (("a", "slow"), ("b", "fast"), ("c", None)):
        r = make_request(rid, 4)
        r.draft_model = model
        batch.decode.append(r)
        batch.trees[rid] = chain if model else TokenTree.root_only(5)
    shares = core.learner.cost_shares(batch)
    verify = 7.0  # 3 + 3 + 1 tokens at 1 ms
    slow_drafting, fast_drafting = 2 * 10.0, 2 * 1.0  # a root forward and one level each
    assert shares["c"] == pytest.approx(verify / 7)
    assert shares["a"] == pytest.approx(3 * verify / 7 + slow_drafting)
    assert shares["b"] == pytest.approx(3 * verify / 7 + fast_drafting)
    assert sum(shares.values()) == pytest.approx(verify + slow_drafting + fast_drafting)
    assert (
        DraftOutcome("a", "slow", 2, 1, 50.0, shares["a"]).goodput
        < DraftOutcome("b", "fast", 2, 1, 50.0, shares["b"]).goodput
    )  # the same step, the same tokens: the slow draft's request earned less


# ---- fast switching (Spin §IV-C) ---------------------------------------------------------------
def test_lbss_names_the_next_chunks_draw_ahead_of_it() -> None:
    lbss = Lbss(settings=LbssSettings(alpha=8, beta=2), seed=1)
    reqs = [request(f"r{i}") for i in range(6)]
    foreseen: dict[str, str | None] = {}
    for slot in range(8):  # one exploration stage: 4 chunks of 2 slots
        chosen = lbss.assign(reqs, MODELS, None)
        for r in reqs:
            if slot in (2, 4, 6):  # a chunk's first slot: the draw named one slot earlier
                expected = foreseen[r.request_id] or r.draft_model  # None: no switch foreseen
                assert chosen[r.request_id] == expected
            r.draft_model = chosen[r.request_id]
            foreseen[r.request_id] = lbss.next_model(r, MODELS)
    lbss.observe(DraftOutcome("r0", "small", 3, 3, 10.0))  # exploiting now: the best other
    lbss.observe(DraftOutcome("r0", "mid", 3, 0, 10.0))
    reqs[0].draft_model = "big"
    assert not lbss.is_exploring and lbss.next_model(reqs[0], MODELS) == "small"
    assert FixedDraftModel().next_model(reqs[0], MODELS) is None


def test_fast_switching_keeps_the_next_draft_in_step_so_a_switch_costs_no_prefill() -> None:
    def run(fast: bool) -> tuple[object, list[tuple[int, int]]]:
        lbss = Lbss(settings=LbssSettings(alpha=4, beta=1), seed=3)
        core = make_core(
            chooser=lbss, method=DraftMethod("chain", k=3), planner="fixed", fast_switching=fast
        )
        core.set_drafters({"small": ["s0"], "big": ["b0", "b1"]})
        ex = executor(core, FakeKV(), agree=0.6, draft_failure=0.05)
        rids = [f"r{i}" for i in range(6)]
        for rid in rids:
            core.add(make_request(rid, 12, max_tokens=60))
        ex.run()  # the fake drafters assert every plan's base matches what the replica holds
        for rid in rids:
            assert ex.streamed[rid] == greedy(make_request(rid, 12).prompt, 60)
        check_releases(ex, rids)  # standbys too are released once their request finished
        switches, last = [], {}
        for plans in ex.plans:  # a switch: the first plan of a request on another model
            for rid, plan in plans.items():
                if last.get(rid) not in (None, plan.model):
                    switches.append((plan.base_len, len(plan.new_tokens)))
                last[rid] = plan.model
        return (core, ex), switches

    (core, ex), switches = run(fast=True)
    (cold_core, _), cold = run(fast=False)
    assert ex.warmed and all(p.max_depth == 1 for _, p in ex.warmed)
    assert cold and all(base == 0 for base, _ in cold)  # without: every switch re-prefills
    warm = [(base, n) for base, n in switches if base > 0]
    assert len(warm) >= len(switches) // 2, switches
    assert all(n <= 3 + 2 for _, n in warm)  # only what the last verified step committed
    assert core.switches["warm"] == len(warm)
    assert core.switches["warm_tokens"] / len(warm) < cold_core.switches["cold_tokens"] / len(cold)


def test_greedy_output_is_plain_decoding_with_fast_switching(
    tiny_target_dir, tiny_draft_dir
) -> None:
    def runner(path):
        return ModelRunner(load_model(path), block_size=4, kv_memory_bytes=1 << 20)

    plain = SpecEngine(Verifier(runner(tiny_target_dir)))
    expected = [r.output for r in plain.generate(PROMPTS, SamplingParams(max_tokens=32))]

    class CheckedDrafter(Drafter):
        """Asserts that every job, warm-up or draft, starts where this drafter's KV ends."""

        def draft(self, requests, method):  # noqa: ANN001, ANN202
            for r in requests:
                held = self.num_committed(r.request_id)
                assert r.base_len in (0, held), f"{self.name}/{r.request_id}: {held} held"
            return super().draft(requests, method)

    drafters = {
        "echo": CheckedDrafter(runner(tiny_target_dir), name="echo"),
        "tiny": CheckedDrafter(runner(tiny_draft_dir), name="tiny"),
    }
    config = SchedulerConfig(
        draft_chooser="lbss",
        planner="fixed",
        lbss=LbssSettings(alpha=4, beta=1),
        fast_switching=True,
    )
    engine = SpecEngine(
        Verifier(runner(tiny_target_dir)), drafters, DraftMethod("chain", k=3), config
    )
    reqs = engine.generate(PROMPTS, SamplingParams(max_tokens=32))
    assert [r.output for r in reqs] == expected
    assert engine.stats.num_accepted > 0
    assert engine.core.switches["warm"] > 0  # switched onto standbys the engine warmed
    for drafter in drafters.values():  # finished: no draft KV left on either drafter
        assert not any(drafter.runner.has_request(r.request_id) for r in reqs)


# ---- merged trees (SpecInfer) ------------------------------------------------------------------
def test_merged_trees_verify_the_union_of_both_drafters_paths() -> None:
    chooser = EpsilonGreedy(epsilon=0.0)  # the standby is always the other model
    core = make_core(
        chooser=chooser, method=DraftMethod("chain", k=3), planner="fixed", merge_drafts="standby"
    )
    core.set_drafters({"small": ["s0"], "big": ["b0"]})
    ex = executor(core, FakeKV(), agree=0.5, draft_failure=0.05)
    rids = [f"r{i}" for i in range(5)]
    for rid in rids:
        core.add(make_request(rid, 6, max_tokens=40))
    ex.run()
    for rid in rids:
        assert ex.streamed[rid] == greedy(make_request(rid, 6).prompt, 40)
    check_releases(ex, rids)
    merged = [p for _, p in ex.warmed]
    assert merged and all(p.stream == 1 for p in merged)  # full drafts, not warm-ups
    # two chains of 3 from the same root: a merged tree holds both where they differ
    assert max(t.num_nodes for t in ex.verified) > 1 + 3
    request = make_request("x", 3)
    plan = DraftPlan("big", "b0", DraftMethod("chain", k=3), 0, (1, 2, 3), 3, 3)
    own, second = draft_request(request, plan), draft_request(request, replace(plan, stream=1))
    assert own.seed == request.seed and second.seed != own.seed  # a random stream of its own


def test_at_risk_merges_only_requests_behind_their_objective() -> None:
    core = make_core(method=DraftMethod("chain", k=3), merge_drafts="at-risk")
    behind, on_track, no_slo = (make_request(rid, 4) for rid in ("behind", "ok", "none"))
    for r, tpot in ((behind, 10.0), (on_track, 1000.0)):
        r.tpot_slo_ms = tpot
    for r in (behind, on_track, no_slo):
        r.output = [1, 2, 3]
        r.first_token_time, r.last_token_time = 0.0, 0.1  # 50 ms per token after the first
    merges = core.standby.merges
    assert merges(behind) and not merges(on_track) and not merges(no_slo)


def test_at_risk_standby_catches_up_instead_of_prefilling_again(monkeypatch) -> None:
    """A request that falls behind, recovers and falls behind again keeps its standby: the
    second spell's first merged draft appends only what the standby missed."""
    core = make_core(
        chooser=FixedDraftModel(["small", "big"]),
        method=DraftMethod("chain", k=3),
        planner="fixed",
        merge_drafts="at-risk",
    )
    core.set_drafters({"small": ["s0"], "big": ["b0"]})
    spells = itertools.cycle([True] * 3 + [False] * 3)  # behind for 3 steps, on track for 3
    monkeypatch.setattr(core.standby, "merges", lambda request: next(spells))
    ex = executor(core, FakeKV())
    core.add(make_request("r", 5, max_tokens=40))
    ex.run()
    assert ex.streamed["r"] == greedy(make_request("r", 5).prompt, 40)
    merged = [p for _, p in ex.warmed]
    assert len(merged) >= 6 and all(p.stream == 1 for p in merged)
    assert merged[0].base_len == 0  # the first spell prefills the standby once
    assert all(p.base_len > 0 for p in merged[1:])  # later spells only catch up
    check_releases(ex, ["r"])


def test_greedy_output_is_plain_decoding_with_merged_trees(tiny_target_dir, tiny_draft_dir) -> None:
    def runner(path):
        return ModelRunner(load_model(path), block_size=4, kv_memory_bytes=1 << 20)

    plain = SpecEngine(Verifier(runner(tiny_target_dir)))
    expected = [r.output for r in plain.generate(PROMPTS, SamplingParams(max_tokens=24))]
    drafters = {
        "echo": Drafter(runner(tiny_target_dir), name="echo"),
        "tiny": Drafter(runner(tiny_draft_dir), name="tiny"),
    }
    config = SchedulerConfig(draft_chooser="eps-greedy", planner="fixed", merge_drafts="standby")
    engine = SpecEngine(
        Verifier(runner(tiny_target_dir)), drafters, DraftMethod("chain", k=3), config
    )
    merged = []
    select = engine.core.select_trees

    def spy(batch, drafted, now, partners=None):
        merged.extend(partners or {})
        return select(batch, drafted, now, partners)

    engine.core.select_trees = spy
    reqs = engine.generate(PROMPTS, SamplingParams(max_tokens=24))
    assert [r.output for r in reqs] == expected
    assert merged, "no step merged a standby's tree"
    assert engine.core.num_merged_trees == len(merged)
    # "echo" (the target) is a drafter in every merged step, own or standby: its chain is the
    # greedy path, so every merged step accepts all 3 of its tokens where room allows
    assert engine.stats.num_accepted >= 2 * len(merged)


def test_without_a_foreseen_switch_the_partner_is_the_cheapest_other_draft() -> None:
    core = make_core(
        chooser=FixedDraftModel(["small", "big", "mid"]),
        method=DraftMethod("chain", k=3),
        planner="fixed",
        merge_drafts="standby",
    )
    core.set_drafters({"small": ["s0"], "mid": ["m0"], "big": ["b0"]})
    ex = executor(core, FakeKV())
    core.add(make_request("r", 5, max_tokens=12))
    ex.run()
    partners = {p.model for _, p in ex.warmed}
    assert partners == {"big"}  # no cost model: the first other by name
    check_releases(ex, ["r"])


def test_a_merged_step_teaches_the_current_draft_only_what_its_own_tree_achieved() -> None:
    from shared.scheduling.core import own_part
    from shared.values.tree import TokenTree, merge_trees
    from tests.test_scheduler_core import FakeDrafters

    own = TokenTree.build([9, 1, 2], [-1, 0, 1], [0.0, -0.1, -0.1])  # chain 1, 2
    partner = TokenTree.build([9, 1, 5, 7], [-1, 0, 1, 2], [0.0, -0.1, -0.2, -0.3])  # 1, 5, 7
    merged = merge_trees([own, partner])  # 1 is shared: 1 -> 2 and 1 -> 5 -> 7
    part, accepted = own_part(merged, own, [1, 5, 7])
    assert part.num_nodes == 3 and accepted == 1  # own had 1 (then 2): only 1 was its

    class ByModel(FakeDrafters):  # "bad" is never right, "good" always
        def _tree(self, plan, request):
            self.agree = 1.0 if plan.model == "good" else 0.0
            return super()._tree(plan, request)

    core = make_core(
        chooser=FixedDraftModel(["bad", "good"]),
        method=DraftMethod("chain", k=3),
        planner="fixed",
        merge_drafts="standby",
    )
    core.set_drafters({"bad": ["b0"], "good": ["g0"]})
    ex = executor(core, FakeKV())
    ex.drafters = ByModel(0.0, ex.rng)
    for rid in ("r0", "r1"):
        core.add(make_request(rid, 5, max_tokens=40))
    ex.run()
    assert core.stats.num_accepted > 20  # the merged trees carried the good draft's paths
    assert core.pool.model_estimate("bad").successes == 0  # ... which "bad" is not credited with
