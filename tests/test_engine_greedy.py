"""Invariant: every speculation method yields exactly plain greedy decoding of the target."""

from __future__ import annotations

import pytest

from shared.engine.drafting import Drafter
from shared.engine.methods import DraftMethod
from shared.engine.sampling import SamplingParams
from shared.engine.spec_engine import EngineConfig, SpecEngine
from shared.engine.verifier import Verifier
from shared.model import load_model
from shared.model.runner import ModelRunner
from tests.helpers import hf_greedy

METHODS = {
    "chain": DraftMethod("chain", k=4),
    "static": DraftMethod("static", expansion=(3, 2, 1)),
    "beam": DraftMethod("beam", depth=4, width=3),
    "dynamic": DraftMethod("dynamic", budget=12, max_size=8, max_depth=5, max_width=3),
    "chain_cost_aware": DraftMethod("chain", k=6, min_path_prob=0.05),
    "beam_cost_aware": DraftMethod("beam", depth=4, width=3, min_path_prob=0.02),
    "dynamic_cost_aware": DraftMethod("dynamic", budget=12, max_size=8, min_path_prob=0.02),
}
PROMPTS = [
    [5, 17, 3, 44],
    [9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21],
    [70],
    [33, 34, 35, 36, 37, 38, 39],
]


def make_engine(target_dir, draft_dir, method, target_kv_bytes: int = 2 << 20, **cfg) -> SpecEngine:
    target = ModelRunner(load_model(target_dir), block_size=4, kv_memory_bytes=target_kv_bytes)
    verifier = Verifier(target)
    drafter = None
    if method is not None:
        drafter = Drafter(ModelRunner(load_model(draft_dir), block_size=4, kv_memory_bytes=1 << 20))
    return SpecEngine(verifier, drafter, method, EngineConfig(**cfg))


@pytest.fixture(scope="module")
def plain_outputs(tiny_target_dir):
    engine = make_engine(tiny_target_dir, None, None)
    reqs = engine.generate(PROMPTS, SamplingParams(max_tokens=20))
    return [r.output for r in reqs]


def test_plain_decoding_equals_transformers(tiny_target_dir, plain_outputs):
    for prompt, out in zip(PROMPTS[:2], plain_outputs[:2], strict=True):
        assert out == hf_greedy(tiny_target_dir, prompt, 20)


@pytest.mark.parametrize("name", sorted(METHODS))
def test_speculative_greedy_equals_plain(tiny_target_dir, tiny_draft_dir, plain_outputs, name):
    engine = make_engine(tiny_target_dir, tiny_draft_dir, METHODS[name])
    reqs = engine.generate(PROMPTS, SamplingParams(max_tokens=20))
    assert [r.output for r in reqs] == plain_outputs
    assert engine.stats.num_draft_tokens > 0


@pytest.mark.parametrize("name", sorted(METHODS))
def test_mixed_stages_in_one_batch(tiny_target_dir, tiny_draft_dir, plain_outputs, name):
    """Requests arrive while others decode; prompts prefill in chunks beside trees."""
    engine = make_engine(tiny_target_dir, tiny_draft_dir, METHODS[name], max_tokens_per_step=5)
    params = SamplingParams(max_tokens=20)
    ids = [engine.add_request(PROMPTS[0], params)]
    pending = list(PROMPTS[1:])
    while engine.has_unfinished() or pending:
        engine.step()
        if pending:
            ids.append(engine.add_request(pending.pop(0), params))
    assert [engine.requests[i].output for i in ids] == plain_outputs


@pytest.mark.parametrize("name", ["chain", "static"])
def test_draft_equal_to_target_accepts_every_step_fully(tiny_target_dir, plain_outputs, name):
    """With the target as its own draft, every step accepts a full-depth path: drafter
    positions, masks and KV line up with the verifier's."""
    method = {
        "chain": DraftMethod("chain", k=3),
        "static": DraftMethod("static", expansion=(2, 2, 1)),
    }[name]
    engine = make_engine(tiny_target_dir, tiny_target_dir, method)
    reqs = engine.generate(PROMPTS, SamplingParams(max_tokens=20))
    assert [r.output for r in reqs] == plain_outputs
    # every verify step accepts min(3, tokens left - 1) draft tokens
    assert all(n == engine.stats.num_drafts for n in engine.stats.accepted_per_position[:2])
    assert engine.stats.mean_accepted_length > 3.5
