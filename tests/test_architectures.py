"""Every LLaMA-family architecture and option the loader accepts decodes exactly like transformers;
every option it does not implement is refused, naming the field; no tensor is silently dropped.

Tiny random checkpoints are saved by transformers itself (`save_pretrained`), so the config
fields and tensor names are what a user's checkpoint holds. For each: our logits equal
transformers' (fp32), our greedy decoding equals `generate`'s token for token, and speculation
with the checkpoint as its own draft (a chain, a dynamic tree; an int8 copy as well) gives the
same tokens while accepting nearly everything it drafts.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFWriter, quants
from safetensors.torch import load_file, save_file
from transformers import (
    AutoModelForCausalLM,
    GenerationConfig,
    LlamaConfig,
    MistralConfig,
    PretrainedConfig,
    Qwen2Config,
    Qwen3Config,
)

from shared.engine.drafting import Drafter
from shared.engine.spec_engine import SpecEngine
from shared.engine.verifier import Verifier
from shared.errors import ContextLengthError, UnsupportedModelError
from shared.model import load_model
from shared.model.config import ModelConfig
from shared.model.gguf import gguf_tensor_name
from shared.model.gguf_header import GgufArray, read_gguf_header
from shared.model.runner import ForwardItem, ModelRunner
from shared.scheduling.config import SchedulerConfig
from shared.values.methods import DraftMethod
from shared.values.sampling import SamplingParams
from tests.helpers import requires_int8

VOCAB = 96
BASE: dict[str, Any] = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "bos_token_id": 1,
    "eos_token_id": None,  # outputs run to max_tokens on both sides
    "tie_word_embeddings": False,
}
# head_dim 16 with θ 10000 has wavelengths from 6 to 20 000 positions: with an original context
# of 64, scaled rope types move most of them at the positions these tests reach.
LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64}

VARIANTS: dict[str, tuple[type[PretrainedConfig], dict[str, Any]]] = {
    "llama-llama3-rope": (LlamaConfig, {"rope_scaling": LLAMA3}),
    "llama-linear-rope": (LlamaConfig, {"rope_scaling": {"rope_type": "linear", "factor": 4.0}}),
    "llama-dynamic-rope": (LlamaConfig, {"rope_scaling": {"type": "dynamic", "factor": 2.0}}),
    "llama-yarn-rope": (LlamaConfig, {"rope_scaling": YARN}),
    "llama-attention-bias": (LlamaConfig, {"attention_bias": True}),
    "llama-mlp-bias": (LlamaConfig, {"mlp_bias": True}),
    "llama-head-dim-tied": (LlamaConfig, {"head_dim": 32, "tie_word_embeddings": True}),
    "qwen2-tied": (Qwen2Config, {"tie_word_embeddings": True, "use_sliding_window": False}),
    "qwen3": (Qwen3Config, {"head_dim": 32}),
    "qwen3-attention-bias-tied": (
        Qwen3Config,
        {"attention_bias": True, "tie_word_embeddings": True, "rope_scaling": YARN},
    ),
    "mistral": (MistralConfig, {"sliding_window": None}),
}
PROMPTS = [[5, 17, 3, 44, 60, 2, 71], [9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]]
MAX_TOKENS = 16


def randomize(model: torch.nn.Module, seed: int) -> None:
    """Peaked, varied distributions (a wrong position or bias changes the argmax), and norms and
    biases far from their neutral values so that dropping one shows."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.15)
            elif name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            else:  # biases
                p.normal_(0.0, 0.3)


def save_checkpoint(
    path: Path, config_cls: type[PretrainedConfig], options: dict[str, Any]
) -> Path:
    cfg = config_cls(**{**BASE, **options})
    model = AutoModelForCausalLM.from_config(cfg)
    randomize(model, seed=0)
    model.save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("architectures")
    return {name: save_checkpoint(root / name, *variant) for name, variant in VARIANTS.items()}


def hf_model(path: Path, device: str = "cpu") -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).eval()


def hf_generate(
    path: Path, prompt: list[int], max_new_tokens: int, device: str = "cpu"
) -> list[int]:
    config = GenerationConfig(
        max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    with torch.no_grad():
        out = hf_model(path, device).generate(
            torch.tensor([prompt], device=device), generation_config=config
        )
    return out[0, len(prompt) :].tolist()


def make_engine(
    path: Path, method: DraftMethod | None, *, int8_draft: bool = False, device: str = "cpu"
) -> SpecEngine:
    target = load_model(path, device=device)
    verifier = Verifier(ModelRunner(target, block_size=4, kv_memory_bytes=2 << 20))
    drafter = None
    if method is not None:
        draft = load_model(path, device=device, int8=int8_draft)
        drafter = Drafter(ModelRunner(draft, block_size=4, kv_memory_bytes=2 << 20))
    return SpecEngine(verifier, drafter, method, SchedulerConfig(planner="fixed"))


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_logits_equal_transformers(checkpoints, name):
    path = checkpoints[name]
    runner = ModelRunner(load_model(path), block_size=4, kv_memory_bytes=1 << 20)
    tokens = PROMPTS[1] * 4  # 52 positions: past the scaled rope types' original context of 64
    tokens = tokens + PROMPTS[0] * 3
    runner.add_request("a")
    [ours] = runner.forward([ForwardItem.chain("a", tokens, logits="all")])
    with torch.no_grad():
        ref = hf_model(path)(torch.tensor([tokens])).logits[0]
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_plain_and_speculative_greedy_equal_transformers(checkpoints, name):
    path = checkpoints[name]
    params = SamplingParams(max_tokens=MAX_TOKENS)
    expected = [hf_generate(path, p, MAX_TOKENS) for p in PROMPTS]
    plain = make_engine(path, None).generate(PROMPTS, params)
    assert [r.output for r in plain] == expected
    # the checkpoint drafting for itself: every drafted greedy token is the target's
    for method, floor in [
        (DraftMethod("chain", k=3), 3.5),
        (DraftMethod("dynamic", budget=12, max_size=8, max_depth=4, max_width=3), 2.5),
    ]:
        engine = make_engine(path, method)
        assert [r.output for r in engine.generate(PROMPTS, params)] == expected, method.kind
        assert engine.stats.mean_accepted_length > floor, method.kind


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_on_gpu_logits_and_greedy_equal_transformers(checkpoints, name):
    """On CUDA the runner attends with the Triton tree kernel and replays CUDA graphs: the fp32
    logits are transformers' on the same GPU, and plain and speculative greedy output its
    `generate`'s."""
    path = checkpoints[name]
    runner = ModelRunner(load_model(path, device="cuda"), block_size=4, kv_memory_bytes=1 << 20)
    tokens = PROMPTS[1] * 4 + PROMPTS[0] * 3
    runner.add_request("a")
    [ours] = runner.forward([ForwardItem.chain("a", tokens, logits="all")])
    with torch.no_grad():
        ref = hf_model(path, "cuda")(torch.tensor([tokens], device="cuda")).logits[0]
    torch.testing.assert_close(ours, ref, atol=1e-3, rtol=1e-3)
    params = SamplingParams(max_tokens=MAX_TOKENS)
    expected = [hf_generate(path, p, MAX_TOKENS, "cuda") for p in PROMPTS]
    plain = make_engine(path, None, device="cuda").generate(PROMPTS, params)
    assert [r.output for r in plain] == expected
    method = DraftMethod("dynamic", budget=12, max_size=8, max_depth=4, max_width=3)
    engine = make_engine(path, method, device="cuda")
    assert [r.output for r in engine.generate(PROMPTS, params)] == expected
    assert engine.stats.mean_accepted_length > 2.5


@requires_int8
@pytest.mark.parametrize(
    "name", ["llama-attention-bias", "llama-mlp-bias", "qwen2-tied", "qwen3-attention-bias-tied"]
)
def test_int8_draft_keeps_biases_and_norms(checkpoints, name):
    """An int8 copy of the checkpoint as its draft: its biases and norms are kept, so it still
    agrees with the target most of the time; the output is the target's either way."""
    path = checkpoints[name]
    params = SamplingParams(max_tokens=MAX_TOKENS)
    expected = [hf_generate(path, p, MAX_TOKENS) for p in PROMPTS]
    engine = make_engine(path, DraftMethod("chain", k=3), int8_draft=True)
    assert [r.output for r in engine.generate(PROMPTS, params)] == expected
    assert engine.stats.mean_accepted_length > 2.5


def test_scaled_rope_types_change_the_output(checkpoints):
    """The rope tests can fail: the same weights with default RoPE give other logits."""
    for name in ("llama-llama3-rope", "llama-linear-rope", "llama-yarn-rope"):
        path = checkpoints[name]
        scaled = load_model(path)
        config = json.loads((path / "config.json").read_text())
        config.pop("rope_scaling", None)
        config["rope_parameters"] = {"rope_type": "default", "rope_theta": 10000.0}
        plain = ModelConfig.from_hf(config)
        assert plain.rope_scaling is None and scaled.cfg.rope_scaling is not None
        unscaled = load_model(path)
        unscaled.cfg = plain  # only RoPE's tables differ
        unscaled.init_rope(torch.device("cpu"))
        scaled_runner = ModelRunner(scaled, block_size=4, kv_memory_bytes=1 << 20)
        plain_runner = ModelRunner(unscaled, block_size=4, kv_memory_bytes=1 << 20)
        tokens = PROMPTS[1] * 5
        outs = []
        for runner in (scaled_runner, plain_runner):
            runner.add_request("a")
            [logits] = runner.forward([ForwardItem.chain("a", tokens, logits="all")])
            outs.append(logits)
        assert not torch.allclose(outs[0], outs[1], atol=1e-2), name


# ---- refusals ----------------------------------------------------------------------------------
def tiny_config(**options: Any) -> dict[str, Any]:
    return {"architectures": ["LlamaForCausalLM"], **BASE, **options}


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"rope_scaling": {"rope_type": "longrope", "short_factor": [1.0]}}, "rope_type"),
        ({"rope_parameters": {"rope_type": "su", "rope_theta": 1e4}}, "rope_type"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "original_max_position"),
        ({"rope_scaling": {"rope_type": "linear", "factor": 2.0, "foo": 1}}, "foo"),
        ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"architectures": ["GemmaForCausalLM"]}, "GemmaForCausalLM"),
        ({"architectures": ["MistralForCausalLM"], "mlp_bias": True}, "mlp_bias"),
        ({"architectures": ["Qwen2ForCausalLM"], "attention_bias": True}, "attention_bias"),
    ],
)
def test_unsupported_options_are_refused_by_name(options, named):
    with pytest.raises(UnsupportedModelError, match=named):
        ModelConfig.from_hf(tiny_config(**options))


def test_sliding_window_in_use_caps_the_context_to_the_window(tmp_path):
    """Within its window sliding-window attention is full attention, which is what we compute:
    such a checkpoint serves its window's worth of positions, exactly, and refuses more."""
    path = save_checkpoint(tmp_path / "m", MistralConfig, {"sliding_window": 24})
    model = load_model(path)
    assert model.cfg.max_position_embeddings == 24
    engine = SpecEngine(
        Verifier(ModelRunner(model, block_size=4, kv_memory_bytes=1 << 20)), None, None
    )
    [req] = engine.generate([PROMPTS[0]], SamplingParams(max_tokens=10))
    assert req.output == hf_generate(path, PROMPTS[0], 10)
    with pytest.raises(ContextLengthError, match="context"):
        engine.generate([PROMPTS[1]], SamplingParams(max_tokens=16))


def edit_tensors(path: Path, edit: Callable[[dict[str, torch.Tensor]], None]) -> None:
    file = path / "model.safetensors"
    tensors = load_file(str(file))
    edit(tensors)
    save_file(tensors, str(file), metadata={"format": "pt"})


def test_a_tensor_the_model_would_not_use_is_refused_by_name(tmp_path):
    """The issue's case: a checkpoint with attention biases whose config does not say so."""
    path = save_checkpoint(tmp_path / "m", LlamaConfig, {"attention_bias": True})
    config = json.loads((path / "config.json").read_text())
    config["attention_bias"] = False
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match=r"would not use: .*o_proj\.bias"):
        load_model(path)


def test_a_missing_tensor_is_refused_by_name(tmp_path):
    path = save_checkpoint(tmp_path / "m", LlamaConfig, {"mlp_bias": True})
    edit_tensors(path, lambda t: t.pop("model.layers.1.mlp.down_proj.bias"))
    with pytest.raises(UnsupportedModelError, match=r"lacks tensor 'model\.layers\.1\.mlp\.down"):
        load_model(path)
    path = save_checkpoint(tmp_path / "q", Qwen3Config, {})
    edit_tensors(path, lambda t: t.pop("model.layers.0.self_attn.k_norm.weight"))
    with pytest.raises(UnsupportedModelError, match=r"self_attn\.k_norm\.weight"):
        load_model(path)


def test_rotary_buffers_of_old_checkpoints_are_ignored_and_lm_head_must_match_a_tie(tmp_path):
    path = save_checkpoint(tmp_path / "m", LlamaConfig, {"tie_word_embeddings": True})

    def add_buffer(tensors: dict[str, torch.Tensor]) -> None:
        tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)

    edit_tensors(path, add_buffer)
    load_model(path)

    def add_other_head(tensors: dict[str, torch.Tensor]) -> None:
        tensors["lm_head.weight"] = torch.zeros(VOCAB, 64)

    edit_tensors(path, add_other_head)
    with pytest.raises(UnsupportedModelError, match="tie_word_embeddings"):
        load_model(path)


# ---- GGUF files ----------------------------------------------------------------------------------
def llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's layout of a llama q or k projection: each head's rotary halves interleaved."""
    return (
        weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def write_gguf(
    path: Path,
    model: torch.nn.Module,
    arch: str,
    qtype: GGMLQuantizationType = GGMLQuantizationType.F32,
    extra_tensors: dict[str, np.ndarray] | None = None,
    extra_fields: Callable[[GGUFWriter], None] | None = None,
) -> Path:
    """A GGUF file as llama.cpp's converter writes one: its metadata keys and tensor names, a
    byte-level BPE tokenizer, 2-D weights in `qtype` and the rest in F32."""
    c = model.config
    writer = GGUFWriter(str(path), arch)
    writer.add_name("tiny")
    writer.add_context_length(c.max_position_embeddings)
    writer.add_block_count(c.num_hidden_layers)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_vocab_size(c.vocab_size)
    tokens = ["<s>", "</s>", "ab"] + [chr(i) for i in range(33, 33 + c.vocab_size - 3)]
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * len(tokens))
    writer.add_token_merges(["a b"])
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(1)
    if arch == "qwen3":  # its head size need not be hidden / heads
        writer.add_key_length(c.head_dim)
        writer.add_value_length(c.head_dim)
    if extra_fields is not None:
        extra_fields(writer)
    state = model.state_dict()
    if c.tie_word_embeddings:
        state.pop("lm_head.weight")
    for name, tensor in state.items():
        data = tensor.float().numpy()
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = c.num_attention_heads if "q_proj" in name else c.num_key_value_heads
            data = llama_cpp_permute(data, heads)
        if data.ndim == 2 and qtype != GGMLQuantizationType.F32:
            writer.add_tensor(gguf_tensor_name(name), quants.quantize(data, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(gguf_tensor_name(name), data)
    for name, data in (extra_tensors or {}).items():
        writer.add_tensor(name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


GGUF_VARIANTS: dict[str, tuple[type[PretrainedConfig], dict[str, Any]]] = {
    "llama": (LlamaConfig, {}),
    "qwen2": (Qwen2Config, {"tie_word_embeddings": True, "use_sliding_window": False}),
    "qwen3": (Qwen3Config, {"head_dim": 32}),
}


def random_model(config_cls: type[PretrainedConfig], options: dict[str, Any]) -> torch.nn.Module:
    model = AutoModelForCausalLM.from_config(config_cls(**{**BASE, **options}))
    randomize(model, seed=0)
    return model.eval()


@pytest.fixture
def cache_home(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.mark.parametrize("arch", sorted(GGUF_VARIANTS))
def test_f32_gguf_loads_as_the_model_it_was_written_from(tmp_path, cache_home, arch):
    model = random_model(*GGUF_VARIANTS[arch])
    gguf_file = write_gguf(tmp_path / f"tiny-{arch}.gguf", model, arch)
    tokens = PROMPTS[1] * 3
    runner = ModelRunner(load_model(gguf_file), block_size=4, kv_memory_bytes=1 << 20)
    runner.add_request("a")
    [ours] = runner.forward([ForwardItem.chain("a", tokens, logits="all")])
    with torch.no_grad():
        ref = model(torch.tensor([tokens])).logits[0]
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)
    [converted] = (cache_home / "augury" / "models" / "gguf").iterdir()
    assert converted.name.startswith(f"tiny-{arch}-")


def test_quantized_gguf_decodes_like_transformers_and_drafts_for_itself(tmp_path, cache_home):
    """Q8_0 and Q5_0 weights, as transformers dequantizes them; converted once, again when
    the file changes."""
    model = random_model(*GGUF_VARIANTS["qwen2"])
    for qtype in (GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q5_0):
        gguf_file = write_gguf(tmp_path / f"tiny-{qtype.name}.gguf", model, "qwen2", qtype)
        hf = AutoModelForCausalLM.from_pretrained(
            tmp_path, gguf_file=gguf_file.name, dtype=torch.float32
        ).eval()
        config = GenerationConfig(
            max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0
        )
        with torch.no_grad():
            expected = [
                hf.generate(torch.tensor([p]), generation_config=config)[0, len(p) :].tolist()
                for p in PROMPTS
            ]
        params = SamplingParams(max_tokens=MAX_TOKENS)
        assert [r.output for r in make_engine(gguf_file, None).generate(PROMPTS, params)] == (
            expected
        )
        engine = make_engine(gguf_file, DraftMethod("chain", k=3))
        assert [r.output for r in engine.generate(PROMPTS, params)] == expected
        assert engine.stats.mean_accepted_length > 3.5
    converted = sorted((cache_home / "augury" / "models" / "gguf").iterdir())
    assert len(converted) == 2
    write_gguf(tmp_path / "tiny-Q5_0.gguf", random_model(LlamaConfig, {}), "llama")
    load_model(tmp_path / "tiny-Q5_0.gguf")  # a changed file converts again
    assert len(list((cache_home / "augury" / "models" / "gguf").iterdir())) == 3


def partial_rotary(writer: GGUFWriter) -> None:
    writer.add_key_length(16)
    writer.add_rope_dimension_count(8)


def test_gguf_files_we_would_convert_wrongly_are_refused_by_name(tmp_path, cache_home):
    model = random_model(LlamaConfig, {})
    cases: list[tuple[str, dict[str, Any], str]] = [
        ("gemma", {}, "general.architecture 'gemma'"),
        ("llama", {"extra_tensors": {"rope_freqs.weight": np.ones(8, np.float32)}}, "rope_freqs"),
        (
            "llama",
            {"extra_fields": lambda w: w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)},
            "rope.scaling.type",
        ),
        ("llama", {"extra_fields": lambda w: w.add_key_length(32)}, "key_length"),
        ("llama", {"extra_fields": partial_rotary}, "rope.dimension_count 8"),
    ]
    for i, (arch, options, named) in enumerate(cases):
        gguf_file = write_gguf(tmp_path / f"bad{i}.gguf", model, arch, **options)
        with pytest.raises(UnsupportedModelError, match=named):
            load_model(gguf_file)


def test_gguf_header_reader_agrees_with_the_gguf_package(tmp_path):
    model = random_model(*GGUF_VARIANTS["qwen3"])
    path = write_gguf(tmp_path / "h.gguf", model, "qwen3", GGMLQuantizationType.Q8_0)
    ours, theirs = read_gguf_header(path), gguf.GGUFReader(str(path))
    assert [(t.name, t.dims, t.ggml_type) for t in ours.tensors] == [
        (t.name, tuple(int(d) for d in t.shape), int(t.tensor_type)) for t in theirs.tensors
    ]
    header_fields = {"GGUF.version", "GGUF.tensor_count", "GGUF.kv_count"}
    assert set(ours.fields) == set(theirs.fields) - header_fields
    assert ours.fields["qwen3.attention.key_length"] == 32
    assert ours.fields["general.architecture"] == "qwen3"
    assert ours.fields["tokenizer.ggml.tokens"] == GgufArray(8, VOCAB)
