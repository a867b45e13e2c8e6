"""Scoring a prompt through the HTTP API with the official `openai` client, as an evaluation
harness does (completions with `echo` and `logprobs`, `max_tokens` 1 or 0), and vLLM's
`prompt_logprobs`, on the whole stack with SmolLM2 drafting for itself (speculation on) and
prompts prefilled in several chunks: the prompt tokens' log-probabilities equal transformers'
(fp32, 1e-4), the first null, also for a prompt whose blocks the prefix cache already holds."""

from __future__ import annotations

import math

import pytest
import torch
from openai import AsyncOpenAI
from transformers import AutoTokenizer, LlamaForCausalLM

from services.run import start_stack
from services.runtime import ModelPaths
from shared.bus import EmbeddedRedis
from tests.test_services_openai import QUESTION, chat_prompt, free_port, wait_for_gateway
from tests.test_services_support import make_settings

pytestmark = [pytest.mark.anyio, pytest.mark.smollm2]
PROMPT = "The three largest cities of France are Paris, Marseille and Lyon. The capital of"


def transformers_logprobs(target, prompt: list[int]) -> torch.Tensor:
    """[len(prompt) - 1, V]: log_softmax of the target's logits before each prompt token."""
    hf = LlamaForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf(torch.tensor([prompt])).logits[0].float()
    return torch.log_softmax(logits, -1)[:-1]


async def test_echo_and_prompt_logprobs_through_the_openai_client(server: EmbeddedRedis) -> None:
    from shared.model.smollm2 import ensure_smollm2

    target = ensure_smollm2()
    tokenizer = AutoTokenizer.from_pretrained(target)
    prompt = tokenizer.encode(PROMPT, add_special_tokens=True)
    want = transformers_logprobs(target, prompt)
    chosen = want.gather(1, torch.tensor(prompt[1:])[:, None])[:, 0].tolist()
    port = free_port()
    settings = make_settings(
        server.url,
        "promptlogprobs",
        # a budget of 8 tokens a step: the prompts are prefilled in several chunks
        engine={"block_size": 16, "kv_memory_bytes": 64 << 20, "max_tokens_per_step": 8},
        scheduler={"speculation": {"method": "chain", "chain_length": 3}},
        gateway={"port": port},
        models={"target_dir": target},
    )
    stack = await start_stack(settings, server.url, ModelPaths(target, {"self": target}))
    client = AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
    model = settings.gateway.model_name
    scoring = {"model": model, "prompt": PROMPT, "echo": True, "temperature": 0}
    try:
        await wait_for_gateway(client)
        for _ in range(2):  # the second time the prompt's full blocks are cached
            answer = await client.completions.create(**scoring, max_tokens=1, logprobs=2)
            choice = answer.choices[0]
            lps = choice.logprobs
            assert choice.text.startswith(PROMPT) and answer.usage.completion_tokens == 1
            assert len(lps.tokens) == len(prompt) + 1 == len(lps.token_logprobs)
            assert lps.token_logprobs[0] is None and lps.top_logprobs[0] is None
            for got, value in zip(lps.token_logprobs[1 : len(prompt)], chosen, strict=True):
                assert math.isclose(got, value, abs_tol=1e-4)
            for i, top in enumerate(lps.top_logprobs[1 : len(prompt)]):
                best = want[i].topk(2)
                pairs = zip(best.indices.tolist(), best.values.tolist(), strict=True)
                for token_id, value in pairs:
                    assert math.isclose(top[tokenizer.decode([token_id])], value, abs_tol=1e-4)
            assert lps.text_offset[0] == 0 and lps.text_offset == sorted(lps.text_offset)
            assert lps.text_offset[len(prompt)] == len(PROMPT)
            assert "".join(lps.tokens) == choice.text
            usage = answer.usage.model_dump()
            assert (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0) == 0

        # max_tokens 0: the prompt alone, as vLLM answers it
        only = await client.completions.create(**scoring, max_tokens=0, logprobs=0)
        assert only.choices[0].text == PROMPT and only.usage.completion_tokens == 0
        assert len(only.choices[0].logprobs.tokens) == len(prompt)
        assert only.choices[0].logprobs.token_logprobs[1:] == pytest.approx(chosen, abs=1e-4)

        # streamed: the prompt's text and logprobs come in the first chunk
        tokens, values, text = [], [], ""
        async for chunk in await client.completions.create(
            **scoring, max_tokens=3, logprobs=1, stream=True
        ):
            if chunk.choices:
                text += chunk.choices[0].text
                if chunk.choices[0].logprobs is not None:
                    tokens += chunk.choices[0].logprobs.tokens
                    values += chunk.choices[0].logprobs.token_logprobs
        assert text.startswith(PROMPT) and len(tokens) == len(prompt) + 3
        assert values[0] is None and values[1 : len(prompt)] == pytest.approx(chosen, abs=1e-4)

        # vLLM's prompt_logprobs: null first, then token id -> {logprob, rank, decoded_token}
        plain = {"model": model, "prompt": PROMPT, "max_tokens": 2, "temperature": 0}
        vllm = await client.completions.create(**plain, extra_body={"prompt_logprobs": 3})
        entries = vllm.choices[0].model_extra["prompt_logprobs"]
        assert entries[0] is None and len(entries) == len(prompt)
        for i, (token, entry) in enumerate(zip(prompt[1:], entries[1:], strict=True)):
            assert math.isclose(entry[str(token)]["logprob"], chosen[i], abs_tol=1e-4)
            best = want[i].topk(3).indices.tolist()
            for rank, token_id in enumerate(best, start=1):
                assert entry[str(token_id)]["rank"] == rank
        assert vllm.choices[0].text == (await client.completions.create(**plain)).choices[0].text

        chat = await client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": QUESTION}],
            max_completion_tokens=2,
            temperature=0,
            extra_body={"prompt_logprobs": 0},
        )
        entries = chat.model_extra["prompt_logprobs"]
        chat_ids = chat_prompt(target)
        assert entries[0] is None and len(entries) == len(chat_ids)
        assert all(str(t) in e for t, e in zip(chat_ids[1:], entries[1:], strict=True))
        streamed = [
            chunk.model_extra["prompt_logprobs"]
            async for chunk in await client.chat.completions.create(
                model=model,
                messages=[{"role": "user", "content": QUESTION}],
                max_completion_tokens=2,
                temperature=0,
                stream=True,
                extra_body={"prompt_logprobs": 0},
            )
            if (chunk.model_extra or {}).get("prompt_logprobs") is not None
        ]
        assert len(streamed) == 1 and len(streamed[0]) == len(entries)  # on one chunk
        for got, entry in zip(streamed[0][1:], entries[1:], strict=True):
            assert got.keys() == entry.keys()
            for key in got:
                assert math.isclose(got[key]["logprob"], entry[key]["logprob"], abs_tol=1e-4)

        # n choices each echo the prompt with its logprobs
        two = await client.completions.create(**scoring, max_tokens=1, logprobs=0, n=2)
        for choice in two.choices:
            assert choice.logprobs.token_logprobs[0] is None
            assert choice.logprobs.token_logprobs[1 : len(prompt)] == pytest.approx(
                chosen, abs=1e-4
            )
        assert stack.scheduler is not None
        acceptance = stack.scheduler.stats.acceptance
        assert acceptance.num_drafts > 0 and acceptance.num_accepted > 0
    finally:
        await client.close()
        await stack.stop()
