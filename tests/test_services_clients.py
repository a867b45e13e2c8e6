"""What real clients send, through the whole stack (gateway, scheduler, verifier, drafter over
embedded Redis) with speculation on and forced: the target drafts for itself (a chain of 4, the
whole chain always drafted), so every drafted token is accepted and each step commits 5 tokens.
The target is a tiny random model over SmolLM2's vocabulary, with SmolLM2's tokenizer beside it
(tests/test_engine_stop_strings.py): its text has multi-byte and byte-fallback pieces.

Stop strings across token boundaries inside an accepted chain, streamed and not: the text ends at
the stop, no chunk holds text past it, and the scheduler drops the request; the default
max_tokens runs past 16 to the end of the context; n = 3 choices, greedy and seeded."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from openai import AsyncOpenAI

from services.gateway.choices import choice_seed
from services.run import Stack, start_stack
from services.runtime import ModelPaths
from shared.bus import EmbeddedRedis
from shared.scheduling.request import RequestState
from shared.values.sampling import SamplingParams
from tests.test_engine_stop_strings import stop_inside_a_step, worded_checkpoint
from tests.test_services_openai import free_port, wait_for_gateway
from tests.test_services_support import make_settings, plain_greedy, until

pytestmark = pytest.mark.anyio
PROMPT = "The capital of France is"
CHAIN = {"speculation": {"method": "chain", "chain_length": 4}}
CONTEXT = 512  # the tiny target's max_position_embeddings


@pytest.fixture(scope="module")
def worded_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return worded_checkpoint(tmp_path_factory.mktemp("worded"))


@pytest.fixture(scope="module")
def tokenizer(worded_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(worded_dir)


@contextlib.asynccontextmanager
async def serving(url: str, cell: str, target: Path) -> AsyncIterator[tuple[Stack, AsyncOpenAI]]:
    port = free_port()
    settings = make_settings(
        url, cell, scheduler=CHAIN, gateway={"port": port}, models={"target_dir": target}
    )
    stack = await start_stack(settings, url, ModelPaths(target, {"self": target}))
    client = AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0)
    try:
        await wait_for_gateway(client)
        yield stack, client
    finally:
        await client.close()
        await stack.stop()


def spy_on_cancels(stack: Stack) -> dict[str, RequestState | None]:
    """The scheduler core's requests as they were when a Cancel reached them (the core runs
    unchanged; this only notes the calls)."""
    assert stack.scheduler is not None
    core = stack.scheduler.core
    seen: dict[str, RequestState | None] = {}
    cancel = core.cancel

    def noting(request_id: str) -> bool:
        seen[request_id] = core.requests.get(request_id)
        return cancel(request_id)

    core.cancel = noting  # type: ignore[method-assign]
    return seen


async def test_stop_strings_inside_accepted_chains(
    server: EmbeddedRedis, worded_dir: Path, tokenizer: Any
) -> None:
    prompt = tokenizer.encode(PROMPT)
    [reference] = plain_greedy(worded_dir, [prompt], [SamplingParams(max_tokens=60)])
    full = tokenizer.decode(reference)
    stop, taken = stop_inside_a_step(tokenizer, reference)
    chat = [{"role": "user", "content": PROMPT}]
    chat_ids = tokenizer.apply_chat_template(
        chat, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    [chat_reference] = plain_greedy(worded_dir, [chat_ids], [SamplingParams(max_tokens=60)])
    chat_full = tokenizer.decode(chat_reference)
    chat_stop, _ = stop_inside_a_step(tokenizer, chat_reference)
    # (references first: computing them blocks the loop the services' heartbeats run on)
    async with serving(server.url, "clients-stop", worded_dir) as (stack, client):
        assert stack.scheduler is not None
        cancels = spy_on_cancels(stack)
        model = stack.settings.gateway.model_name
        # no max_tokens: the request could run to the end of the context; the stop ends it
        answer = await client.completions.create(
            model=model, prompt=PROMPT, temperature=0, stop=[stop, "not in the text"]
        )
        (choice,) = answer.choices
        assert choice.text == full[: full.index(stop)]
        assert choice.finish_reason == "stop" and choice.model_extra["stop_reason"] == stop
        assert answer.usage is not None and answer.usage.completion_tokens == taken
        assert answer.model_extra["augury"]["accepted_tokens"] >= 4  # speculation accepted
        # the scheduler dropped the request long before its max_tokens
        core = stack.scheduler.core
        await until(lambda: answer.id in cancels and answer.id not in core.requests, 30)
        state = cancels[answer.id]
        assert state is not None and state.finish_reason == "abort"
        assert len(state.output) < state.params.max_tokens == CONTEXT - len(prompt)

        chat_stream = await client.chat.completions.create(
            model=model,
            messages=chat,  # type: ignore[arg-type]
            temperature=0,
            stop=chat_stop,
            stream=True,
        )
        contents = [c.choices[0].delta.content or "" async for c in chat_stream if c.choices]
        assert "".join(contents) == chat_full[: chat_full.index(chat_stop)]

        stream = await client.completions.create(
            model=model,
            prompt=PROMPT,
            temperature=0,
            stop=stop,
            stream=True,
            extra_body={"include_stop_str_in_output": True},
        )
        pieces: list[str] = []
        finishes: list[str | None] = []
        async for chunk in stream:
            for part in chunk.choices:
                pieces.append(part.text)
                finishes.append(part.finish_reason)
        kept = full[: full.index(stop) + len(stop)]
        assert "".join(pieces) == kept
        # no chunk holds text past the stop: every prefix of the stream is a prefix of kept
        assert all(kept.startswith("".join(pieces[:i])) for i in range(len(pieces) + 1))
        assert finishes[-1] == "stop" and set(finishes[:-1]) <= {None}
        assert len([p for p in pieces if p]) > 1  # streamed as it was generated


async def test_default_max_tokens_and_n_choices(
    server: EmbeddedRedis, worded_dir: Path, tokenizer: Any
) -> None:
    prompt = tokenizer.encode(PROMPT)
    rest = CONTEXT - len(prompt)
    [reference] = plain_greedy(worded_dir, [prompt], [SamplingParams(max_tokens=rest)])
    async with serving(server.url, "clients-n", worded_dir) as (stack, client):
        model = stack.settings.gateway.model_name
        whole = await client.completions.create(model=model, prompt=PROMPT, temperature=0)
        assert whole.usage is not None and whole.usage.completion_tokens == rest > 16
        assert whole.choices[0].finish_reason == "length"
        assert whole.choices[0].text == tokenizer.decode(reference)

        greedy = await client.completions.create(
            model=model, prompt=PROMPT, temperature=0, max_tokens=20, n=3
        )
        assert [c.index for c in greedy.choices] == [0, 1, 2]
        assert [c.text for c in greedy.choices] == [tokenizer.decode(reference[:20])] * 3
        assert greedy.usage is not None and greedy.usage.completion_tokens == 60

        def seeded(n: int, seed: int) -> Any:
            return client.completions.create(
                model=model, prompt=PROMPT, temperature=1.0, max_tokens=20, n=n, seed=seed
            )

        first, again = await seeded(3, 7), await seeded(3, 7)
        texts = [c.text for c in first.choices]
        assert texts == [c.text for c in again.choices]  # a seed reproduces the choices
        assert len(set(texts)) > 1  # ... which are different samples
        for i, text in enumerate(texts):  # choice i is the request with choice i's seed
            seed = choice_seed(7, i)
            assert seed is not None
            alone = await seeded(1, seed)
            assert alone.choices[0].text == text
