"""A target and a draft over a six-token vocabulary, and the exact probability of every output:
what the chi-square tests of sampled speculation compare their counts against."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from transformers import LlamaForCausalLM

from shared.values.sampling import SamplingParams, processed_probs
from tests.conftest import make_tiny_checkpoint

VOCAB = 6

# (logits of one output position, the output before it) -> the logits sampled from
RowAdjust = Callable[[torch.Tensor, list[int]], torch.Tensor]

_JOINTS: dict[tuple[str, tuple[int, ...], int, str], dict[tuple[int, ...], float]] = {}


def small_vocab_pair(factory: pytest.TempPathFactory, tag: str) -> tuple[Path, Path]:
    """(target, draft) checkpoint directories; the same weights for every tag."""
    target = make_tiny_checkpoint(
        factory.mktemp(f"{tag}_target"), seed=3, vocab_size=VOCAB, hidden_size=32
    )
    draft = make_tiny_checkpoint(
        factory.mktemp(f"{tag}_draft"), seed=4, vocab_size=VOCAB, hidden_size=16, num_layers=1
    )
    return target, draft


def exact_joint(
    target_dir: Path,
    prompt: Sequence[int],
    out_len: int,
    params: SamplingParams,
    adjust: RowAdjust | None = None,
) -> dict[tuple[int, ...], float]:
    """P(output) of every output of `out_len` tokens under plain sampling from the target
    (kept per target, prompt and distribution when `adjust` is None: many tests ask again)."""
    key = (str(target_dir), tuple(prompt), out_len, repr(replace(params, seed=None, max_tokens=1)))
    if adjust is None and key in _JOINTS:
        return _JOINTS[key]
    hf = LlamaForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    joint = {}
    for seq in itertools.product(range(VOCAB), repeat=out_len):
        with torch.no_grad():
            logits = hf(torch.tensor([list(prompt) + list(seq[:-1])])).logits[0, len(prompt) - 1 :]
        p = 1.0
        for i in range(out_len):
            row = logits[i] if adjust is None else adjust(logits[i], list(seq[:i]))
            p *= float(processed_probs(row[None], params)[0, seq[i]])
        joint[seq] = p
    if adjust is None:
        _JOINTS[key] = joint
    return joint
