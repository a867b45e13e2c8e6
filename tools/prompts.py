"""Benchmark prompts as the target sees them: one user message, chat template applied."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, TypeVar

T = TypeVar("T")

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


def kind_conversations(kind: str, n: int) -> list[tuple[tuple[str, str], ...]]:
    """The first `n` conversations of a kind: a copy-heavy workload's (`tools.workloads`) or a
    dataset's evaluation prompts, each as one user message."""
    from shared.datasets import eval_prompts
    from tools.workloads import COPY_KINDS, workload_messages

    if kind in COPY_KINDS:
        return [tuple(c) for c in workload_messages(kind, n)]
    return [(("user", text),) for text in eval_prompts(kind, n)]


def kind_prompt_ids(tokenizer: Any, kind: str, n: int) -> list[list[int]]:
    """`kind_conversations` as token ids: a workload's whole conversation, a dataset's prompt
    as `chat_ids` keeps it."""
    from tools.workloads import COPY_KINDS, conversation_ids

    conversations = kind_conversations(kind, n)
    if kind in COPY_KINDS:
        return [conversation_ids(tokenizer, c) for c in conversations]
    return [chat_ids(tokenizer, text) for ((_, text),) in conversations]


def in_turn(groups: Iterable[Sequence[T]]) -> list[T]:
    """The groups' items taken in turn (equal lengths): a1, b1, a2, b2, ..."""
    return [item for row in zip(*groups, strict=True) for item in row]
