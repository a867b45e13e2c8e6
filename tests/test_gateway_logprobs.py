"""Logprobs, processors and seeds through the HTTP API with the official `openai` client, on the
whole stack with the real SmolLM2 target drafting for itself (speculation on, drafts accepted):
well-formed logprobs for chat and completions, streamed and not (`logprobs: 0` included), equal
to the in-process engine's without speculation; a seeded sample reproduces with speculation off;
a bad processor option is a 400 naming its field."""

from __future__ import annotations

import math
from typing import Any

import openai
import pytest
from openai import AsyncOpenAI

from services.run import start_stack
from services.runtime import ModelPaths
from shared.bus import EmbeddedRedis
from shared.engine.spec_engine import SpecEngine
from shared.engine.verifier import Verifier
from shared.model import load_model
from shared.model.runner import ModelRunner
from shared.values.sampling import SamplingParams
from tests.test_services_openai import QUESTION, chat_prompt, free_port, wait_for_gateway
from tests.test_services_support import make_settings

pytestmark = [pytest.mark.anyio, pytest.mark.smollm2]
MAX_TOKENS = 12
PENALTY = 0.5


def reference(target, prompt: list[int], params: SamplingParams) -> Any:
    runner = ModelRunner(load_model(target), block_size=16, kv_memory_bytes=64 << 20)
    engine = SpecEngine(Verifier(runner), eos_token_ids=runner.cfg.eos_token_ids)
    [request] = engine.generate([prompt], params)
    return request


async def test_logprobs_and_processors_through_the_openai_client(server: EmbeddedRedis) -> None:
    from shared.model.smollm2 import ensure_smollm2

    target = ensure_smollm2()
    port = free_port()
    settings = make_settings(
        server.url,
        "logprobs",
        engine={"block_size": 16, "kv_memory_bytes": 64 << 20},
        scheduler={"speculation": {"method": "chain", "chain_length": 3}},
        gateway={"port": port},
        models={"target_dir": target},
    )
    prompt = chat_prompt(target)
    want = reference(
        target, prompt, SamplingParams(max_tokens=MAX_TOKENS, presence_penalty=PENALTY, logprobs=3)
    )
    stack = await start_stack(settings, server.url, ModelPaths(target, {"self": target}))
    client = AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
    model = settings.gateway.model_name
    chat = {
        "model": model,
        "messages": [{"role": "user", "content": QUESTION}],
        "max_completion_tokens": MAX_TOKENS,
        "temperature": 0,
        "presence_penalty": PENALTY,
    }
    try:
        await wait_for_gateway(client)
        answer = await client.chat.completions.create(**chat, logprobs=True, top_logprobs=3)
        content = answer.choices[0].logprobs.content
        assert len(content) == answer.usage.completion_tokens == len(want.output)
        for entry, logprob, top_ids in zip(
            content, want.logprobs.logprobs, want.logprobs.top_ids, strict=True
        ):
            assert math.isclose(entry.logprob, logprob, abs_tol=1e-4)
            assert entry.bytes == list(entry.token.encode())
            assert len(entry.top_logprobs) == 3 == len(top_ids)
            values = [t.logprob for t in entry.top_logprobs]
            assert values == sorted(values, reverse=True) and entry.logprob <= values[0] + 1e-6
        assert "".join(e.token for e in content) == answer.choices[0].message.content
        assert stack.scheduler is not None
        acceptance = stack.scheduler.stats.acceptance
        assert acceptance.num_drafts > 0 and acceptance.num_accepted > 0

        streamed = []
        async for chunk in await client.chat.completions.create(
            **chat, logprobs=True, top_logprobs=3, stream=True
        ):
            if chunk.choices and chunk.choices[0].logprobs is not None:
                streamed += chunk.choices[0].logprobs.content
        assert [(e.token, round(e.logprob, 4)) for e in streamed] == [
            (e.token, round(e.logprob, 4)) for e in content
        ]
        plain = await client.chat.completions.create(**chat)
        assert plain.choices[0].logprobs is None

        completion = {
            "model": model,
            "prompt": "The three largest cities of France are",
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
            "extra_body": {"ignore_eos": True},
        }
        zero = await client.completions.create(**completion, logprobs=0)
        logprobs = zero.choices[0].logprobs
        assert logprobs is not None  # `logprobs: 0` answers the emitted tokens' own
        assert zero.usage.completion_tokens == MAX_TOKENS
        assert len(logprobs.tokens) == len(logprobs.token_logprobs) == MAX_TOKENS
        assert all(len(top) == 1 for top in logprobs.top_logprobs)
        assert logprobs.text_offset[0] == 0 and logprobs.text_offset == sorted(logprobs.text_offset)
        assert "".join(logprobs.tokens) == zero.choices[0].text
        tokens, offsets = [], []
        async for chunk in await client.completions.create(**completion, logprobs=2, stream=True):
            if chunk.choices and chunk.choices[0].logprobs is not None:
                tokens += chunk.choices[0].logprobs.tokens
                offsets += chunk.choices[0].logprobs.text_offset
        assert tokens == logprobs.tokens and offsets == logprobs.text_offset
        # a stop string ends the output at the token that completed it: logprobs end there too
        stop = logprobs.tokens[4].strip() or logprobs.tokens[4]
        stopped = await client.completions.create(**completion, logprobs=1, stop=[stop])
        cut = stopped.choices[0].logprobs
        assert stopped.choices[0].finish_reason == "stop"
        assert len(cut.tokens) == stopped.usage.completion_tokens <= 5
        assert cut.tokens == logprobs.tokens[: len(cut.tokens)]

        # a seeded sample: the same text with speculation on, again, and off
        seeded = {**chat, "temperature": 0.8, "seed": 7, "max_completion_tokens": 16}
        texts = set()
        for extension in ({}, {}, {"speculate": False}):
            again = await client.chat.completions.create(**seeded, extra_body={"augury": extension})
            texts.add(again.choices[0].message.content)
        assert len(texts) == 1

        for extra, field in (
            ({"logit_bias": {"not-a-token": 1}}, "logit_bias"),
            ({"presence_penalty": 3}, "presence_penalty"),
            ({"top_logprobs": 2}, "top_logprobs"),
        ):
            with pytest.raises(openai.BadRequestError) as error:
                await client.chat.completions.create(**chat, extra_body=extra)
            assert error.value.body["param"] == field
    finally:
        await client.close()
        await stack.stop()
