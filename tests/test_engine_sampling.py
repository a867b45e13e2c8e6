"""End to end through the engine: sampled outputs follow the target; seeds reproduce."""

from __future__ import annotations

import itertools

import pytest

from shared.scheduling import executor
from shared.values.methods import DraftMethod
from shared.values.sampling import SamplingParams
from tests.conftest import make_tiny_checkpoint
from tests.small_vocab import VOCAB, exact_joint, small_vocab_pair
from tests.stats import P_VALUE_FLOOR, fit_p_value
from tests.test_engine_greedy import METHODS, make_engine

PROMPT = [1, 4, 2]
NUM_REQUESTS = 4000
OUT_LEN = 3


@pytest.fixture(scope="module")
def small_vocab_dirs(tmp_path_factory):
    return small_vocab_pair(tmp_path_factory, "sv")


def exact(target_dir, params: SamplingParams) -> dict[tuple[int, ...], float]:
    return exact_joint(target_dir, PROMPT, OUT_LEN, params)


SAMPLED_METHODS = {
    "chain": DraftMethod("chain", k=3),
    "static": DraftMethod("static", expansion=(2, 2)),
    "beam": METHODS["beam"],
    "dynamic": METHODS["dynamic"],
    "static_cost_aware": DraftMethod("static", expansion=(2, 2), min_path_prob=0.3),
}


def sampled_params(coupled: bool, monkeypatch: pytest.MonkeyPatch) -> list[SamplingParams]:
    """Seeded requests sample through Gumbel noise (coupled); unseeded ones by multi-step
    speculative sampling, here with engine seeds drawn from a fixed counter."""
    counter = itertools.count(10_000)
    monkeypatch.setattr(executor.secrets, "randbits", lambda bits: next(counter))
    return [
        SamplingParams(temperature=0.9, seed=s if coupled else None, max_tokens=OUT_LEN)
        for s in range(NUM_REQUESTS)
    ]


@pytest.mark.parametrize("coupled", [False, True], ids=["multi-step", "coupled"])
@pytest.mark.parametrize("name", sorted(SAMPLED_METHODS))
def test_sampled_outputs_follow_target(small_vocab_dirs, name, coupled, monkeypatch):
    target_dir, draft_dir = small_vocab_dirs
    params = sampled_params(coupled, monkeypatch)
    engine = make_engine(
        target_dir, draft_dir, SAMPLED_METHODS[name], max_running_requests=NUM_REQUESTS
    )
    reqs = engine.generate([PROMPT] * NUM_REQUESTS, params)
    outcomes = [tuple(r.output) for r in reqs]
    assert engine.stats.num_draft_tokens > 0
    assert fit_p_value(outcomes, exact(target_dir, params[0])) > P_VALUE_FLOOR


def test_seed_reproduces_output_whatever_the_batch(tiny_target_dir, tiny_draft_dir):
    method = DraftMethod("static", expansion=(2, 2, 1))
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=42, max_tokens=12)
    alone = make_engine(tiny_target_dir, tiny_draft_dir, method).generate([[5, 6, 7]], params)
    others = [SamplingParams(temperature=1.0, seed=s, max_tokens=9) for s in range(3)]
    crowd = make_engine(tiny_target_dir, tiny_draft_dir, method).generate(
        [[9, 9], [5, 6, 7], [1, 2, 3, 4], [8]], [others[0], params, others[1], others[2]]
    )
    assert crowd[1].output == alone[0].output
    other_seed = SamplingParams(temperature=1.0, top_p=0.95, seed=43, max_tokens=12)
    differs = make_engine(tiny_target_dir, tiny_draft_dir, method).generate([[5, 6, 7]], other_seed)
    assert differs[0].output != alone[0].output


@pytest.mark.parametrize("coupled", [False, True], ids=["multi-step", "coupled"])
def test_sampled_outputs_with_merged_trees_follow_target(
    small_vocab_dirs, tmp_path_factory, coupled, monkeypatch
):
    """Two different drafters speculate every request in the same step (the standby's tree
    merged with the current drafter's, each sampled node verified against its own drafter's
    proposal): still the target's distribution."""
    from shared.engine.drafting import Drafter
    from shared.engine.spec_engine import SpecEngine
    from shared.engine.verifier import Verifier
    from shared.model import load_model
    from shared.model.runner import ModelRunner
    from shared.scheduling.config import SchedulerConfig

    target_dir, draft_dir = small_vocab_dirs

    def runner(path, kv_bytes=4 << 20):
        return ModelRunner(load_model(path), block_size=4, kv_memory_bytes=kv_bytes)

    other_dir = make_tiny_checkpoint(
        tmp_path_factory.mktemp("sv_other"), seed=5, vocab_size=VOCAB, hidden_size=16, num_layers=1
    )
    drafters = {
        "small": Drafter(runner(draft_dir), name="small"),
        "other": Drafter(runner(other_dir), name="other"),
    }
    config = SchedulerConfig(
        max_running_requests=NUM_REQUESTS, draft_chooser="eps-greedy", merge_drafts="standby"
    )
    engine = SpecEngine(
        Verifier(runner(target_dir, 8 << 20)), drafters, DraftMethod("chain", k=3), config
    )
    merged_steps = 0
    select = engine.core.select_trees

    def count(batch, drafted, now, partners=None):
        nonlocal merged_steps
        merged_steps += len(partners or {})
        return select(batch, drafted, now, partners)

    engine.core.select_trees = count
    params = sampled_params(coupled, monkeypatch)
    outcomes = [tuple(r.output) for r in engine.generate([PROMPT] * NUM_REQUESTS, params)]
    assert merged_steps > NUM_REQUESTS // 2
    assert fit_p_value(outcomes, exact(target_dir, params[0])) > P_VALUE_FLOOR
