"""An int8 target (`--dtype int8`, `AUGURY_ENGINE__TARGET_DTYPE=int8`): each token's product is
independent of the other tokens of its forward (speculation's equality with plain int8 decoding
is in `tests/test_precision.py`); the setting reaches the target only and keys its own cost
profile."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig

from services.runtime import load_runner
from shared.model import precision
from shared.model.profiling import profile_key
from shared.model.quantized import Int8TokenLinear, int8_token_available
from shared.settings import EngineSettings
from tests.test_architectures import save_checkpoint

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
