"""A feature-level (EAGLE-style) draft behind the real services, over real Redis: greedy output
equals plain decoding, a drafter that lost its state mid-request gets every feature it needs
again from the scheduler (which keeps them), and a draft job without features is refused."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from services.drafter.service import DrafterService
from services.run import Stack
from services.runtime import ModelPaths
from shared.bus import EmbeddedRedis
from shared.values.methods import DraftMethod
from shared.values.sampling import SamplingParams
from shared.wire import CandidateTrees, DraftJob, DraftRequest, FinishReason
from tests.test_feature_draft import (  # noqa: F401  (feature_draft_dir: a fixture)
    SPEC,
    feature_draft_dir,
    target_features,
)
from tests.test_services_support import Client, plain_greedy, running, until

pytestmark = pytest.mark.anyio

PROMPTS = [[5, 17, 3, 44], [9, 10, 11, 12, 13, 14, 15, 16], [70], [33, 34, 35, 36, 37, 38]]
CHAIN = {"speculation": {"method": "chain", "chain_length": 3}}


def the_drafter(stack: Stack) -> DrafterService:
    [drafter] = stack.drafters
    assert drafter.drafter.is_feature_level
    assert drafter.runner.cfg.feature_size == SPEC.feature_size
    return drafter


async def stream_until(
    client: Client, predicate: Callable[[], bool], timeout_s: float = 120.0, what: str = ""
) -> None:
    """Read the output streams until the predicate holds."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await client.poll(block_ms=50)


async def test_services_greedy_with_a_feature_draft_equals_plain(
    server: EmbeddedRedis,
    tiny_target_dir: Path,
    feature_draft_dir: Path,  # noqa: F811
) -> None:
    models = ModelPaths(tiny_target_dir, {"e": feature_draft_dir})
    params = [SamplingParams(max_tokens=6 + 5 * i) for i in range(len(PROMPTS))]
    expected = plain_greedy(tiny_target_dir, PROMPTS, params)
    async with running(server.url, "feat-greedy", models, scheduler=CHAIN) as (stack, client):
        assert stack.scheduler is not None
        drafter = the_drafter(stack)
        assert stack.scheduler.core.config.feature_drafts == frozenset({"e"})
        for i, (prompt, p) in enumerate(zip(PROMPTS, params, strict=True)):
            await client.submit(f"f{i}", prompt, p)
        await client.wait([f"f{i}" for i in range(len(PROMPTS))], timeout_s=300)
        for i, want in enumerate(expected):
            outcome = client.outcomes[f"f{i}"]
            assert outcome.tokens == want, f"request {i}"
            assert outcome.finish is FinishReason.LENGTH
        assert drafter.stats.requests > 0
        assert dict(drafter.stats.errors) == {}
        assert stack.scheduler.core.stats.num_draft_tokens > 0
        # finished requests leave neither features in the core nor state in the drafter
        await until(lambda: not stack.scheduler.core.features, what="features dropped")
        await until(
            lambda: not any(drafter.runner.has_request(f"f{i}") for i in range(len(PROMPTS))),
            timeout_s=30,
            what="draft state freed",
        )


async def test_a_drafter_restart_mid_request_recovers_features_and_keeps_greedy_equality(
    server: EmbeddedRedis,
    tiny_target_dir: Path,
    feature_draft_dir: Path,  # noqa: F811
) -> None:
    models = ModelPaths(tiny_target_dir, {"e": feature_draft_dir})
    params = [SamplingParams(max_tokens=40) for _ in PROMPTS]
    expected = plain_greedy(tiny_target_dir, PROMPTS, params)
    ids = [f"k{i}" for i in range(len(PROMPTS))]
    async with running(server.url, "feat-restart", models, scheduler=CHAIN) as (stack, client):
        assert stack.scheduler is not None
        drafter = the_drafter(stack)
        seen: list[DraftRequest | None] = []  # every entry the drafter answered; None: restart
        answer = drafter.answer

        def recording(job: DraftJob) -> CandidateTrees:
            seen.extend(job.entries)
            return answer(job)

        drafter.answer = recording  # type: ignore[method-assign]
        for rid, prompt, p in zip(ids, PROMPTS, params, strict=True):
            await client.submit(rid, prompt, p)

        def drafting_mid_request() -> bool:
            tokens = [len(client.outcomes[r].tokens) for r in ids]
            held = [drafter.drafter.num_committed(r) for r in ids]
            return min(tokens) >= 3 and max(tokens) <= 30 and all(h > 0 for h in held)

        await stream_until(client, drafting_mid_request, what="drafting under way")
        assert dict(drafter.stats.errors) == {}

        def restart() -> tuple[int, int]:
            """On the model thread (between jobs): lose every request's draft state, as a
            drafter process that restarted would."""
            for rid in ids:
                drafter.forget(rid)
            assert not any(drafter.runner.has_request(r) for r in ids)
            assert drafter.runner.cache.allocator.num_free == drafter.runner.cache.num_blocks
            seen.append(None)
            return drafter.stats.requests, stack.scheduler.core.stats.num_draft_tokens

        requests_at_wipe, draft_tokens_at_wipe = await drafter._thread.run(restart)
        unfinished = [r for r in ids if not client.outcomes[r].done]
        assert unfinished, "every request finished before the restart"
        await client.wait(ids, timeout_s=300)
        for rid, want in zip(ids, expected, strict=True):
            assert client.outcomes[rid].tokens == want, rid
            assert client.outcomes[rid].finish is FinishReason.LENGTH
        errors = dict(drafter.stats.errors)
        assert errors.get("out_of_sync", 0) >= 1, errors
        assert "missing_features" not in errors, errors
        assert set(errors) == {"out_of_sync"}, errors
        # drafted again after the restart: more answers than errors, and verified draft tokens
        answered = drafter.stats.requests - requests_at_wipe
        assert answered > errors["out_of_sync"], (answered, errors)
        assert stack.scheduler.core.stats.num_draft_tokens > draft_tokens_at_wipe
    # After the restart each unfinished request was resent from base_len 0 with the target's
    # features at every position before its root: those the verifier computed, not guesses.
    after = seen[seen.index(None) + 1 :]
    resent = {}
    for entry in after:
        assert entry is not None
        if entry.base_len == 0 and entry.request_id not in resent:
            resent[entry.request_id] = entry
    assert set(resent) == set(unfinished)
    for rid, entry in resent.items():
        assert entry.features is not None
        tokens = list(entry.new_tokens)
        assert len(tokens) > len(PROMPTS[ids.index(rid)])  # prompt and output so far
        assert tokens == (PROMPTS[ids.index(rid)] + client.outcomes[rid].tokens)[: len(tokens)]
        want = target_features(tiny_target_dir, tokens[:-1]).to(torch.float16).numpy()
        np.testing.assert_allclose(entry.features, want, atol=2e-2, rtol=2e-2)


async def test_a_draft_job_without_features_is_answered_with_an_error(
    server: EmbeddedRedis,
    tiny_target_dir: Path,
    feature_draft_dir: Path,  # noqa: F811
) -> None:
    models = ModelPaths(tiny_target_dir, {"e": feature_draft_dir})
    prompt = (5, 17, 33, 2, 80, 41)
    greedy = SamplingParams(max_tokens=8)
    chain = DraftMethod("chain", k=3)
    width = SPEC.feature_size
    async with running(server.url, "feat-missing", models, scheduler=CHAIN) as (stack, client):
        drafter = the_drafter(stack)
        bare = DraftRequest("bare", 0, 0, prompt, chain, greedy, 1)
        answer = drafter.draft_job(DraftJob(1, (bare,)))
        assert answer is not None
        [entry] = answer.entries
        assert entry.tree is None
        assert (entry.error or "").startswith("missing_features"), entry.error
        assert not drafter.runner.has_request("bare")
        assert drafter.drafter.num_committed("bare") == 0
        # features of the wrong width are refused the same way (and nothing is committed)
        wrong = np.zeros((len(prompt) - 1, width // 2), dtype=np.float16)
        answer = drafter.draft_job(
            DraftJob(3, (DraftRequest("bare", 1, 0, prompt, chain, greedy, 1, features=wrong),))
        )
        assert answer is not None
        assert (answer.entries[0].error or "").startswith("missing_features")
        assert not drafter.runner.has_request("bare")
        # in one job beside a request with its features: that one is drafted all the same
        feats = np.zeros((len(prompt) - 1, width), dtype=np.float16)
        good = DraftRequest("good", 0, 0, prompt, chain, greedy, 1, features=feats)
        again = DraftRequest("bare", 2, 0, prompt, chain, greedy, 1)
        answer = drafter.draft_job(DraftJob(4, (good, again)))
        assert answer is not None
        by_id = {e.request_id: e for e in answer.entries}
        assert by_id["good"].error is None and by_id["good"].tree is not None
        assert by_id["good"].tree.root_token == prompt[-1]
        assert by_id["good"].tree.num_nodes > 1
        assert (by_id["bare"].error or "").startswith("missing_features")
        assert drafter.drafter.num_committed("good") == len(prompt)
        # later in its life (base_len > 0), a job that lost its features: refused, state kept
        lost = DraftRequest("good", 1, len(prompt), (7,), chain, greedy, 1)
        answer = drafter.draft_job(DraftJob(5, (lost,)))
        assert answer is not None
        assert (answer.entries[0].error or "").startswith("missing_features")
        assert drafter.drafter.num_committed("good") == len(prompt)
        one = np.zeros((1, width), dtype=np.float16)
        found = DraftRequest("good", 2, len(prompt), (7,), chain, greedy, 1, features=one)
        answer = drafter.draft_job(DraftJob(6, (found,)))
        assert answer is not None and answer.entries[0].error is None
        assert answer.entries[0].tree is not None and answer.entries[0].tree.root_token == 7
        assert drafter.drafter.num_committed("good") == len(prompt) + 1
        assert drafter.stats.errors["missing_features"] == 4
        drafter.forget("good")
        # the service keeps serving, speculating with the feature draft
        [want] = plain_greedy(tiny_target_dir, [list(prompt)], [SamplingParams(max_tokens=12)])
        await client.submit("after", prompt, SamplingParams(max_tokens=12))
        await client.wait(["after"], timeout_s=300)
        assert client.outcomes["after"].tokens == want
        assert stack.scheduler is not None
        assert stack.scheduler.core.stats.num_draft_tokens > 0
        assert drafter.stats.errors["missing_features"] == 4  # none from the real traffic
        assert drafter.consumer.crashed is None
