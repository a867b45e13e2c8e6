"""Plain decoding references the speculative paths are compared against."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import GenerationConfig, LlamaForCausalLM


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
