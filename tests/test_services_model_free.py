"""Model-free drafters through the services: a drafter replica that loads no model answers its
draft jobs over Redis, alone or beside a model draft (its trees merged with the model's), and
greedy output stays plain greedy decoding, with an acceptance floor."""

from __future__ import annotations

from pathlib import Path

import pytest

from services.drafter.model_free import ModelFreeDrafterService
from services.runtime import ModelPaths
from shared.bus import EmbeddedRedis
from shared.values.sampling import SamplingParams
from tests.test_model_free_engine import COPY_PROMPTS, FLOOR
from tests.test_services_support import plain_greedy, running

pytestmark = pytest.mark.anyio

MAX_TOKENS = 60


async def test_model_free_drafters_alone_keep_greedy_output(
    server: EmbeddedRedis, tiny_target_dir: Path
) -> None:
    models = ModelPaths(tiny_target_dir, {}, model_free=("ngram", "suffix"))
    params = [SamplingParams(max_tokens=MAX_TOKENS) for _ in COPY_PROMPTS]
    expected = plain_greedy(tiny_target_dir, COPY_PROMPTS, params)
    async with running(server.url, "mf-alone", models) as (stack, client):
        assert {type(d) for d in stack.drafters} == {ModelFreeDrafterService}
        ids = [f"a{i}" for i in range(len(COPY_PROMPTS))]
        drafts = ["ngram", "suffix", None]
        for rid, prompt, p, draft in zip(ids, COPY_PROMPTS, params, drafts, strict=True):
            await client.submit(rid, prompt, p, draft_model=draft, app="loops")
        await client.wait(ids)
        scheduler = stack.scheduler
        assert scheduler is not None
        acceptance = scheduler.stats.acceptance
        answered = {d.model: d.stats.requests for d in stack.drafters}
        failed = {d.model: d.consumer.stats.failed for d in stack.drafters}
    for rid, want in zip(ids, expected, strict=True):
        assert client.outcomes[rid].tokens == want
    assert answered["ngram"] > 0 and answered["suffix"] > 0
    assert failed == {"ngram": 0, "suffix": 0}  # every job handled, releases included
    assert acceptance.mean_accepted_length >= FLOOR


async def test_model_free_trees_merged_with_a_model_draft_keep_greedy_output(
    server: EmbeddedRedis, tiny_target_dir: Path, tiny_draft_dir: Path
) -> None:
    models = ModelPaths(tiny_target_dir, {"tiny": tiny_draft_dir}, model_free=("ngram",))
    params = [SamplingParams(max_tokens=MAX_TOKENS) for _ in COPY_PROMPTS]
    expected = plain_greedy(tiny_target_dir, COPY_PROMPTS, params)
    scheduler_settings = {"speculation": {"method": "chain", "chain_length": 3}}
    async with running(server.url, "mf-merged", models, scheduler=scheduler_settings) as (
        stack,
        client,
    ):
        ids = [f"m{i}" for i in range(len(COPY_PROMPTS))]
        for rid, prompt, p in zip(ids, COPY_PROMPTS, params, strict=True):
            await client.submit(rid, prompt, p)
        await client.wait(ids)
        scheduler = stack.scheduler
        assert scheduler is not None
        core = scheduler.core
        assert core.config.merge_drafts == "model-free"  # "auto" with both kinds of draft
        merged = core.num_merged_trees
        acceptance = scheduler.stats.acceptance
        failed = {d.model: d.consumer.stats.failed for d in stack.drafters}
    for rid, want in zip(ids, expected, strict=True):
        assert client.outcomes[rid].tokens == want
    assert merged > 0
    assert failed == {"tiny": 0, "ngram": 0}
    assert acceptance.mean_accepted_length >= FLOOR
