"""The scheduler service's core with the verifier's prefix cache in view (`PrefixIndex`): the
token budget is charged only for the tokens the verifier must compute, a prefix shared by
requests arriving together is computed once, and a verifier that lost its cache still answers
right. The core is built as the service builds it and driven as the service drives it (its
`verify_requests`), against a real verifier on the tiny target."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest

from shared.engine.spec_engine import SpecEngine
from shared.engine.verifier import Verifier
from shared.model import load_model
from shared.model.runner import ModelRunner
from shared.scheduling.core import SchedulerCore
from shared.scheduling.executor import step_results, verify_requests
from shared.scheduling.factory import TargetInfo, build_core
from shared.scheduling.prefix_index import PrefixIndex
from shared.scheduling.request import RequestState
from shared.settings import AugurySettings
from shared.values.sampling import SamplingParams
from tests.test_services_support import plain_greedy

BLOCK = 4
IDS = itertools.count()
BUDGET = 16


def make_core(runner: ModelRunner, caching: bool, budget: int = BUDGET) -> SchedulerCore:
    settings = AugurySettings(
        engine={
            "block_size": BLOCK,
            "max_tokens_per_step": budget,
            "enable_prefix_caching": caching,
        },
    )
    cfg = runner.cfg
    target = TargetInfo(cfg.vocab_size, 256, tuple(cfg.eos_token_ids))
    return build_core(settings, target, [], cost=None)


def make_verifier(target: Path) -> Verifier:
    runner = ModelRunner(load_model(target), block_size=BLOCK, kv_memory_bytes=4 << 20)
    return Verifier(runner)


def step(core: SchedulerCore, verifier: Verifier, now: float) -> tuple[int, int]:
    """One micro-batch as the scheduler service runs it: (tokens charged, prompt tokens the
    verifier computed)."""
    batch = core.next_batch(now)
    assert batch is not None
    trees = core.select_trees(batch, {}, now)
    before = verifier.runner.num_tokens_forwarded
    answers = verifier.step(verify_requests(core, batch, trees))
    computed = verifier.runner.num_tokens_forwarded - before - len(batch.decode)
    results = step_results(answers)
    core.observe(batch, results, now)
    for release in core.take_releases():
        verifier.free(release.request_id)
    return batch.prefill_tokens, computed


def run(
    core: SchedulerCore, verifier: Verifier, prompts: Sequence[list[int]], params: SamplingParams
) -> tuple[list[tuple[int, int]], list[RequestState]]:
    requests = [RequestState(f"r{next(IDS)}", p, params, seed=0) for p in prompts]
    for r in requests:
        core.add(r)
    steps = []
    while core.has_unfinished():
        steps.append(step(core, verifier, float(len(steps))))
    return steps, requests


@pytest.fixture(scope="module")
def prompts(tiny_target_dir: Path) -> tuple[list[int], list[int], list[int]]:
    vocab = load_model(tiny_target_dir).cfg.vocab_size
    rng = np.random.default_rng(0)
    shared = rng.integers(3, vocab, 40).tolist()
    a = shared + rng.integers(3, vocab, 6).tolist()
    b = shared + rng.integers(3, vocab, 9).tolist()
    return shared, a, b


@pytest.mark.parametrize("caching", [True, False])
def test_the_budget_is_charged_only_for_uncached_tokens(
    tiny_target_dir: Path, prompts: tuple[list[int], list[int], list[int]], caching: bool
) -> None:
    _, a, b = prompts
    verifier = make_verifier(tiny_target_dir)
    core = make_core(verifier.runner, caching)
    params = SamplingParams(max_tokens=3)
    run(core, verifier, [a], params)
    steps, [second] = run(core, verifier, [b], params)
    prefill = [s for s in steps if s[1] > 0]
    if caching:
        # the 40 shared tokens are 10 full blocks the verifier holds: one step computes the
        # other 9, and charges 9 to the budget of 16
        assert prefill == [(9, 9)]
        assert second.num_cached_prompt_tokens == 40
    else:  # without the index every chunk is charged whole though the verifier finds the
        # blocks of each chunk that starts on a block boundary but the one holding the chunk's
        # last token: 4 + 4 + 8 + 1 computed
        assert prefill == [(16, 4), (16, 4), (16, 8), (1, 1)]
        assert second.num_cached_prompt_tokens == 32
    assert second.output == plain_greedy(tiny_target_dir, [b], [params])[0]


@pytest.mark.parametrize("caching", [True, False])
def test_requests_arriving_together_compute_their_shared_prefix_once(
    tiny_target_dir: Path, prompts: tuple[list[int], list[int], list[int]], caching: bool
) -> None:
    _, a, b = prompts
    verifier = make_verifier(tiny_target_dir)
    core = make_core(verifier.runner, caching, budget=128)
    params = SamplingParams(max_tokens=3)
    steps, requests = run(core, verifier, [a, b], params)
    computed = sum(c for _, c in steps)  # prompt tokens
    assert computed == len(a) + len(b) - (40 if caching else 0)
    assert [r.output for r in requests] == plain_greedy(tiny_target_dir, [a, b], [params] * 2)


def test_a_verifier_that_lost_its_cache_still_computes_what_it_must(
    tiny_target_dir: Path, prompts: tuple[list[int], list[int], list[int]]
) -> None:
    """The index expects the shared prefix cached; a restarted verifier (empty cache) computes
    it all, answers right, and the index agrees with it again afterwards."""
    _, a, b = prompts
    verifier = make_verifier(tiny_target_dir)
    core = make_core(verifier.runner, True)
    params = SamplingParams(max_tokens=3)
    run(core, verifier, [a], params)
    verifier = make_verifier(tiny_target_dir)  # restarted: nothing cached
    steps, [second] = run(core, verifier, [b], params)
    assert [s for s in steps if s[1] > 0] == [(9, 49)]  # charged 9, computed all 49
    assert second.num_cached_prompt_tokens == 0
    assert second.output == plain_greedy(tiny_target_dir, [b], [params])[0]
    steps, [third] = run(core, verifier, [b], params)  # cached now, for real
    assert third.num_cached_prompt_tokens == 48


def test_index_names_blocks_as_the_verifier_does() -> None:
    index = PrefixIndex(4, max_blocks=3)
    tokens = list(range(20))
    assert index.cached_tokens(tokens, 0, 20) == 0
    index.insert(tokens, 13)  # three full blocks
    assert index.cached_tokens(tokens, 0, 20) == 12
    assert index.cached_tokens(tokens, 0, 9) == 8  # never the chunk's last token
    assert index.cached_tokens(tokens, 4, 20) == 8  # from a block boundary
    assert index.cached_tokens(tokens, 2, 20) == 0  # not from inside a block
    assert index.cached_tokens([99, *tokens[1:]], 0, 20) == 0  # chained: block 0 differs
    index.insert(list(range(100, 108)), 8)  # two more: the least recently used go
    assert len(index) == 3
    assert index.cached_tokens(tokens, 0, 20) == 0
    index.mark_pending(7, tokens, 0, 10)
    assert index.pending_at(tokens, 0) and index.pending_at(tokens, 4)
    assert not index.pending_at(tokens, 8)  # the chunk ends inside that block
    index.clear_pending(7)
    assert not index.pending_at(tokens, 0)


def test_the_engine_computes_a_prefix_shared_by_requests_arriving_together_once(
    tiny_target_dir: Path, prompts: tuple[list[int], list[int], list[int]]
) -> None:
    _, a, b = prompts
    verifier = make_verifier(tiny_target_dir)
    engine = SpecEngine(verifier, eos_token_ids=verifier.runner.cfg.eos_token_ids)
    params = SamplingParams(max_tokens=3)
    outputs = engine.generate([a, b], [params, params])
    assert [o.output for o in outputs] == plain_greedy(tiny_target_dir, [a, b], [params] * 2)
    assert [o.num_cached_prompt_tokens for o in outputs] == [0, 40]
    decoded = sum(len(o.output) - 1 for o in outputs)
    assert verifier.runner.num_tokens_forwarded - decoded == len(a) + len(b) - 40
