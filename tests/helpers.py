"""Plain decoding references the speculative paths are compared against."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch
from transformers import GenerationConfig, LlamaForCausalLM

from shared.model.quantized import int8_available

# int8 drafts run PyTorch's FBGEMM kernels, which only x86 builds of PyTorch have (every machine
# this project's CI runs on); elsewhere `auto` keeps the drafts' own weights and these tests skip
requires_int8 = pytest.mark.skipif(
    not int8_available(), reason="needs PyTorch's FBGEMM int8 kernels, which only x86 builds have"
)


def hf_greedy(model_dir, prompt: Sequence[int], max_new_tokens: int) -> list[int]:
    """transformers' own greedy decoding of the target: the ground truth."""
    hf = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([list(prompt)]),
            generation_config=GenerationConfig(
                max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0
            ),
        )
    return out[0, len(prompt) :].tolist()


def paged_logits(runner, tokens: Sequence[int], split: int) -> torch.Tensor:
    """Logits of every position from our runtime: a prefill of tokens[:split], a commit, then the
    rest as a chain over the paged KV cache (exercising both the prefill and the cached path)."""
    from shared.model.runner import ForwardItem

    runner.add_request("a")
    [a] = runner.forward([ForwardItem.chain("a", list(tokens[:split]), logits="all")])
    runner.commit({"a": range(split)})
    [b] = runner.forward([ForwardItem.chain("a", list(tokens[split:]), logits="all")])
    return torch.cat([a, b])
