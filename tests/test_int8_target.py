"""An int8 target (`--dtype int8`, `AUGURY_ENGINE__TARGET_DTYPE=int8`): each token's product is
independent of the other tokens of its forward, so with exact attention speculation gives plain
int8 decoding's greedy output; the setting reaches the target only and keys its own cost
profile."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, Qwen3Config

from services.runtime import load_runner
from shared.engine.drafting import Drafter
from shared.engine.spec_engine import SpecEngine
from shared.engine.verifier import Verifier
from shared.model import load_model, precision
from shared.model.profiling import profile_key
from shared.model.quantized import Int8TokenLinear, int8_token_available
from shared.model.runner import ModelRunner
from shared.scheduling.config import SchedulerConfig
from shared.settings import EngineSettings
from shared.values.methods import DraftMethod
from shared.values.sampling import SamplingParams
from tests.test_architectures import PROMPTS, save_checkpoint

pytestmark = pytest.mark.skipif(
    not int8_token_available(), reason="this PyTorch has no CPU int8 matrix product"
)


def test_a_tokens_product_does_not_depend_on_the_other_tokens():
    torch.manual_seed(0)
    weight, bias = torch.randn(96, 64) / 8, torch.randn(96)
    linear = Int8TokenLinear(weight, bias)
    # rows of very different magnitudes: one scale for all would round the small ones away
    x = torch.randn(33, 64) * torch.tensor([0.01, 1.0, 30.0]).repeat(11)[:, None]
    batched = linear(x)
    for i in range(x.shape[0]):
        assert torch.equal(linear(x[i : i + 1]), batched[i : i + 1])
    exact = torch.nn.functional.linear(x, weight, bias)
    error = (batched - exact).norm(dim=1) / exact.norm(dim=1)
    assert error.max() < 0.03


def engine(target: Path, draft: Path | None, method: DraftMethod | None) -> SpecEngine:
    model = load_model(target, int8=True, per_token=True)
    runner = ModelRunner(model, block_size=4, kv_memory_bytes=2 << 20, exact_attention=True)
    verifier = Verifier(runner)
    drafter = None
    if draft is not None:  # the draft in fp32: its numbers only decide what is proposed
        drafter = Drafter(ModelRunner(load_model(draft), block_size=4, kv_memory_bytes=2 << 20))
    return SpecEngine(verifier, drafter, method, SchedulerConfig(planner="fixed"))


@pytest.mark.parametrize(
    ("config_cls", "options"),
    [(LlamaConfig, {"attention_bias": True}), (Qwen3Config, {"tie_word_embeddings": True})],
)
def test_int8_target_speculation_equals_int8_plain_decoding(tmp_path, config_cls, options):
    path = save_checkpoint(tmp_path / "m", config_cls, options)
    params = SamplingParams(max_tokens=24)
    plain = [r.output for r in engine(path, None, None).generate(PROMPTS, params)]
    for method in (
        DraftMethod("chain", k=3),
        DraftMethod("dynamic", budget=12, max_size=8, max_depth=4, max_width=3),
    ):
        spec = engine(path, path, method)
        assert [r.output for r in spec.generate(PROMPTS, params)] == plain, method.kind
        assert spec.stats.mean_accepted_length > 1.5, method.kind  # the fp32 copy agrees often


def test_int8_target_dtype_reaches_the_target_only_and_keys_its_profile(tmp_path):
    path = save_checkpoint(tmp_path / "m", LlamaConfig, {})
    settings = EngineSettings(target_dtype="int8", draft_weights="native")
    target = load_runner(path, settings)
    assert target.model.int8_scales == "token"
    assert profile_key(target, "m").dtype == "int8-token"
    draft = load_runner(path, settings, target=path)
    assert draft.model.int8_scales is None
    assert profile_key(draft, "m").dtype == "float32"


def test_target_precisions_are_checked_by_name():
    check = precision.check_target_precision
    assert check("int8", "cpu", setting="x") == precision.TargetPrecision(torch.float32, int8=True)
    assert check("float32", "cpu", setting="x") == precision.TargetPrecision(torch.float32)
    with pytest.raises(ValueError, match="--dtype int8 needs a CPU"):
        check("int8", "cuda", setting="--dtype")
    with pytest.raises(ValueError, match="--dtype must be one of float32, bfloat16, int8"):
        check("float16", "cpu", setting="--dtype")
