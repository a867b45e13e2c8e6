"""Prompt logprobs (vLLM's `prompt_logprobs`, completions' `echo` with `logprobs`): the target's
log-probabilities of each prompt token, read from the prefill forward, in every chunk, never
from cached prefix blocks."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaForCausalLM

from shared.values.logprobs import TokenLogprobs
from shared.values.sampling import SamplingParams
from shared.values.steps import VerifiedRequest
from shared.wire.codec import PayloadReader
from shared.wire.requests import Tokens
from shared.wire.steps import read_verified_request, verified_request_payload
from shared.wire.values import read_sampling, sampling_payload
from tests.test_processors import METHODS, engine_for

LONG = [(7 * i + 3) % 90 + 5 for i in range(23)]  # chunked by max_tokens_per_step
PROMPTS = [LONG, [9, 10, 11, 12, 13, 14, 15], [70]]


def hf_prompt_logprobs(model_dir, prompt: list[int]) -> torch.Tensor:
    """[len(prompt) - 1, V] transformers' log_softmax before each prompt token but the first."""
    hf = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf(torch.tensor([prompt])).logits[0].float()
    return torch.log_softmax(logits, -1)[:-1]


def assert_equal_to_transformers(got: TokenLogprobs | None, want: torch.Tensor, prompt, num_top):
    assert got is not None and len(got) == len(prompt) - 1
    chosen = want.gather(1, torch.tensor(prompt[1:], dtype=torch.long)[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(got.logprobs), chosen, rtol=0, atol=1e-4)
    top = want.topk(num_top, -1)
    for i in range(len(got)):
        assert list(got.top_ids[i]) == top.indices[i].tolist()
        torch.testing.assert_close(
            torch.tensor(got.top_logprobs[i]), top.values[i], rtol=0, atol=1e-4
        )


@pytest.mark.parametrize("speculate", [False, True])
def test_prompt_logprobs_equal_transformers_in_every_chunk(
    tiny_target_dir, tiny_draft_dir, speculate
):
    params = SamplingParams(max_tokens=6, prompt_logprobs=3)
    if speculate:
        engine = engine_for(
            tiny_target_dir,
            tiny_draft_dir,
            METHODS["static"],
            planner="fixed",
            max_tokens_per_step=8,
        )
    else:
        engine = engine_for(tiny_target_dir, max_tokens_per_step=8)
    plain = engine_for(tiny_target_dir).generate(PROMPTS, SamplingParams(max_tokens=6))
    # twice: the second time the prompts' blocks are cached, and must be computed anyway
    for _ in range(2):
        done = engine.generate(PROMPTS, params)
        for prompt, got, want in zip(PROMPTS, done, plain, strict=True):
            assert got.output == want.output
            assert got.num_cached_prompt_tokens == 0
            hf = hf_prompt_logprobs(tiny_target_dir, prompt)
            assert_equal_to_transformers(got.prompt_logprobs, hf, prompt, 3)


def test_requests_without_prompt_logprobs_still_hit_the_cache(tiny_target_dir):
    engine = engine_for(tiny_target_dir)
    engine.generate([LONG], SamplingParams(max_tokens=2, prompt_logprobs=0))
    again = engine.generate([LONG], SamplingParams(max_tokens=2))[0]
    assert again.num_cached_prompt_tokens > 0 and again.prompt_logprobs is None


def test_prompt_logprobs_survive_the_wire():
    lps = TokenLogprobs((-0.25, -1.5), ((3,), (4,)), ((-0.2,), (-0.7,)))
    params = SamplingParams(max_tokens=3, prompt_logprobs=1)
    assert read_sampling(PayloadReader(sampling_payload(params), "s")) == params
    done = VerifiedRequest("r", 0, bonus=5, prompt_logprobs=lps)
    back = read_verified_request(PayloadReader(verified_request_payload(done), "v"))
    assert back.prompt_logprobs == lps
    tokens = Tokens("r", 0, 0, (5,), prompt_logprobs=lps)
    assert Tokens.from_payload(PayloadReader(tokens.payload(), "t")).prompt_logprobs == lps
    assert "prompt_logprobs" not in Tokens("r", 0, 0, (5,)).payload()
    assert "prompt_logprobs" not in sampling_payload(SamplingParams(max_tokens=3))


@pytest.mark.smollm2
def test_cli_prints_the_prompt_logprobs(capsys):
    from shared.cli import main

    argv = ["generate", "Name a color.", "--max-tokens", "2", "--threads", "1"]
    assert main([*argv, "--prompt-logprobs", "1", "--temperature", "0"]) == 0
    out = capsys.readouterr().out
    assert "prompt token logprobs" in out
    lines = out.split("prompt token logprobs")[1].splitlines()[1:]
    assert len([line for line in lines if line.startswith("  ")]) >= 3  # prompt tokens but one
