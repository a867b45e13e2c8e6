"""SLO-customized tree selection: A(r), Eq. 8-9, what each selector keeps, and greedy output
unchanged under every selector."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from shared.scheduling.factory import make_selector
from shared.scheduling.request import RequestState
from shared.scheduling.slo import (
    SPECINFER_EXPANSION,
    AdaServe,
    EqualGreedy,
    Incremental,
    StaticTree,
    ThesisSlo,
    acceptance_target,
    beam_shape,
)
from shared.scheduling.tree_selection import SELECTORS, SelectionContext
from shared.settings import SloSettings
from shared.values.methods import DraftMethod
from shared.values.sampling import SamplingParams
from shared.values.tree import TokenTree


def state(rid: str, *, slo: float | None, emitted: int = 5, first_s: float = 10.0) -> RequestState:
    """A request whose first token came at `first_s` and that has emitted `emitted` tokens."""
    r = RequestState(rid, [1, 2, 3], SamplingParams(max_tokens=100), seed=0, tpot_slo_ms=slo)
    r.output = list(range(emitted))
    r.first_token_time = first_s
    r.last_token_time = first_s
    return r


def ctx(requests: dict[str, RequestState], budget: int, now: float = 10.2) -> SelectionContext:
    return SelectionContext(
        requests=requests,
        budget=budget,
        prefill_tokens=0,
        max_depth={rid: 99 for rid in requests},
        calibration={},
        cost=None,
        context=16,
        now=now,
    )


def chain(probs: list[float], base: int = 100) -> TokenTree:
    return TokenTree.chain(
        base, [base + 1 + i for i in range(len(probs))], [math.log(p) for p in probs]
    )


def random_tree(rng: random.Random, num_nodes: int) -> TokenTree:
    parents = [-1] + [rng.randrange(i) for i in range(1, num_nodes)]
    logq = [0.0] + [math.log(rng.uniform(0.05, 0.95)) for _ in range(1, num_nodes)]
    return TokenTree.build([rng.randrange(1000) for _ in range(num_nodes)], parents, logq)


def path_probs(tree: TokenTree) -> list[float]:
    return np.exp(tree.path_logprob()).tolist()


# ---- the papers' quantities -------------------------------------------------------------------
def test_acceptance_target_by_hand() -> None:
    # 200 ms since the first token, 4 tokens after it, a 50 ms step, a 50 ms objective:
    # (200 + 50) / 50 - 4 = 1 token must be committed this step
    r = state("a", slo=50.0, emitted=5)
    assert acceptance_target(r, now=10.2, step_ms=50.0) == pytest.approx(1.0)
    # behind: 400 ms for the same 4 tokens -> (400 + 50) / 50 - 4 = 5
    assert acceptance_target(r, now=10.4, step_ms=50.0) == pytest.approx(5.0)
    # ahead: a loose objective needs nothing (negative)
    assert acceptance_target(state("b", slo=500.0), now=10.2, step_ms=50.0) < 0
    assert acceptance_target(state("c", slo=None), now=10.2, step_ms=50.0) is None
    fresh = RequestState("d", [1], SamplingParams(), seed=0, tpot_slo_ms=50.0)
    assert acceptance_target(fresh, now=10.2, step_ms=50.0) is None  # no first token yet


@pytest.mark.parametrize(
    ("budget", "n", "depth", "width"),
    [(16, 3, 6, 4), (16, 1, 8, 4), (10, 4, 3, 2), (16, 20, 1, 1), (64, 16, 4, 4), (512, 64, 8, 4)],
)
def test_beam_shape_follows_eq_8_and_9(budget: int, n: int, depth: int, width: int) -> None:
    # d = max(1, min(Dmax, ceil(B / n))), w = max(1, min(Wmax, floor(B / n))), Dmax 8, Wmax 4
    assert beam_shape(budget, n, max_depth=8, max_width=4) == (depth, width)


def test_adaserve_caps_its_target_at_the_tree_depth_plus_one() -> None:
    """A(r) = 5 but the candidate is a chain of 2: it takes the chain (A_cap = 3), and says the
    request is at risk; the budget left goes to the other request."""
    requests = {"late": state("late", slo=50.0), "free": state("free", slo=None)}
    trees = {"late": chain([0.9, 0.9]), "free": chain([0.8, 0.7, 0.6], base=200)}
    selector = AdaServe(SloSettings(max_slo_nodes=16))
    kept = selector.select(trees, ctx(requests, budget=5, now=10.4))
    assert kept["late"].num_nodes == 3
    assert kept["free"].num_nodes == 2
    assert selector.at_risk == {"late"}


# ---- what selections keep ---------------------------------------------------------------------
@pytest.mark.parametrize("name", SELECTORS)
def test_every_selection_is_a_valid_subtree_within_the_budget(name: str) -> None:
    rng = random.Random(7)
    selector = make_selector(name)
    for trial in range(30):
        trees = {f"r{i}": random_tree(rng, rng.randint(1, 12)) for i in range(rng.randint(1, 5))}
        requests = {
            rid: state(rid, slo=rng.choice([None, 20.0, 60.0, 200.0]), emitted=rng.randint(1, 9))
            for rid in trees
        }
        budget = rng.randint(len(trees), 30)
        kept = selector.select(trees, ctx(requests, budget))
        assert set(kept) == set(trees)
        for rid, tree in kept.items():
            full = trees[rid]
            assert tree.root_token == full.root_token
            # each kept node's path of tokens exists in the candidate tree: parents kept
            paths = {tuple(full.tokens[full.path_to(n)].tolist()) for n in range(full.num_nodes)}
            for node in range(tree.num_nodes):
                assert tuple(tree.tokens[tree.path_to(node)].tolist()) in paths
        if name not in ("static", "goodput", "global-greedy"):  # those are not budget-bound here
            assert sum(t.num_nodes for t in kept.values()) <= budget, (name, trial)


def test_slo_customized_selection_serves_the_most_urgent_first() -> None:
    """Three nodes to share: the request furthest behind (largest A(r)) gets what it needs
    before the one barely behind; a request with no objective gets only its root. Without a
    cost model a step is taken to last one objective (t_spec = t_TPOT)."""
    requests = {
        "behind": state("behind", slo=50.0, first_s=9.95),  # A = (300 + 50)/50 - 4 = 3
        "barely": state("barely", slo=50.0, first_s=10.0),  # A = (250 + 50)/50 - 4 = 2
        "none": state("none", slo=None),
    }
    trees = {
        "behind": chain([0.9, 0.9, 0.9], base=100),
        "barely": chain([0.95, 0.9], base=200),
        "none": chain([0.99, 0.99], base=300),
    }
    kept = AdaServe().select(trees, ctx(requests, budget=3 + 3, now=10.25))
    # "behind" needs sum f >= 3: 1 + .9 + .81 < 3, so it takes all 3 of its nodes (n_max 16)
    assert kept["behind"].num_nodes == 4
    assert kept["barely"].num_nodes == 1 and kept["none"].num_nodes == 1
    # GlobalGreedy would have taken the highest path probabilities instead
    greedy = make_selector("global-greedy").select(trees, ctx(requests, budget=6, now=10.25))
    assert greedy["none"].num_nodes == 3


def test_feasible_first_admission_serves_requests_that_can_still_make_it() -> None:
    requests = {
        "hopeless": state("hopeless", slo=20.0, first_s=10.0),  # A = (500 + 20)/20 - 4 = 22
        "savable": state("savable", slo=50.0, first_s=10.2),  # A = (300 + 50)/50 - 4 = 3
    }
    trees = {"hopeless": chain([0.9, 0.9]), "savable": chain([0.9, 0.9, 0.9], base=200)}
    budget = 2 + 3
    urgent = AdaServe(SloSettings(admission="urgent-first")).select(
        trees, ctx(requests, budget, now=10.5)
    )
    feasible = AdaServe(SloSettings(admission="feasible-first")).select(
        trees, ctx(requests, budget, now=10.5)
    )
    assert urgent["hopeless"].num_nodes == 3 and urgent["savable"].num_nodes == 2
    assert feasible["savable"].num_nodes == 4 and feasible["hopeless"].num_nodes == 1


def test_throughput_selection_takes_the_highest_path_probabilities() -> None:
    """No objectives: AdaServe keeps, across requests, the nodes of highest f(v)."""
    rng = random.Random(3)
    trees = {f"r{i}": random_tree(rng, 10) for i in range(4)}
    requests = {rid: state(rid, slo=None) for rid in trees}
    budget = 4 + 9
    kept = AdaServe().select(trees, ctx(requests, budget))
    taken = sorted(p for t in kept.values() for p in path_probs(t)[1:])
    # the best 9 nodes that respect parents: f(child) <= f(parent), so they are the top 9
    every = sorted((p for t in trees.values() for p in path_probs(t)[1:]), reverse=True)
    assert taken == pytest.approx(sorted(every[:9]))


def test_thesis_slo_fills_short_requests_first_then_by_marginal_gain() -> None:
    requests = {
        "short": state("short", slo=50.0, first_s=9.9),  # A = (300 + 50)/50 - 4 = 3
        "free": state("free", slo=None),
    }
    trees = {"short": chain([0.6, 0.6, 0.6]), "free": chain([0.99, 0.99], base=200)}
    kept = ThesisSlo(SloSettings(slack=0.5)).select(trees, ctx(requests, budget=2 + 3, now=10.2))
    # short aims at 3 + 0.5: 1 + .6 + .36 + .216 falls short even with all three nodes
    assert kept["short"].num_nodes == 4 and kept["free"].num_nodes == 1


def test_equal_greedy_gives_each_request_the_same_share() -> None:
    trees = {"a": chain([0.99] * 6), "b": chain([0.1] * 6, base=200)}
    requests = {rid: state(rid, slo=None) for rid in trees}
    kept = EqualGreedy().select(trees, ctx(requests, budget=8))
    assert kept["a"].num_nodes == 4 and kept["b"].num_nodes == 4


def test_static_and_incremental_draft_as_their_papers_do() -> None:
    configured = DraftMethod("dynamic")
    static = StaticTree().draft_method(configured, num_requests=3, budget=8)
    assert static == DraftMethod("static", expansion=SPECINFER_EXPANSION)
    assert Incremental().draft_method(configured, num_requests=3, budget=8) is None
    assert AdaServe(SloSettings(max_depth=8, max_width=4)).draft_method(configured, 4, 10) == (
        DraftMethod("beam", depth=3, width=2, min_path_prob=configured.min_path_prob)
    )
    # nothing configured (speculation off) stays off
    assert AdaServe().draft_method(None, 4, 10) is None


# ---- the engine: greedy output is the target's under every selector ------------------------------
PROMPTS = [[5, 17, 3, 44], [9, 10, 11, 12, 13, 14, 15, 16, 17, 18], [70], [33, 34, 35, 36]]


@pytest.fixture(scope="module")
def plain(tiny_target_dir):  # noqa: ANN001, ANN201
    from tests.test_engine_greedy import make_engine

    engine = make_engine(tiny_target_dir, None, None)
    return [r.output for r in engine.generate(PROMPTS, SamplingParams(max_tokens=16))]


@pytest.mark.parametrize("name", SELECTORS)
def test_greedy_output_unchanged_under_every_selector(tiny_target_dir, plain, name) -> None:  # noqa: ANN001
    """The target drafts for itself, so a selector that speculates must accept most of what it
    verifies (an acceptance floor: a selector that dropped accepted nodes would fall below)."""
    from tests.test_engine_greedy import make_engine

    method = DraftMethod("dynamic", budget=24, max_size=8, max_depth=4, max_width=2)
    engine = make_engine(tiny_target_dir, tiny_target_dir, method, tree_selection=name)
    ids = [
        engine.add_request(prompt, SamplingParams(max_tokens=16), tpot_slo_ms=slo)
        for prompt, slo in zip(PROMPTS, (5.0, 50.0, None, 500.0), strict=True)
    ]
    while engine.has_unfinished():
        engine.step()
    assert [engine.requests[i].output for i in ids] == plain
    if name == "incremental":
        assert engine.stats.num_draft_tokens == 0
    else:
        assert engine.stats.mean_accepted_length > 2.0, engine.stats


# ---- AdaServe as the paper states it ------------------------------------------------------------
def test_adaserve_beam_keeps_w_nodes_at_every_layer_whatever_the_cut_off() -> None:
    # a configured dynamic tree prunes paths under 0.2; the paper's beam does not
    configured = DraftMethod("dynamic", min_path_prob=0.2)
    beam = AdaServe(SloSettings(max_depth=8, max_width=4)).draft_method(configured, 4, 10)
    assert beam == DraftMethod("beam", depth=3, width=2, min_path_prob=0.0)


def test_adaserve_step_estimate_does_not_count_drafting_twice() -> None:
    """The selector's clock is read after drafting, so A(r) = (l + t_verify) / t_TPOT - o.
    Here l = 190 ms, a verification 10 ms, o = 4, t_TPOT = 50 ms: A = 0, the request is on
    time. Counting its draft (100 ms a forward) again would put it at risk."""
    from shared.scheduling.cost_model import (
        CostModel,
        CostProfile,
        ForwardCurve,
        ModelProfile,
        ProfileKey,
    )

    def flat(ms: float, model: str) -> ModelProfile:
        key = ProfileKey(model=model, fingerprint="f", device="cpu: t", dtype="float32", threads=1)
        curve = ForwardCurve(tokens=[1, 1024], contexts=[0], ms_grid=[[ms], [ms]])
        return ModelProfile(key=key, curve=curve)

    cost = CostModel(CostProfile(target=flat(10.0, "t"), drafts={"d": flat(100.0, "d")}))
    request = state("r", slo=50.0, emitted=5, first_s=10.0)
    request.draft_model = "d"
    selector = AdaServe(SloSettings(max_slo_nodes=16))
    context = ctx({"r": request}, budget=4, now=10.19)
    context = SelectionContext(**{**context.__dict__, "cost": cost})
    selector.select({"r": chain([0.9])}, context)
    assert selector.at_risk == set()
    # 300 ms for the same tokens: A = (300 + 10) / 50 - 4 = 2.2, more than 1 + 0.9
    late = SelectionContext(**{**context.__dict__, "now": 10.3})
    selector.select({"r": chain([0.9])}, late)
    assert selector.at_risk == {"r"}
