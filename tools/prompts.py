"""Benchmark prompts as the target sees them: one user message, chat template applied."""

from __future__ import annotations

from typing import Any

CPU_FRIENDLY_PREFILL = 768  # long chats keep their last tokens: a CPU-friendly prefill


def chat_ids(tokenizer: Any, text: str, keep: int = CPU_FRIENDLY_PREFILL) -> list[int]:
    """The token ids of `text` as a user message with the generation prompt (the last `keep`)."""
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
    )
    return list(ids)[-keep:]
