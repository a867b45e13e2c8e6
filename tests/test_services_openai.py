"""The official `openai` client against the whole stack on the real SmolLM2 target: gateway,
scheduler, verifier and drafter in one process, every message through (embedded) Redis."""

from __future__ import annotations

import asyncio
import socket
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
from openai import AsyncOpenAI

from services.run import start_stack
from services.runtime import ModelPaths
from shared.bus import EmbeddedRedis
from shared.model.model_set import draft_dirs
from shared.values.sampling import SamplingParams
from tests.conftest import make_tiny_checkpoint
from tests.test_services_support import describe, make_settings, plain_greedy

pytestmark = [pytest.mark.anyio, pytest.mark.smollm2]
QUESTION = "What is the capital of France? Answer in one sentence."
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def smollm2_models(tmp_path_factory: pytest.TempPathFactory) -> ModelPaths:
    from shared.model.smollm2 import ensure_smollm2

    target = ensure_smollm2()
    try:
        # draft-l shares the target's input embedding: the drafter must load it with the target
        drafts = {"draft-l": draft_dirs()["draft-l"]}
    except FileNotFoundError:  # distilled drafts not built yet: a tiny random draft instead
        tiny = make_tiny_checkpoint(
            tmp_path_factory.mktemp("draft"),
            seed=3,
            vocab_size=49152,
            hidden_size=32,
            num_layers=1,
            max_positions=8192,
            tie=True,
        )
        drafts = {"tiny": tiny}
    return ModelPaths(target, drafts)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def chat_prompt(target: Path) -> list[int]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(target)
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": QUESTION}],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
    )
    return list(ids)


def decode(target: Path, ids: list[int]) -> str:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(target).decode(ids, skip_special_tokens=True)


async def test_openai_client_streams_a_chat_completion(
    server: EmbeddedRedis, smollm2_models: ModelPaths, tmp_path: Path
) -> None:
    port = free_port()
    settings = make_settings(
        server.url,
        "openai",
        # the defaults users get: a cost profile loaded or measured at start, goodput planner
        # (kernel planning is left out: it takes tens of seconds; tests/test_cost_model.py has it)
        engine={
            "block_size": 16,
            "kv_memory_bytes": 64 << 20,
            "measure_profile": True,
            "plan_kernels": False,
            "profile_dir": tmp_path,  # nothing stored: measured at start, as on a new machine
            "profile_cache_dir": tmp_path,
        },
        scheduler={"speculation": {"planner": "goodput"}},
        gateway={"port": port},
        models={"target_dir": smollm2_models.target},
    )
    [expected] = plain_greedy(
        smollm2_models.target,
        [chat_prompt(smollm2_models.target)],
        [SamplingParams(max_tokens=MAX_TOKENS)],
    )
    stack = await start_stack(settings, server.url, smollm2_models)
    client = AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
    try:
        await wait_for_gateway(client)
        stream = await client.chat.completions.create(
            model=settings.gateway.model_name,
            messages=[{"role": "user", "content": QUESTION}],
            max_completion_tokens=MAX_TOKENS,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
        pieces: list[str] = []
        chunks: list[Any] = []
        try:
            async with asyncio.timeout(120):
                async for chunk in stream:
                    chunks.append(chunk)
                    if chunk.choices and chunk.choices[0].delta.content:
                        pieces.append(chunk.choices[0].delta.content)
        except TimeoutError:
            raise AssertionError(f"stuck after {pieces}\n{describe(stack)}") from None
        assert chunks[0].choices[0].delta.role == "assistant"
        assert chunks[0].id.startswith("chatcmpl-")
        finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
        assert finishes[-1] in ("stop", "length") and set(finishes[:-1]) == {None}
        assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(expected)
        assert "".join(pieces) == decode(smollm2_models.target, expected)
        assert len(pieces) > 1  # streamed as it was generated
        assert stack.scheduler is not None and stack.scheduler.stats.acceptance.num_drafts > 0

        # per-request options reach the core: plain decoding, or a named draft model
        for extension in ({"speculate": False}, {"draft_model": "draft-l"}):
            drafts_before = stack.scheduler.stats.acceptance.num_drafts
            answer = await client.chat.completions.create(
                model=settings.gateway.model_name,
                messages=[{"role": "user", "content": QUESTION}],
                max_completion_tokens=MAX_TOKENS,
                temperature=0,
                extra_body={"augury": extension},
            )
            assert answer.choices[0].message.content == decode(smollm2_models.target, expected)
            drafted = stack.scheduler.stats.acceptance.num_drafts - drafts_before
            assert drafted == 0 if extension.get("speculate") is False else drafted >= 0
        with pytest.raises(openai.BadRequestError, match="unknown draft model"):
            await client.chat.completions.create(
                model=settings.gateway.model_name,
                messages=[{"role": "user", "content": QUESTION}],
                max_completion_tokens=4,
                extra_body={"augury": {"draft_model": "no-such-draft"}},
            )

        # the cost profile the services measured (or loaded) is exported
        url = f"http://127.0.0.1:{port}/metrics"
        async with aiohttp.ClientSession() as http, http.get(url) as response:
            metrics = await response.text()
        cell = settings.service.cell
        assert (
            f'augury_cost_forward_ms{{cell="{cell}",context="0",role="target",tokens="1"}}'
            in metrics
        )
        assert f'role="draft:{next(iter(smollm2_models.drafts))}"' in metrics
        # ready: a one-token generation went through gateway, scheduler and verifier
        ready = f"http://127.0.0.1:{port}/health/ready"
        async with aiohttp.ClientSession() as http, http.get(ready) as response:
            assert response.status == 200, await response.text()
    finally:
        await client.close()
        await stack.stop()


async def wait_for_gateway(client: AsyncOpenAI, attempts: int = 100) -> None:
    import openai

    for _ in range(attempts):
        try:
            await client.models.list()
            return
        except openai.APIConnectionError:
            await asyncio.sleep(0.1)
    raise AssertionError("the gateway did not come up")
