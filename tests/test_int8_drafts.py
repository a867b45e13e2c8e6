"""Drafts with int8 weights on the CPU (`shared/model/quantized.py`): the product stays close to
fp32, a quantized model drafts what its fp32 self would (so acceptance holds), greedy output is
unchanged, and the setting reaches the drafts the services load and only them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from services.runtime import load_runner
from shared.engine.drafting import Drafter
from shared.engine.spec_engine import SpecEngine
from shared.engine.verifier import Verifier
from shared.model import load_model
from shared.model.profiling import profile_key
from shared.model.quantized import Int8Linear, uses_int8
from shared.model.runner import ForwardItem, ModelRunner
from shared.scheduling.config import SchedulerConfig
from shared.settings import EngineSettings
from shared.values.methods import DraftMethod
from shared.values.sampling import SamplingParams
from tests.helpers import requires_int8

pytestmark = requires_int8

PROMPTS = [[5, 17, 3, 44], [9, 10, 11, 12, 13, 14, 15, 16], [70], [33, 34, 35, 36]]


@pytest.mark.parametrize("n", [1, 5, 17])
def test_int8_linear_stays_within_a_few_percent_of_fp32(n: int):
    gen = torch.Generator().manual_seed(n)
    w = torch.randn(300, 128, generator=gen) * torch.rand(300, 1, generator=gen)  # rows differ
    bias = torch.randn(300, generator=gen)
    x = torch.randn(n, 128, generator=gen)
    got = Int8Linear(w, bias)(x)
    want = F.linear(x, w, bias)
    assert got.shape == want.shape and got.dtype == torch.float32
    assert ((got - want).norm() / want.norm()).item() < 0.03
    # a transposed or unscaled weight would be far off: the check has teeth
    assert ((Int8Linear(w.flip(0), bias)(x) - want).norm() / want.norm()).item() > 0.5


def test_outlier_channels_in_fp32_keep_the_typical_ones_precise():
    """An input with a few huge channels (as a target's features have): one activation scale
    for all of them rounds the typical channels away; taking the outliers out keeps the error
    near the plain case's."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(500, 128, generator=gen)
    x = torch.randn(3, 128, generator=gen)
    x[:, [5, 77]] *= 40.0
    want = F.linear(x, w)

    def error(layer: Int8Linear) -> float:
        return ((layer(x) - want).norm() / want.norm()).item()

    assert error(Int8Linear(w, None, num_outliers=2)) < 0.03
    assert error(Int8Linear(w, None)) > 2 * error(Int8Linear(w, None, num_outliers=2))


def test_the_setting_decides_per_device():
    assert uses_int8("native", "cpu") is False
    assert uses_int8("auto", "cpu") is True
    assert uses_int8("int8", "cpu") is True
    assert uses_int8("auto", "cuda") is False
    with pytest.raises(ValueError, match="x86 CPU"):
        uses_int8("int8", "cuda:0")
    with pytest.raises(ValueError, match="one of"):
        uses_int8("int4", "cpu")


def test_a_quantized_model_predicts_what_it_did_in_fp32(tiny_target_dir: Path):
    tokens = torch.randint(3, 96, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    logits = {}
    for int8 in (False, True):
        runner = ModelRunner(
            load_model(tiny_target_dir, int8=int8), block_size=4, kv_memory_bytes=1 << 20
        )
        runner.add_request("r")
        [out] = runner.forward_full([ForwardItem.chain("r", tokens, "all")])
        logits[int8] = out.logits
    fp32, int8 = logits[False], logits[True]
    error = ((int8 - fp32).norm() / fp32.norm()).item()
    agreement = (int8.argmax(-1) == fp32.argmax(-1)).float().mean().item()
    assert error < 0.15  # two layers of ~2-5% each, on a random model's small logits
    assert agreement >= 0.9


def test_a_quantized_model_takes_no_kernel_plan_and_says_so_in_its_profile_key(tiny_target_dir):
    model = load_model(tiny_target_dir, int8=True)
    with pytest.raises(RuntimeError, match="int8"):
        model.plan_kernels()
    assert profile_key(ModelRunner(model, kv_memory_bytes=1 << 20), "m").dtype == "int8"
    plain = ModelRunner(load_model(tiny_target_dir), kv_memory_bytes=1 << 20)
    assert profile_key(plain, "m").dtype == "float32"


def test_greedy_with_an_int8_draft_equals_plain_and_keeps_acceptance(tiny_target_dir: Path):
    """The target drafts for itself, quantized: outputs equal plain decoding, and nearly every
    drafted token is accepted (a draft computing garbage would still give equal outputs, at an
    acceptance near 1 / vocabulary; the fp32 self-draft accepts everything)."""
    params = SamplingParams(max_tokens=24)

    def engine(draft_int8: bool | None) -> SpecEngine:
        target = ModelRunner(load_model(tiny_target_dir), block_size=4, kv_memory_bytes=2 << 20)
        if draft_int8 is None:
            return SpecEngine(Verifier(target))
        draft = load_model(tiny_target_dir, int8=draft_int8)
        drafter = Drafter(ModelRunner(draft, block_size=4, kv_memory_bytes=2 << 20))
        return SpecEngine(Verifier(target), drafter, DraftMethod("chain", k=4))

    plain = [r.output for r in engine(None).generate(PROMPTS, params)]
    quantized = engine(True)
    assert [r.output for r in quantized.generate(PROMPTS, params)] == plain
    assert quantized.stats.num_draft_tokens > 0
    # 0.69-0.77 measured: a random model's near-ties flip under int8; garbage gives ~0.01
    assert quantized.stats.acceptance_rate >= 0.5, quantized.stats


def test_services_load_drafts_int8_on_a_cpu_and_never_the_target(tiny_target_dir: Path):
    settings = EngineSettings(kv_memory_bytes=1 << 20)
    assert settings.draft_weights == "auto"
    draft = load_runner(tiny_target_dir, settings, target=tiny_target_dir)
    target = load_runner(tiny_target_dir, settings)
    assert draft.model.is_int8 and not target.model.is_int8
    native = settings.model_copy(update={"draft_weights": "native"})
    assert not load_runner(tiny_target_dir, native, target=tiny_target_dir).model.is_int8


def test_sampled_outputs_with_an_int8_draft_follow_the_target(tmp_path_factory):
    """Chi-square over the whole joint of 3 sampled tokens (4000 seeded requests): the verifier
    corrects with the distribution the int8 draft computed, so sampling stays lossless."""
    from tests.conftest import make_tiny_checkpoint
    from tests.stats import P_VALUE_FLOOR, fit_p_value
    from tests.test_engine_sampling import NUM_REQUESTS, OUT_LEN, PROMPT, VOCAB, exact

    target_dir = make_tiny_checkpoint(
        tmp_path_factory.mktemp("int8_target"), seed=3, vocab_size=VOCAB, hidden_size=32
    )
    draft_dir = make_tiny_checkpoint(
        tmp_path_factory.mktemp("int8_draft"), seed=4, vocab_size=VOCAB, hidden_size=32
    )
    target = ModelRunner(load_model(target_dir), block_size=4, kv_memory_bytes=2 << 20)
    draft = ModelRunner(load_model(draft_dir, int8=True), block_size=4, kv_memory_bytes=2 << 20)
    engine = SpecEngine(
        Verifier(target),
        Drafter(draft),
        DraftMethod("static", expansion=(2, 1)),
        SchedulerConfig(max_running_requests=NUM_REQUESTS),
    )
    params = [
        SamplingParams(temperature=0.9, seed=s, max_tokens=OUT_LEN) for s in range(NUM_REQUESTS)
    ]
    outcomes = [tuple(r.output) for r in engine.generate([PROMPT] * NUM_REQUESTS, params)]
    assert engine.stats.num_accepted > 0
    assert fit_p_value(outcomes, exact(target_dir, params[0])) > P_VALUE_FLOOR
