"""Invariant: every speculation method yields exactly plain greedy decoding of the target."""

from __future__ import annotations

import pytest

from shared.engine.drafting import Drafter
from shared.engine.spec_engine import SpecEngine
from shared.engine.verifier import Verifier
from shared.errors import InvalidRequestError
from shared.model import load_model
from shared.model.runner import ModelRunner
from shared.scheduling.config import SchedulerConfig
from shared.values.methods import DraftMethod
from shared.values.sampling import SamplingParams
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
    return SpecEngine(verifier, drafter, method, SchedulerConfig(**cfg))


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


FULL_TREES = {
    "chain": DraftMethod("chain", k=3),
    "static": DraftMethod("static", expansion=(2, 2, 1)),
    "beam": DraftMethod("beam", depth=3, width=2),
    "dynamic": DraftMethod("dynamic", budget=12, max_size=8, max_depth=4, max_width=3),
}


def greedy_depth(tree, continuation) -> int:
    """How deep the greedy continuation runs down the tree from its root."""
    kids, node, depth = tree.children(), 0, 0
    for token in continuation:
        node = next((c for c in kids[node] if int(tree.tokens[c]) == token), None)
        if node is None:
            break
        depth += 1
    return depth


@pytest.mark.parametrize("name", sorted(FULL_TREES))
def test_target_as_its_own_draft_accepts_its_greedy_path(tiny_target_dir, plain_outputs, name):
    """The target drafting for itself, greedy: every step accepts exactly as deep as the greedy
    continuation runs in the verified tree. Chains and static trees always hold that path, so
    they accept their whole depth (the method's, or what is left). Beams and dynamic trees keep
    the most probable paths, which need not include the greedy one (the tiny model's
    distributions are flat), so for them the check is the greedy path's depth in the tree."""
    method = FULL_TREES[name]
    engine = make_engine(tiny_target_dir, tiny_target_dir, method, planner="fixed")
    verified = {}  # (request, step) -> the verified tree
    select = engine.core.select_trees

    def spy(batch, drafted, now, partners=None):
        trees = select(batch, drafted, now, partners)
        for r in batch.decode:
            verified[r.request_id, r.step] = trees[r.request_id]
        return trees

    engine.core.select_trees = spy
    max_tokens = 20
    ids = [engine.add_request(p, SamplingParams(max_tokens=max_tokens)) for p in PROMPTS]
    expected = dict(zip(ids, plain_outputs, strict=True))
    depths, full = [], 0
    while engine.has_unfinished():
        for out in engine.step():
            tree = verified.get((out.request_id, out.step))
            if tree is None:
                continue  # a prefill
            depth = int(tree.depths().max())
            left = max_tokens - out.offset  # tokens left before this step
            assert depth <= min(method.num_layers, left - 1)
            cont = expected[out.request_id][out.offset :]
            assert out.num_accepted == greedy_depth(tree, cont), (out.request_id, out.step)
            if name in ("chain", "static"):
                assert depth == min(method.num_layers, left - 1)
                assert out.num_accepted == depth
            full += out.num_accepted == depth
            depths.append(depth)
    assert [engine.requests.pop(i).output for i in ids] == plain_outputs
    stats = engine.stats
    assert stats.num_target_forwards == len(depths)
    if name in ("chain", "static"):
        assert stats.num_accepted == sum(depths)
        assert stats.mean_accepted_length >= 3.5
    if name == "chain":
        assert stats.num_accepted == stats.num_draft_tokens
    assert full >= 0.7 * len(depths)  # mostly full trees all the same


def test_a_request_without_speculation_drafts_nothing(tiny_target_dir, plain_outputs):
    engine = make_engine(tiny_target_dir, tiny_target_dir, DraftMethod("chain", k=3))
    drafted: set[str] = set()
    draft = engine.drafter.draft

    def spy(requests, method):
        drafted.update(r.request_id for r in requests)
        return draft(requests, method)

    engine.drafter.draft = spy
    params = SamplingParams(max_tokens=20)
    plain = engine.add_request(PROMPTS[0], params, speculate=False)
    engine.add_request(PROMPTS[1], params)
    while engine.has_unfinished():
        engine.step()
    plain_req = engine.requests.pop(plain)
    spec_req = next(iter(engine.requests.values()))
    assert plain_req.output == plain_outputs[0] and spec_req.output == plain_outputs[1]
    assert plain not in drafted and spec_req.request_id in drafted
    assert plain_req.stats.num_draft_tokens == 0 and plain_req.draft_model is None
    # the engine's draft counters are the speculating request's alone
    stats, spec = engine.stats, spec_req.stats
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted) == (
        spec.num_drafts,
        spec.num_draft_tokens,
        spec.num_accepted,
    )
    assert (
        stats.num_target_forwards == spec.num_target_forwards + plain_req.stats.num_target_forwards
    )


def test_a_named_draft_model_drafts_for_its_request(tiny_target_dir, tiny_draft_dir, plain_outputs):
    target = ModelRunner(load_model(tiny_target_dir), block_size=4, kv_memory_bytes=2 << 20)
    drafters = {
        name: Drafter(ModelRunner(load_model(path), block_size=4, kv_memory_bytes=1 << 20), name)
        for name, path in (("a", tiny_draft_dir), ("b", tiny_target_dir))
    }
    seen: dict[str, set[str]] = {name: set() for name in drafters}
    for name, drafter in drafters.items():

        def spy(requests, method, _name=name, _draft=drafter.draft):
            seen[_name].update(r.request_id for r in requests)
            return _draft(requests, method)

        drafter.draft = spy
    engine = SpecEngine(
        Verifier(target), drafters, DraftMethod("chain", k=3), SchedulerConfig(planner="fixed")
    )
    params = SamplingParams(max_tokens=20)
    with pytest.raises(InvalidRequestError, match="draft model"):
        engine.add_request(PROMPTS[0], params, draft_model="c")
    ra = engine.add_request(PROMPTS[0], params, draft_model="a")
    rb = engine.add_request(PROMPTS[1], params, draft_model="b")
    while engine.has_unfinished():
        engine.step()
    a, b = engine.requests[ra], engine.requests[rb]
    assert [a.output, b.output] == plain_outputs[:2]
    assert seen == {"a": {ra}, "b": {rb}}
    assert set(a.draft_stats) == {"a"} and set(b.draft_stats) == {"b"}
    assert b.draft_stats["b"].acceptance_rate == 1.0  # "b" is the target itself
