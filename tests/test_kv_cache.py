"""KV cache invariants: after acceptance the cache equals a plain prefill of the committed
tokens; blocks are accounted for; swapping out and in preserves the KV exactly."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.engine.drafting import Drafter
from shared.engine.spec_engine import SpecEngine
from shared.engine.verifier import Verifier
from shared.errors import OutOfKVMemoryError
from shared.model import load_model
from shared.model.kv_cache import BlockAllocator
from shared.model.runner import ForwardItem, ModelRunner
from shared.values.methods import DraftMethod
from shared.values.sampling import SamplingParams


def fresh_prefill_kv(model, tokens):
    runner = ModelRunner(model, block_size=4, kv_memory_bytes=1 << 20)
    runner.add_request("ref")
    runner.prefill({"ref": tokens})
    return runner.cache.gather("ref", len(tokens))


def assert_cache_matches_prefill(runner: ModelRunner, rid: str, tokens: list[int]) -> None:
    assert runner.num_cached(rid) == len(tokens)
    k, v = runner.cache.gather(rid, len(tokens))
    k_ref, v_ref = fresh_prefill_kv(runner.model, tokens)
    torch.testing.assert_close(k, k_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(v, v_ref, atol=1e-5, rtol=1e-5)


def test_compaction_equals_prefill_of_committed_tokens(tiny_target_dir):
    model = load_model(tiny_target_dir)
    runner = ModelRunner(model, block_size=4, kv_memory_bytes=1 << 20)
    runner.add_request("a")
    prompt = [3, 1, 4, 1, 5, 9, 2]
    runner.prefill({"a": prompt[:-1]})
    # root = last prompt token; accept the path 0 -> 2 -> 5 (slots move: 2->1, 5->2)
    tokens = [prompt[-1], 10, 11, 12, 13, 14, 15]
    parents = [-1, 0, 0, 1, 2, 2, 5]
    runner.forward([ForwardItem("a", tokens, parents)])
    runner.commit({"a": [0, 2, 5, 6]})
    assert_cache_matches_prefill(runner, "a", prompt + [11, 14, 15])
    assert runner.tree_size("a") == 0


@pytest.mark.parametrize("kind", ["chain", "static", "beam", "dynamic"])
def test_engine_caches_match_prefill_after_every_step(tiny_target_dir, tiny_draft_dir, kind):
    method = {
        "chain": DraftMethod("chain", k=3),
        "static": DraftMethod("static", expansion=(2, 2)),
        "beam": DraftMethod("beam", depth=3, width=2),
        "dynamic": DraftMethod("dynamic", budget=10, max_size=6, max_depth=4),
    }[kind]
    target = ModelRunner(load_model(tiny_target_dir), block_size=4, kv_memory_bytes=1 << 20)
    draft = ModelRunner(load_model(tiny_draft_dir), block_size=4, kv_memory_bytes=1 << 20)
    engine = SpecEngine(Verifier(target), Drafter(draft), method)
    rids = [engine.add_request(p, SamplingParams(max_tokens=10)) for p in ([1, 2, 3], [7] * 6)]
    while engine.has_unfinished():
        engine.step()
        for rid in rids:
            req = engine.requests[rid]
            if req.finish_reason or req.is_prefilling:
                continue
            # target: every committed token but the root; drafter: as of its last draft step
            assert_cache_matches_prefill(target, rid, req.all_tokens[:-1])
            seen = req.num_seen_by_drafter
            if seen:
                assert_cache_matches_prefill(draft, rid, req.all_tokens[:seen])
    assert target.cache.allocator.num_free == target.cache.num_blocks
    assert draft.cache.allocator.num_free == draft.cache.num_blocks


def test_swap_out_and_in_preserves_kv(tiny_target_dir):
    runner = ModelRunner(load_model(tiny_target_dir), block_size=4, kv_memory_bytes=1 << 20)
    runner.add_request("a")
    tokens = list(range(3, 14))
    runner.prefill({"a": tokens})
    before = runner.cache.gather("a", len(tokens))
    swapped = runner.swap_out("a")
    assert runner.cache.allocator.num_free == runner.cache.num_blocks
    runner.swap_in("a", swapped)
    after = runner.cache.gather("a", len(tokens))
    for x, y in zip(before, after, strict=True):
        assert torch.equal(x, y)
    assert_cache_matches_prefill(runner, "a", tokens)


def test_preemption_under_memory_pressure_keeps_outputs(tiny_target_dir, tiny_draft_dir):
    """A cache too small for all requests at once: requests get swapped, outputs unchanged."""
    prompts = [[i + 3] * 9 for i in range(6)]
    params = SamplingParams(max_tokens=15)

    def run(kv_bytes: int):
        target = ModelRunner(load_model(tiny_target_dir), block_size=4, kv_memory_bytes=kv_bytes)
        draft = ModelRunner(load_model(tiny_draft_dir), block_size=4, kv_memory_bytes=1 << 20)
        engine = SpecEngine(Verifier(target), Drafter(draft), DraftMethod("chain", k=3))
        return [r.output for r in engine.generate(prompts, params)]

    roomy = run(1 << 20)
    tight_blocks = 20  # ~2-3 requests' worth
    per_block = 2 * 2 * 4 * 2 * 16 * 4
    assert run(tight_blocks * per_block) == roomy


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 40), st.booleans(), st.integers(0, 7)), max_size=60))
def test_block_allocator_never_double_allocates(ops):
    """Growth in place or placed, frees in any order: no block is handed out twice, every free
    block can be handed out, and a refused allocation changes nothing."""
    alloc = BlockAllocator(64)
    owned: list[list[int]] = []
    for n, grows, which in ops:
        target = owned[which % len(owned)] if grows and owned else None
        free_before = alloc.num_free
        try:
            blocks = alloc.allocate(n, after=target[-1] if target else None)
        except OutOfKVMemoryError:
            assert alloc.num_free == free_before and n > free_before
            if owned:
                alloc.free(owned.pop(which % len(owned)))
        else:
            assert len(blocks) == n
            if target is not None:
                target.extend(blocks)
            else:
                owned.append(blocks)
        flat = [b for blocks in owned for b in blocks]
        assert len(flat) == len(set(flat))
        assert len(flat) + alloc.num_free == 64
    rest = alloc.allocate(alloc.num_free)  # fragmented or not, all of it
    assert sorted(rest + [b for blocks in owned for b in blocks]) == list(range(64))
    with pytest.raises(ValueError, match="already free"):
        alloc.free([0, 0])
    alloc.free([0])
    with pytest.raises(ValueError, match="already free"):
        alloc.free([0])
    assert alloc.num_free == 1


def test_concurrent_requests_keep_consecutive_blocks(tiny_target_dir, tiny_draft_dir):
    """Requests that decode side by side, each growing a block at a time in turn, still hold
    consecutive blocks in the target's and the drafter's caches (each a view, not a gather, in
    CPU attention): a growing request continues in place, a new one starts in the middle of the
    largest free run. Handing out the lowest free block instead interleaves them."""
    target = ModelRunner(load_model(tiny_target_dir), block_size=4, kv_memory_bytes=1 << 20)
    draft = ModelRunner(load_model(tiny_draft_dir), block_size=4, kv_memory_bytes=1 << 20)
    engine = SpecEngine(Verifier(target), Drafter(draft), DraftMethod("chain", k=3))
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    rids = [engine.add_request([i + 3] * (5 + 3 * i), params) for i in range(6)]
    checked = 0
    while engine.has_unfinished():
        engine.step()
        for runner in (target, draft):
            for rid in rids:
                if not runner.has_request(rid) or not runner.cache.blocks(rid):
                    continue
                blocks = runner.cache.blocks(rid)
                assert blocks == list(range(blocks[0], blocks[0] + len(blocks))), (rid, blocks)
                checked += 1
    assert checked > 100
    assert max(len(r.output) for r in engine.requests.values()) == 40


def test_a_request_alone_keeps_consecutive_blocks(tiny_target_dir):
    """A request that grows, drops a tree and grows again keeps growing in place, and one that
    follows a finished request starts at the first block: consecutive blocks either way (CPU
    attention reads them as a view)."""
    model = load_model(tiny_target_dir)
    # without prefix caching: a finished request's full blocks would be kept for reuse
    runner = ModelRunner(model, block_size=4, kv_memory_bytes=1 << 20, prefix_caching=False)
    cache = runner.cache

    def is_consecutive(rid: str) -> bool:
        blocks = cache.blocks(rid)
        return blocks == list(range(blocks[0], blocks[0] + len(blocks)))

    runner.add_request("a")
    runner.prefill({"a": list(range(3, 13))})
    runner.forward([ForwardItem("a", [20, 21, 22, 23, 24, 25], [-1, 0, 0, 1, 1, 2])])
    assert len(cache.blocks("a")) == 4 and is_consecutive("a")
    runner.discard_tree("a")
    runner.forward([ForwardItem.chain("a", [30, 31, 32, 33, 34, 35, 36])])
    assert len(cache.blocks("a")) == 5 and is_consecutive("a")
    runner.free_request("a")
    runner.add_request("b")
    runner.prefill({"b": list(range(40, 58))})
    assert cache.blocks("b") == [0, 1, 2, 3, 4]
