"""A bf16 target (CPUs with AMX or AVX-512 BF16) or an int8 one: speculation gives plain
decoding's greedy output at that precision; the setting reaches the target only, and bf16 is
refused where the CPU lacks native bf16."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, Qwen3Config

from services.runtime import load_runner
from shared.engine.drafting import Drafter
from shared.engine.spec_engine import SpecEngine
from shared.engine.verifier import Verifier
from shared.model import load_model, load_target, precision
from shared.model.quantized import int8_token_available
from shared.model.runner import ModelRunner
from shared.scheduling.config import SchedulerConfig
from shared.settings import EngineSettings
from shared.values.methods import DraftMethod
from shared.values.sampling import SamplingParams
from tests.test_architectures import PROMPTS, save_checkpoint

requires_bf16_cpu = pytest.mark.skipif(
    not precision.cpu_bf16_flags(), reason="this CPU has neither AMX nor AVX-512 BF16"
)


requires_int8_cpu = pytest.mark.skipif(
    not int8_token_available(), reason="this PyTorch has no CPU int8 matrix product"
)


def engine(
    target: Path,
    draft: Path | None,
    method: DraftMethod | None,
    target_precision: precision.TargetPrecision,
    exact_attention: bool,
) -> SpecEngine:
    model = load_target(target, target_precision)
    runner = ModelRunner(
        model, block_size=4, kv_memory_bytes=2 << 20, exact_attention=exact_attention
    )
    drafter = None
    if draft is not None:  # the draft in fp32: its numbers only decide what is proposed
        drafter = Drafter(ModelRunner(load_model(draft), block_size=4, kv_memory_bytes=2 << 20))
    return SpecEngine(Verifier(runner), drafter, method, SchedulerConfig(planner="fixed"))


# (precision, exact attention, the acceptance floor an fp32 copy of the target still clears)
TARGETS = [
    pytest.param(
        precision.TargetPrecision(torch.bfloat16), False, 2.0, marks=requires_bf16_cpu, id="bf16"
    ),
    pytest.param(
        precision.TargetPrecision(torch.float32, int8=True),
        True,  # per-token scales turn attention's last-bit differences into quantization steps
        1.5,
        marks=requires_int8_cpu,
        id="int8",
    ),
]


@pytest.mark.parametrize(("target_precision", "exact_attention", "floor"), TARGETS)
@pytest.mark.parametrize(
    ("config_cls", "options"),
    [(LlamaConfig, {"attention_bias": True}), (Qwen3Config, {"tie_word_embeddings": True})],
)
def test_low_precision_speculation_equals_plain_decoding_at_that_precision(
    tmp_path, config_cls, options, target_precision, exact_attention, floor
):
    path = save_checkpoint(tmp_path / "m", config_cls, options)
    params = SamplingParams(max_tokens=24)
    at = (target_precision, exact_attention)
    plain = [r.output for r in engine(path, None, None, *at).generate(PROMPTS, params)]
    for method in (
        DraftMethod("chain", k=3),
        DraftMethod("dynamic", budget=12, max_size=8, max_depth=4, max_width=3),
    ):
        spec = engine(path, path, method, *at)
        assert [r.output for r in spec.generate(PROMPTS, params)] == plain, method.kind
        assert spec.stats.mean_accepted_length > floor, method.kind


def test_target_dtype_setting_reaches_the_target_only(tmp_path):
    if not precision.cpu_bf16_flags():
        pytest.skip("this CPU has neither AMX nor AVX-512 BF16")
    path = save_checkpoint(tmp_path / "m", LlamaConfig, {})
    settings = EngineSettings(target_dtype="bfloat16", draft_weights="native")
    assert load_runner(path, settings).model.embed_tokens.weight.dtype == torch.bfloat16
    draft = load_runner(path, settings, target=path)
    assert draft.model.embed_tokens.weight.dtype == torch.float32


def test_bf16_is_refused_on_a_cpu_without_native_bf16(monkeypatch):
    monkeypatch.setattr(precision, "cpu_bf16_flags", lambda: [])
    with pytest.raises(ValueError, match="AUGURY_ENGINE__TARGET_DTYPE bfloat16 needs a CPU"):
        precision.check_target_precision("bfloat16", "cpu", setting="AUGURY_ENGINE__TARGET_DTYPE")
    check = precision.check_target_precision
    assert check("float32", "cpu", setting="x").dtype == torch.float32
    assert check("bfloat16", "cuda", setting="x").dtype == torch.bfloat16


def test_cpu_flags_are_read_from_cpuinfo(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu sse avx512f avx512_bf16 amx_tile\n")
    assert precision.cpu_bf16_flags(cpuinfo) == ["avx512_bf16"]
    cpuinfo.write_text("flags\t\t: fpu sse avx2\n")
    assert precision.cpu_bf16_flags(cpuinfo) == []
    assert precision.cpu_bf16_flags(tmp_path / "missing") == []
