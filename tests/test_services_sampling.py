"""Logits processors, logprobs and seeded sampling through the services over real Redis: the
options, each step's token history and the logprobs cross every hop (scheduler, drafter,
verifier, back to the client), and what comes back equals the in-process engine without
speculation."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from services.runtime import ModelPaths
from shared.bus import EmbeddedRedis
from shared.engine.spec_engine import SpecEngine
from shared.engine.verifier import Verifier
from shared.model import load_model
from shared.model.runner import ModelRunner
from shared.values.sampling import SamplingParams
from tests.test_services_support import Client, running

pytestmark = pytest.mark.anyio

PROMPTS = [[5, 17, 3, 44], [9, 10, 11, 12, 13, 14, 15, 16], [70]]
PARAMS = [
    SamplingParams(
        max_tokens=18, presence_penalty=0.8, frequency_penalty=0.3, logprobs=3, min_tokens=4
    ),
    SamplingParams(max_tokens=14, repetition_penalty=1.6, logit_bias={"7": 4.0}, logprobs=0),
    SamplingParams(
        temperature=0.9, seed=11, max_tokens=16, min_p=0.05, presence_penalty=0.4, logprobs=2
    ),
]
TREE = {"speculation": {"method": "dynamic", "dynamic_max_nodes": 10, "dynamic_max_depth": 4}}


def plain(target: Path) -> list:
    runner = ModelRunner(load_model(target), block_size=4, kv_memory_bytes=16 << 20)
    engine = SpecEngine(Verifier(runner), eos_token_ids=runner.cfg.eos_token_ids)
    return engine.generate(PROMPTS, PARAMS)


async def submit_all(client: Client, tag: str) -> list[str]:
    ids = [f"{tag}{i}" for i in range(len(PROMPTS))]
    for rid, prompt, params in zip(ids, PROMPTS, PARAMS, strict=True):
        await client.submit(rid, prompt, params)
    await client.wait(ids, timeout_s=300)
    return ids


async def test_processors_logprobs_and_seeds_cross_the_services(
    server: EmbeddedRedis, tiny_target_dir: Path
) -> None:
    want = plain(tiny_target_dir)
    models = ModelPaths(tiny_target_dir, {"self": tiny_target_dir})
    async with running(server.url, "sampling", models, scheduler=TREE) as (stack, client):
        ids = await submit_all(client, "s")
        assert stack.scheduler is not None
        stats = stack.scheduler.core.stats
        # the target drafting for itself with the same processors: most of the depth accepted
        assert stats.num_draft_tokens > 0 and stats.num_accepted >= 0.6 * stats.num_draft_layers
        for rid, expected in zip(ids, want, strict=True):
            outcome = client.outcomes[rid]
            assert outcome.tokens == expected.output, rid
            assert outcome.logprobs is not None and expected.logprobs is not None
            assert len(outcome.logprobs) == len(outcome.tokens)
            torch.testing.assert_close(
                torch.tensor(outcome.logprobs.logprobs),
                torch.tensor(expected.logprobs.logprobs),
                rtol=0,
                atol=1e-4,
            )
            assert outcome.logprobs.top_ids == expected.logprobs.top_ids
