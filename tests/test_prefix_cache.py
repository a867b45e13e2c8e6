"""Prefix caching: shared blocks are found, never written twice, and change no output."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from shared.engine.drafting import Drafter
from shared.engine.spec_engine import SpecEngine
from shared.engine.verifier import Verifier
from shared.errors import OutOfKVMemoryError
from shared.model import load_model
from shared.model.kv_cache import BlockAllocator, block_bytes
from shared.model.prefix_cache import PrefixCache
from shared.model.runner import ForwardItem, ModelRunner
from shared.scheduling.config import SchedulerConfig
from shared.values.blocks import block_hashes
from shared.values.methods import DraftMethod
from shared.values.sampling import SamplingParams
from shared.values.steps import VerifyRequest
from tests.conftest import make_tiny_checkpoint
from tests.small_vocab import VOCAB, exact_joint
from tests.stats import P_VALUE_FLOOR, fit_p_value
from tests.test_feature_draft import feature_draft_dir  # noqa: F401  (a fixture)

BLOCK = 4
FULL_TREES = {
    "chain": DraftMethod("chain", k=3),
    "static": DraftMethod("static", expansion=(2, 2, 1)),
    "beam": DraftMethod("beam", depth=3, width=2),
    "dynamic": DraftMethod("dynamic", budget=12, max_size=8, max_depth=4, max_width=3),
}
SHARED = [7, 3, 19, 40, 41, 8, 8, 2, 30, 31, 32, 5, 6, 70, 71, 12, 13, 9]  # 4 full blocks + 2
PROMPTS = [SHARED + [50, 51, 52], SHARED + [60], SHARED[:9] + [33, 34], SHARED + [50, 51, 52]]


def make_engine(
    target_dir,
    draft_dir,
    method: DraftMethod | None,
    *,
    caching: bool,
    target_kv_bytes: int = 2 << 20,
    **cfg,
) -> SpecEngine:
    target = ModelRunner(
        load_model(target_dir),
        block_size=BLOCK,
        kv_memory_bytes=target_kv_bytes,
        prefix_caching=caching,
    )
    drafter = None
    if method is not None:
        draft = ModelRunner(
            load_model(draft_dir), block_size=BLOCK, kv_memory_bytes=1 << 20, prefix_caching=caching
        )
        drafter = Drafter(draft)
    return SpecEngine(Verifier(target), drafter, method, SchedulerConfig(**cfg))


def one_after_another(engine: SpecEngine, prompts, params) -> list[list[int]]:
    return [engine.generate([p], params)[0].output for p in prompts]


@pytest.fixture(scope="module")
def plain(tiny_target_dir) -> dict[str, list[list[int]]]:
    """Plain greedy decoding without any cache: the reference."""
    params = SamplingParams(max_tokens=12)
    engine = make_engine(tiny_target_dir, None, None, caching=False)
    return {
        "together": [r.output for r in engine.generate(PROMPTS, params)],
        "one_by_one": one_after_another(engine, PROMPTS, params),
    }


# ---- the allocator and the index ---------------------------------------------------------------


class AllocatorMachine(RuleBasedStateMachine):
    """Requests allocate, share named blocks, free; blocks are named and evicted under them."""

    def __init__(self) -> None:
        super().__init__()
        self.alloc = BlockAllocator(12, max_kept=5)
        self.index = PrefixCache(self.alloc, BLOCK)
        self.evicted: list[int] = []
        forget = self.alloc.on_evict
        assert forget is not None

        def on_evict(block: int) -> None:
            assert self.alloc.refs(block) == 0, "evicted a block a request holds"
            self.evicted.append(block)
            del self.names[block]
            forget(block)

        self.alloc.on_evict = on_evict
        self.held: dict[int, list[int]] = {}  # request -> blocks, first ones possibly shared
        self.names: dict[int, bytes] = {}  # named block -> its name
        self.next_id = 0
        self.next_name = 0

    @rule(n=st.integers(1, 5), extend=st.booleans())
    def allocate(self, n: int, extend: bool) -> None:
        before = (self.alloc.num_free, self.alloc.num_kept)
        truly_free = before[0] - before[1]
        self.evicted.clear()
        owner = next(iter(self.held), None) if extend else None
        after = self.held[owner][-1] if owner is not None and self.held[owner] else None
        try:
            blocks = self.alloc.allocate(n, after=after)
        except OutOfKVMemoryError:
            assert n > before[0]
            assert (self.alloc.num_free, self.alloc.num_kept) == before  # nothing changed
            return
        for block in blocks:  # handed out: never one a request holds, nor a named one
            assert all(block not in held for held in self.held.values())
            assert block not in self.names
        assert len(self.evicted) == max(0, n - truly_free)  # kept blocks go only when needed
        if owner is not None:
            self.held[owner].extend(blocks)
        else:
            self.held[self.next_id] = blocks
            self.next_id += 1

    @precondition(lambda self: self.held)
    @rule(which=st.integers(0, 100))
    def name_first_block(self, which: int) -> None:
        rid = list(self.held)[which % len(self.held)]
        blocks = self.held[rid]
        if not blocks or blocks[0] in self.names:
            return
        name = self.next_name.to_bytes(8, "little")
        self.next_name += 1
        assert self.index.insert(name, blocks[0])
        self.names[blocks[0]] = name
        assert not self.index.insert(name, blocks[0])  # a name has one block

    @precondition(lambda self: self.names)
    @rule(which=st.integers(0, 100))
    def share(self, which: int) -> None:
        """A new request finds a named block (held or kept) and takes it as its first."""
        block, name = list(self.names.items())[which % len(self.names)]
        assert self.index.lookup([name]) == [block]
        self.alloc.acquire([block])
        self.held[self.next_id] = [block]
        self.next_id += 1

    @precondition(lambda self: self.held)
    @rule(which=st.integers(0, 100))
    def free(self, which: int) -> None:
        rid = list(self.held)[which % len(self.held)]
        self.evicted.clear()
        self.alloc.free(self.held.pop(rid))
        assert len(self.evicted) <= 1 or self.alloc.num_kept == self.alloc.max_kept

    @invariant()
    def counts_agree(self) -> None:
        holders = [0] * self.alloc.num_blocks
        for blocks in self.held.values():
            assert len(set(blocks)) == len(blocks)
            for block in blocks:
                holders[block] += 1
        for block in range(self.alloc.num_blocks):
            assert self.alloc.refs(block) == holders[block]
        kept = set(self.alloc._kept)
        free = {b for b in range(self.alloc.num_blocks) if self.alloc._is_free[b]}
        held = {b for b in range(self.alloc.num_blocks) if holders[b]}
        assert not free & held and not free & kept and not kept & held
        assert free | held | kept == set(range(self.alloc.num_blocks))
        assert self.alloc.num_free == len(free) + len(kept)
        assert len(kept) <= self.alloc.max_kept
        assert kept <= set(self.names)  # only named blocks are kept
        for block, name in self.names.items():  # a named block is held or kept, never free
            assert block not in free
            assert self.index.lookup([name]) == [block]

    @invariant()
    def shared_blocks_are_named(self) -> None:
        """A block two requests hold is a named (full, committed) one: nobody writes it."""
        for block in range(self.alloc.num_blocks):
            if self.alloc.refs(block) > 1:
                assert block in self.names


AllocatorMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=40, deadline=None
)
TestAllocatorMachine = AllocatorMachine.TestCase


def test_names_chain_over_every_block_before():
    a = block_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9], BLOCK)
    b = block_hashes([1, 2, 3, 5, 5, 6, 7, 8], BLOCK)
    assert len(a) == 2 and a[0] != b[0] and a[1] != b[1]  # same second block, other first
    assert block_hashes([1, 2, 3, 4, 5, 6, 7, 8], BLOCK, first=1, parent=a[0]) == a[1:]
    assert block_hashes([1, 2, 3, 4], BLOCK, salt=b"x") != a[:1]


# ---- the runner ------------------------------------------------------------------------------


def test_cached_prefix_gives_the_logits_of_a_full_prefill(tiny_target_dir):
    """A request that finds its first blocks cached computes only the rest, over a block table
    that is not one run (the CPU attention gathers), and gets the same logits."""
    model = load_model(tiny_target_dir)
    runner = ModelRunner(model, block_size=BLOCK, kv_memory_bytes=1 << 20)
    fresh = ModelRunner(model, block_size=BLOCK, kv_memory_bytes=1 << 20, prefix_caching=False)
    prompt = SHARED + [50, 51]
    runner.add_request("a")
    runner.prefill({"a": SHARED[:13]})  # its 4th block, partial, stays its own
    runner.add_request("b")
    hit = runner.attach_prefix("b", prompt, len(prompt) - 1)
    assert hit == 12 and runner.cache.prefix.hits == 12
    forwarded = runner.num_tokens_forwarded
    cached_logits = runner.forward([ForwardItem.chain("b", prompt[hit:], logits="all")])[0]
    assert runner.num_tokens_forwarded - forwarded == len(prompt) - hit
    blocks = runner.cache.blocks("b")
    assert blocks != list(range(blocks[0], blocks[0] + len(blocks)))  # not one run
    fresh.add_request("b")
    full_logits = fresh.forward([ForwardItem.chain("b", prompt, logits="all")])[0]
    torch.testing.assert_close(cached_logits, full_logits[hit:], rtol=1e-4, atol=1e-4)


def _prompt_entry(request_id: str, prompt: list[int], *, features: bool) -> VerifyRequest:
    params = SamplingParams(max_tokens=4)
    chunk = tuple(prompt)
    return VerifyRequest(
        request_id, 0, params, 0, 4, chunk=chunk, chunk_is_last=True, want_features=features
    )


def test_a_feature_request_finds_the_blocks_and_their_features(tiny_target_dir):
    """The target keeps the features it computed with the blocks they fill: a second request
    for features finds the shared blocks and gets the same features as the first computed. A
    block committed without features is found only by requests that want none."""
    verifier = Verifier(ModelRunner(load_model(tiny_target_dir), block_size=BLOCK))
    prompt = SHARED + [50, 51]
    (first,) = verifier.step([_prompt_entry("a", prompt, features=True)])
    (second,) = verifier.step([_prompt_entry("b", prompt, features=True)])
    assert first.cached_tokens == 0 and second.cached_tokens == 16  # the full blocks of 19
    assert second.features.shape == first.features.shape == (len(prompt), 64)
    np.testing.assert_allclose(second.features, first.features, atol=2e-3)
    assert second.accepted == first.accepted and second.bonus == first.bonus

    other = [9, 9, 1, 2, 3, 4, 5, 6, 7, 8, 10]
    (plain,) = verifier.step([_prompt_entry("p", other, features=False)])
    (wanting,) = verifier.step([_prompt_entry("q", other, features=True)])
    (not_wanting,) = verifier.step([_prompt_entry("r", other, features=False)])
    assert wanting.cached_tokens == 0 and not_wanting.cached_tokens == 8
    (again,) = verifier.step([_prompt_entry("s", other, features=True)])  # q kept them
    assert again.cached_tokens == 8
    np.testing.assert_allclose(again.features, wanting.features, atol=2e-3)


def test_without_a_prefix_cache_no_features_are_held(tiny_target_dir):
    """Features are held only until their blocks are named: with caching off, never."""
    runner = ModelRunner(load_model(tiny_target_dir), block_size=BLOCK, prefix_caching=False)
    (result,) = Verifier(runner).step([_prompt_entry("a", SHARED, features=True)])
    assert result.features is not None and len(result.features) == len(SHARED)
    assert runner._seqs["a"].feature_rows is None


def test_a_blocks_features_go_when_it_is_evicted():
    allocator = BlockAllocator(4)
    cache = PrefixCache(allocator, BLOCK)
    (name,) = block_hashes([1, 2, 3, 4], BLOCK)
    block = allocator.allocate(1)[0]
    cache.insert(name, block)
    rows = np.ones((BLOCK, 3), dtype=np.float16)
    cache.set_features(name, rows)
    cache.set_features(name, rows * 2)  # equal names, equal features: the first stay
    assert (cache.features_of(block) == 1).all()
    with pytest.raises(ValueError, match="4 rows"):
        cache.set_features(name, rows[:2])
    allocator.free([block])
    allocator.allocate(4)  # needs the kept block: evicted
    assert cache.features_of(block) is None and cache.lookup([name]) == []


def test_two_holders_then_eviction_under_pressure(tiny_target_dir):
    """A block is shared by two requests; once neither holds it, it is kept until an
    allocation needs it, then forgotten."""
    model = load_model(tiny_target_dir)
    per_block = block_bytes(model.cfg, BLOCK, torch.float32)
    runner = ModelRunner(model, block_size=BLOCK, kv_memory_bytes=8 * per_block)
    runner.add_request("a")
    runner.prefill({"a": SHARED[:9]})
    runner.add_request("b")
    assert runner.attach_prefix("b", SHARED[:9], 8) == 8
    shared = runner.cache.blocks("a")[:2]
    assert runner.cache.blocks("b") == shared
    assert [runner.cache.allocator.refs(b) for b in shared] == [2, 2]
    assert runner.cache.num_blocks_alone("a") == 1  # its partial third block
    runner.free_request("a")
    runner.free_request("b")
    assert runner.cache.allocator.num_kept == 2 and runner.cache.allocator.num_free == 8
    runner.add_request("c")
    runner.prefill({"c": list(range(50, 78))})  # 7 blocks: one kept block is evicted
    assert runner.cache.allocator.num_kept == 1
    runner.add_request("d")
    assert runner.attach_prefix("d", SHARED[:9], 8) == 0  # the first block went: no prefix


def test_max_kept_fraction_zero_keeps_nothing(tiny_target_dir):
    runner = ModelRunner(
        load_model(tiny_target_dir), block_size=BLOCK, kv_memory_bytes=1 << 20, max_kept_fraction=0
    )
    runner.add_request("a")
    runner.prefill({"a": SHARED})
    runner.add_request("b")
    assert runner.attach_prefix("b", SHARED, len(SHARED) - 1) == 16  # shared while held
    runner.free_request("a")
    runner.free_request("b")
    runner.add_request("c")
    assert runner.attach_prefix("c", SHARED, len(SHARED) - 1) == 0
    assert runner.cache.allocator.num_free == runner.cache.num_blocks


# ---- the engine: outputs unchanged ---------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(FULL_TREES))
def test_greedy_equal_with_cache_on_and_off(tiny_target_dir, plain, name):
    """Every speculation method, requests sharing prefixes together and one after another:
    the outputs of plain decoding; the draft (the target itself, so every draft token should
    be accepted) keeps full acceptance, so its cached KV is right too."""
    params = SamplingParams(max_tokens=12)
    engine = make_engine(tiny_target_dir, tiny_target_dir, FULL_TREES[name], caching=True)
    assert [r.output for r in engine.generate(PROMPTS, params)] == plain["together"]
    assert one_after_another(engine, PROMPTS, params) == plain["one_by_one"]
    assert engine.stats.mean_accepted_length > 3.0  # acceptance floor
    target, draft = engine.verifier.runner, engine.drafter.runner
    assert target.cache.prefix.hits >= 3 * 16  # the last three prompts of the second round
    assert draft.cache.prefix.hits >= 3 * 16
    assert target.cache.allocator.num_free == target.cache.num_blocks
    assert draft.cache.allocator.num_free == draft.cache.num_blocks


def test_cached_tokens_are_prefilled_and_not_computed(tiny_target_dir, plain):
    """The second round computes only the uncached suffixes; the core counts the hits as
    prefilled (its budget) and reports them per request."""
    params = SamplingParams(max_tokens=12)
    on = make_engine(tiny_target_dir, None, None, caching=True, max_tokens_per_step=8)
    off = make_engine(tiny_target_dir, None, None, caching=False, max_tokens_per_step=8)
    for engine in (on, off):
        engine.generate([PROMPTS[0]], params)
    computed = {}
    for label, engine in (("on", on), ("off", off)):
        before = engine.verifier.runner.num_tokens_forwarded
        ids = [engine.add_request(p, params) for p in PROMPTS[1:]]
        while engine.has_unfinished():
            engine.step()
        outputs = [engine.requests[i].output for i in ids]
        assert outputs == plain["together"][1:]
        computed[label] = engine.verifier.runner.num_tokens_forwarded - before
        cached = [engine.requests[i].num_cached_prompt_tokens for i in ids]
        assert cached == ([16, 8, 20] if label == "on" else [0, 0, 0])
    assert computed["off"] - computed["on"] == 16 + 8 + 20


def test_multi_turn_conversation_reuses_its_history(tiny_target_dir):
    params = SamplingParams(max_tokens=10)
    engine = make_engine(tiny_target_dir, tiny_target_dir, FULL_TREES["chain"], caching=True)
    first = engine.generate([SHARED], params)[0]
    history = SHARED + first.output
    second = engine.generate([history + [44, 45]], params)[0]
    # the first turn's last token was emitted, never forwarded: its KV is not there
    assert second.num_cached_prompt_tokens == ((len(history) - 1) // BLOCK) * BLOCK
    reference = make_engine(tiny_target_dir, None, None, caching=False)
    assert second.output == reference.generate([history + [44, 45]], params)[0].output


@pytest.mark.parametrize("kv_blocks", [14, 20])
def test_preemption_swap_and_recompute_with_shared_prefixes(tiny_target_dir, kv_blocks):
    """A cache too small for every request at once: requests sharing blocks are swapped out
    (copying their shared blocks out, leaving the others' alone) and back; outputs unchanged."""
    prompts = [SHARED[:10] + [i + 3] * 3 for i in range(6)]
    params = SamplingParams(max_tokens=15)
    model = load_model(tiny_target_dir)
    per_block = block_bytes(model.cfg, BLOCK, torch.float32)
    reference = make_engine(tiny_target_dir, None, None, caching=False, target_kv_bytes=4 << 20)
    expected = [r.output for r in reference.generate(prompts, params)]
    engine = make_engine(
        tiny_target_dir,
        tiny_target_dir,
        FULL_TREES["chain"],
        caching=True,
        target_kv_bytes=kv_blocks * per_block,
    )
    assert [r.output for r in engine.generate(prompts[:1], params)] == expected[:1]
    assert [r.output for r in engine.generate(prompts[1:], params)] == expected[1:]
    assert engine.core.preemptions["swapped"] > 0
    assert engine.verifier.runner.cache.prefix.hits > 0
    runner = engine.verifier.runner
    assert runner.cache.allocator.num_free == runner.cache.num_blocks


# ---- sampling stays lossless ---------------------------------------------------------------------

OUT_LEN = 3


def test_sampled_outputs_with_a_cached_prefix_follow_target(tmp_path_factory):
    """Requests whose prompt's first blocks come from the cache (the target's and the draft's)
    sample the target's distribution: chi-square against the exact joint of 3 tokens."""
    target = make_tiny_checkpoint(
        tmp_path_factory.mktemp("pc_target"), seed=3, vocab_size=VOCAB, hidden_size=32
    )
    draft = make_tiny_checkpoint(
        tmp_path_factory.mktemp("pc_draft"), seed=4, vocab_size=VOCAB, hidden_size=16, num_layers=1
    )
    prompt = [1, 4, 2, 0, 3, 5, 1, 1, 2, 4]  # two full blocks, cached after the first request
    num_requests = 2000
    engine = make_engine(
        target,
        draft,
        DraftMethod("static", expansion=(2, 2)),
        caching=True,
        target_kv_bytes=8 << 20,
        max_running_requests=num_requests,
    )
    warm = SamplingParams(temperature=0.9, seed=0, max_tokens=OUT_LEN)
    engine.generate([prompt], warm)
    params = [
        SamplingParams(temperature=0.9, seed=s, max_tokens=OUT_LEN) for s in range(num_requests)
    ]
    reqs = engine.generate([prompt] * num_requests, params)
    assert all(r.num_cached_prompt_tokens == 8 for r in reqs)
    assert engine.stats.num_draft_tokens > 0
    assert engine.drafter.runner.cache.prefix.hits >= 8 * num_requests
    outcomes = [tuple(r.output) for r in reqs]
    joint = exact_joint(target, prompt, OUT_LEN, params[0])
    assert fit_p_value(outcomes, joint) > P_VALUE_FLOOR
    assert len(outcomes[0]) == OUT_LEN


# ---- a feature-level draft -----------------------------------------------------------------------


def test_a_feature_draft_drafts_over_a_cached_prefix_as_over_a_computed_one(
    tiny_target_dir,
    feature_draft_dir,  # noqa: F811
    plain,
):
    """The feature-level draft caches its own entries (named with the request's first token:
    each reads the target's feature before it); the target keeps its features with its blocks.
    Second-round requests find the target's and the draft's blocks and draft the same trees as
    without the cache: the same tokens accepted, step by step."""
    params = SamplingParams(max_tokens=12)
    accepted = {}
    for caching in (False, True):
        target = ModelRunner(
            load_model(tiny_target_dir),
            block_size=BLOCK,
            kv_memory_bytes=2 << 20,
            prefix_caching=caching,
        )
        model = load_model(feature_draft_dir, target_path=tiny_target_dir)
        draft = ModelRunner(
            model, block_size=BLOCK, kv_memory_bytes=1 << 20, prefix_caching=caching
        )
        engine = SpecEngine(
            Verifier(target),
            Drafter(draft, name="draft-e"),
            DraftMethod("chain", k=3),
            SchedulerConfig(planner="fixed"),
        )
        outputs = one_after_another(engine, PROMPTS, params)
        assert outputs == plain["one_by_one"]
        assert engine.stats.num_draft_tokens > 0
        accepted[caching] = list(engine.stats.accepted_per_position)
        if caching:  # entries of tokens 1..16 for the 2nd and 4th prompts, 1..8 for the 3rd
            assert draft.cache.prefix.hits >= 16 + 8 + 16
            assert target.cache.prefix.hits >= 16 + 8 + 16  # features found with the blocks
    assert accepted[True] == accepted[False]


def test_a_chunked_prompt_picks_up_blocks_committed_since_its_admission(tiny_target_dir):
    """Two requests sharing a prefix arrive together under a small token budget: the second is
    admitted while the first is mid-prompt, finds the blocks committed so far, and its later
    chunks (on block boundaries) find the ones committed since; outputs unchanged."""
    prompts = [SHARED + [50, 51, 52], SHARED + [60, 61]]
    params = SamplingParams(max_tokens=6)
    reference = make_engine(tiny_target_dir, None, None, caching=False, max_tokens_per_step=5)
    expected = [r.output for r in reference.generate(prompts, params)]
    engine = make_engine(tiny_target_dir, None, None, caching=True, max_tokens_per_step=5)
    ids = [engine.add_request(p, params) for p in prompts]
    while engine.has_unfinished():
        engine.step()
    assert [engine.requests[i].output for i in ids] == expected
    first, second = (engine.requests[i] for i in ids)
    assert first.num_cached_prompt_tokens == 0
    assert second.num_cached_prompt_tokens == 16  # every full block of the shared prefix
    forwarded = engine.verifier.runner.num_tokens_forwarded
    assert reference.verifier.runner.num_tokens_forwarded - forwarded == 16


def test_the_planner_charges_a_new_drafter_only_the_uncached_prompt():
    """A drafter new to a request is charged for the committed tokens past the prefix the
    target found cached (its own cache holds the same blocks; a feature-level draft's too,
    since the target keeps the features with its blocks); a drafter that has seen some tokens,
    for what it has not seen."""
    from shared.scheduling.core import CoreConfig, SchedulerCore
    from shared.scheduling.request import RequestState

    core = SchedulerCore(
        CoreConfig(vocab_size=96, max_context=256, feature_drafts=frozenset({"e"}))
    )
    request = RequestState("r", SHARED + [50, 51], SamplingParams(max_tokens=4), seed=0)
    request.num_cached_prompt_tokens = 16
    assert core.planner.drafter_backlog(request) == 20 - 16
    request.num_seen_by_drafter = 18
    assert core.planner.drafter_backlog(request) == 2
