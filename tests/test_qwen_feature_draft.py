"""The qwen2.5-coder feature draft's recipe on a tiny Qwen2 target (q/k/v biases, tied head,
rope θ 1e6, sharded checkpoint): what `python -m distill build --model-set qwen2.5-coder` reads
of the target, that the draft it exports loads beside such a target, and that speculation with
it keeps greedy output equal to plain decoding."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen2Config

from distill import data
from distill.model import DRAFT_SPECS, MODEL_SET_DRAFTS, TrainableDraft, export_draft
from shared.engine.drafting import Drafter
from shared.engine.spec_engine import SpecEngine
from shared.engine.verifier import Verifier
from shared.model import load_model
from shared.model.hf_checkpoint import load_transformers_model
from shared.model.model_set import QWEN_FEATURE_DRAFT_NAME
from shared.model.runner import ModelRunner
from shared.scheduling.config import SchedulerConfig
from shared.values.methods import DraftMethod
from shared.values.sampling import SamplingParams
from tests.test_architectures import randomize

VOCAB = 96
# The set's spec at a tiny width: same head layout (6 query heads per kv head), same parts.
SPEC = replace(
    DRAFT_SPECS[QWEN_FEATURE_DRAFT_NAME],
    hidden_size=96, num_heads=6, num_kv_heads=1, intermediate_size=128,
    num_output_tokens=48, feature_size=96,
)  # fmt: skip
PROMPTS = [[5, 17, 3, 44], [9, 10, 11, 12, 13, 14, 15, 16], [70], [33, 34, 35]]


@pytest.fixture(scope="module")
def qwen_target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cfg = Qwen2Config(
        vocab_size=VOCAB, hidden_size=96, intermediate_size=160, num_hidden_layers=2,
        num_attention_heads=6, num_key_value_heads=1, max_position_embeddings=256,
        rope_theta=1e6, tie_word_embeddings=True, use_sliding_window=False,
        bos_token_id=1, eos_token_id=None,
    )  # fmt: skip
    model = AutoModelForCausalLM.from_config(cfg)
    randomize(model, seed=0)
    path = tmp_path_factory.mktemp("qwen_target")
    model.save_pretrained(path, safe_serialization=True, max_shard_size="40KB")
    assert len(list(path.glob("*.safetensors"))) > 1  # sharded, as the installed 1.5B is
    return path


@pytest.fixture(scope="module")
def feature_draft(qwen_target: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    tensors = data.target_init_tensors(qwen_target, data.RECIPES["qwen2.5-coder"])
    draft = TrainableDraft(SPEC, VOCAB, torch.arange(0, 96, 2), rope_theta=1e6, max_positions=256)
    draft.init_from_target(tensors, seed=0)
    with torch.no_grad():  # make the token half of the fusion matter too
        draft.feature_fc.weight[:, :96].normal_(
            0.0, 0.2, generator=torch.Generator().manual_seed(1)
        )
    out = tmp_path_factory.mktemp("qwen_feature_draft")
    return export_draft(draft, out, bos_token_id=1, eos_token_id=2, metadata={})


def test_the_set_trains_its_feature_draft_from_its_own_recipe():
    assert MODEL_SET_DRAFTS["qwen2.5-coder"] == (QWEN_FEATURE_DRAFT_NAME,)
    assert DRAFT_SPECS[QWEN_FEATURE_DRAFT_NAME].is_feature_level
    smollm2, qwen = data.RECIPES["smollm2"], data.RECIPES["qwen2.5-coder"]
    assert qwen.tag() != smollm2.tag()  # its files never overwrite SmolLM2's
    assert data.features_path(Path("c"), qwen) != data.features_path(Path("c"))
    assert qwen.cache_subdir and qwen.drafts_dir != smollm2.drafts_dir  # nor its drafts theirs


def test_a_bigger_target_lends_only_what_a_feature_draft_reads(qwen_target: Path):
    tensors = data.target_init_tensors(qwen_target, data.RECIPES["qwen2.5-coder"])
    assert set(tensors) == {"model.embed_tokens.weight", "model.norm.weight"}  # tied: no head
    everything = data.target_init_tensors(qwen_target, data.RECIPES["smollm2"])
    assert "model.layers.0.self_attn.q_proj.bias" in everything


def test_transformers_reads_a_sharded_checkpoint_strictly(qwen_target: Path, tmp_path: Path):
    model = load_transformers_model(qwen_target, torch.float32)
    reference = AutoModelForCausalLM.from_pretrained(qwen_target, dtype=torch.float32).eval()
    ids = torch.tensor([PROMPTS[1]])
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, reference(ids).logits)
    for shard in qwen_target.iterdir():  # one shard short: refused by name
        if shard.suffix != ".json":
            (tmp_path / shard.name).symlink_to(shard)
    (tmp_path / "config.json").symlink_to(qwen_target / "config.json")
    next(tmp_path.glob("*.safetensors")).unlink()
    with pytest.raises(ValueError, match="lacks"):
        load_transformers_model(tmp_path, torch.float32)


@pytest.mark.parametrize(
    "method",
    [DraftMethod("chain", k=4), DraftMethod("dynamic", budget=12, max_size=8, max_depth=5)],
    ids=["chain", "dynamic"],
)
def test_greedy_with_the_feature_draft_equals_plain(
    qwen_target: Path, feature_draft: Path, method: DraftMethod
):
    params = SamplingParams(max_tokens=20)
    plain = SpecEngine(Verifier(ModelRunner(load_model(qwen_target), block_size=4)), None, None)
    expected = [r.output for r in plain.generate(PROMPTS, params)]
    verifier = Verifier(ModelRunner(load_model(qwen_target), block_size=4, kv_memory_bytes=2 << 20))
    model = load_model(feature_draft, target_path=qwen_target)
    drafter = Drafter(ModelRunner(model, block_size=4, kv_memory_bytes=1 << 20), name="qwen-e")
    engine = SpecEngine(verifier, drafter, method, SchedulerConfig(planner="fixed"))
    assert [r.output for r in engine.generate(PROMPTS, params)] == expected
    assert engine.stats.num_draft_tokens > 0
