"""A draft built from its target (distill.model): layers copied from target layers, the target's
input embedding shared instead of stored. The export loads in our runtime only with the target,
and computes what the training module computes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from distill.model import DraftSpec, TrainableDraft, export_draft, load_trainable
from shared.errors import UnsupportedModelError
from shared.model import load_model
from shared.model.runner import ModelRunner
from tests.helpers import paged_logits

SPEC = DraftSpec(
    "tiny-shared",
    hidden_size=64,
    num_layers=1,
    num_heads=4,
    num_kv_heads=2,
    intermediate_size=128,
    embedding_rank=None,
    num_output_tokens=32,
    train_steps=0,
    lr=0.0,
    target_layers=(1,),
    shares_target_embedding=True,
)


@pytest.fixture(scope="module")
def shared_draft_dir(tiny_target_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    target = load_file(str(tiny_target_dir / "model.safetensors"))
    output_ids = torch.arange(3, 3 + SPEC.num_output_tokens)
    draft = TrainableDraft(SPEC, 96, output_ids, rope_theta=10000.0, max_positions=512)
    draft.init_from_target(target, seed=0)
    with torch.no_grad():  # training would move the copied layer away from the target's
        draft.layers[0].q_proj.weight.add_(0.01)
    out = tmp_path_factory.mktemp("shared_draft")
    return export_draft(draft, out, bos_token_id=1, eos_token_id=2, metadata={})


def test_init_copies_target_layer_and_embedding(tiny_target_dir: Path):
    target = load_file(str(tiny_target_dir / "model.safetensors"))
    draft = TrainableDraft(SPEC, 96, torch.arange(3, 35), rope_theta=10000.0)
    draft.init_from_target(target, seed=0)
    layer = draft.layers[0]
    torch.testing.assert_close(
        layer.down_proj.weight, target["model.layers.1.mlp.down_proj.weight"]
    )
    torch.testing.assert_close(draft.embed_tokens.weight, target["model.embed_tokens.weight"])
    torch.testing.assert_close(draft.lm_head.weight, target["lm_head.weight"][3:35])
    assert not draft.embed_tokens.weight.requires_grad  # shared: frozen
    assert draft.lm_head.weight.requires_grad  # the draft's own head trains


def test_shared_embedding_is_not_stored(shared_draft_dir: Path):
    with safe_open(str(shared_draft_dir / "model.safetensors"), framework="pt") as f:
        assert "model.embed_tokens.weight" not in f.keys()  # noqa: SIM118
        assert "lm_head.weight" in f.keys()  # noqa: SIM118


def test_loading_without_the_target_is_refused(shared_draft_dir: Path, tiny_draft_dir: Path):
    with pytest.raises(UnsupportedModelError, match="target_path"):
        load_model(shared_draft_dir)
    with pytest.raises(UnsupportedModelError, match="cannot share"):
        load_model(shared_draft_dir, target_path=tiny_draft_dir)  # hidden 32 != 64


def test_runtime_forward_equals_training_forward(shared_draft_dir: Path, tiny_target_dir: Path):
    model = load_model(shared_draft_dir, target_path=tiny_target_dir)
    trained = load_trainable(shared_draft_dir, tiny_target_dir)
    toks = torch.randint(0, 96, (20,), generator=torch.Generator().manual_seed(0)).tolist()
    got = paged_logits(ModelRunner(model, block_size=4, kv_memory_bytes=1 << 20), toks, 12)
    with torch.no_grad():
        ref = trained(torch.tensor([toks]))[0]
    # fp16 export on both sides; the two forwards differ only in summation order
    torch.testing.assert_close(got, ref, atol=2e-4, rtol=2e-4)
    assert model.output_token_ids.tolist() == list(range(3, 35))
