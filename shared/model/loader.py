"""Load a local Hugging Face LLaMA-family checkpoint directory (config.json + safetensors), or a
GGUF file (converted once into a checkpoint directory in the local cache, `shared/model/gguf.py`).

Every tensor of the checkpoint is accounted for: one the model needs and the checkpoint lacks, or
one the checkpoint holds and the model would not use, is refused by name.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from shared.errors import UnsupportedModelError
from shared.model.config import ModelConfig
from shared.model.llama import DecoderLayer, LlamaModel
from shared.model.precision import TargetPrecision

OUTPUT_TOKEN_IDS_KEY = "augury.output_token_ids"
EMBED_PROJ_KEY = "augury.embed_proj.weight"
EMBED_KEY = "model.embed_tokens.weight"
FEATURE_FC_KEY = "augury.feature_fc.weight"
# Old checkpoints store RoPE's inverse frequencies as a buffer; we compute our own from the config.
IGNORED_TENSOR_SUFFIXES = (".rotary_emb.inv_freq",)


def checkpoint_dir(path: str | Path) -> Path:
    """The checkpoint directory for `path`: itself, or for a `.gguf` file the directory it was
    converted into (converting it the first time)."""
    path = Path(path)
    if path.suffix == ".gguf":
        from shared.model.gguf import ensure_converted

        return ensure_converted(path)
    return path


def read_config(path: Path) -> ModelConfig:
    path = checkpoint_dir(path)
    config_file = path / "config.json"
    if not config_file.is_file():
        raise FileNotFoundError(f"{config_file} not found: not a Hugging Face checkpoint directory")
    return ModelConfig.from_hf(json.loads(config_file.read_text()))


class _Tensors:
    """A checkpoint's tensors by name, each read from its file when taken: loading needs the
    model's memory plus one tensor, not twice the model's."""

    def __init__(self, path: Path) -> None:
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors files in {path}")
        self.path = path
        self._handles: dict[str, Any] = {}
        self._stored: dict[str, torch.Tensor] = {}
        for file in files:
            handle = safe_open(str(file), framework="pt")
            for name in handle.keys():  # noqa: SIM118 (safe_open is not a mapping)
                self._handles[name] = handle

    def __contains__(self, name: str) -> bool:
        return name in self._stored or name in self._handles

    def __iter__(self) -> Iterator[str]:
        return iter([*self._stored, *self._handles])

    def __getitem__(self, name: str) -> torch.Tensor:
        if name in self._stored:
            return self._stored[name]
        return self._handles[name].get_tensor(name)

    def __setitem__(self, name: str, tensor: torch.Tensor) -> None:
        self._handles.pop(name, None)
        self._stored[name] = tensor

    def pop(self, name: str) -> torch.Tensor:
        tensor = self[name]
        self._stored.pop(name, None)
        self._handles.pop(name, None)
        return tensor

    def take(self, name: str) -> torch.Tensor:
        """Pop a tensor the model needs (refused by name if the checkpoint lacks it)."""
        if name not in self:
            raise UnsupportedModelError(f"checkpoint {self.path} lacks tensor {name!r}")
        return self.pop(name)


def read_target_embedding(
    draft: str | Path, target: str | Path | None, *, head: bool = False
) -> torch.Tensor:
    """The input embedding a draft shares with its target (`augury_shares_target_embedding`),
    read from the target checkpoint after checking that vocabulary and width agree. With
    `head`, the target's output head instead (`augury_shares_target_head`): its `lm_head.weight`,
    or the embedding when the target ties them."""
    draft = checkpoint_dir(draft)
    cfg = read_config(draft)
    if target is None:
        raise UnsupportedModelError(
            f"draft {draft} uses its target's input embedding: load it with target_path="
        )
    target = checkpoint_dir(target)
    target_cfg = read_config(target)
    if (target_cfg.vocab_size, target_cfg.hidden_size) != (cfg.vocab_size, cfg.hidden_size):
        raise UnsupportedModelError(
            f"draft {draft} (vocab {cfg.vocab_size}, hidden {cfg.hidden_size}) cannot share the "
            f"embedding of {target} (vocab {target_cfg.vocab_size}, hidden "
            f"{target_cfg.hidden_size})"
        )
    names = [EMBED_KEY]
    if head:
        names = ["lm_head.weight"] + (names if target_cfg.tie_word_embeddings else [])
    for name in names:
        for file in sorted(target.glob("*.safetensors")):
            with safe_open(str(file), framework="pt") as f:
                if name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    return f.get_tensor(name)
    raise UnsupportedModelError(f"target checkpoint {target} lacks tensor {names[0]!r}")


def load_model(
    path: str | Path,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    *,
    target_path: str | Path | None = None,
    int8: bool = False,
) -> LlamaModel:
    """Build our `LlamaModel` from a checkpoint directory, fusing qkv and gate/up projections.

    `target_path` is the target checkpoint, needed only by a draft that shares its input embedding
    or output head (`augury_shares_target_embedding`, `augury_shares_target_head`); other
    checkpoints ignore it. `int8`: run the linear layers with int8 weights
    (`LlamaModel.quantize_int8`; drafts on a CPU only, as `quantized.uses_int8` decides; a
    target's int8 is `load_target`'s).
    """
    path = checkpoint_dir(path)
    target_path = None if target_path is None else checkpoint_dir(target_path)
    cfg = read_config(path)
    w = _Tensors(path)
    if cfg.shares_target_embedding:
        w[EMBED_KEY] = read_target_embedding(path, target_path)
    if cfg.shares_target_head:
        rows = w[OUTPUT_TOKEN_IDS_KEY].long() if OUTPUT_TOKEN_IDS_KEY in w else slice(None)
        w["lm_head.weight"] = read_target_embedding(path, target_path, head=True)[rows]
    model = LlamaModel(cfg)
    model.embed_tokens.weight.copy_(w.take(EMBED_KEY))
    if model.embed_proj is not None:
        model.embed_proj.weight.copy_(w.take(EMBED_PROJ_KEY))
    if model.feature_fc is not None:
        model.feature_fc.weight.copy_(w.take(FEATURE_FC_KEY))
    for i, layer in enumerate(model.layers):
        _load_layer(layer, cfg, w, f"model.layers.{i}.")
    model.norm.copy_(w.take("model.norm.weight"))
    _load_head(model, cfg, w)
    if OUTPUT_TOKEN_IDS_KEY in w:
        model.output_token_ids = w.take(OUTPUT_TOKEN_IDS_KEY).long()
    unused = sorted(n for n in w if not n.endswith(IGNORED_TENSOR_SUFFIXES))
    if unused:
        shown = ", ".join(repr(n) for n in unused[:8]) + (" ..." if len(unused) > 8 else "")
        raise UnsupportedModelError(
            f"checkpoint {path} holds {len(unused)} tensor(s) this model would not use: {shown}"
        )
    model = model.to(device=device, dtype=dtype)
    model.output_token_ids = model.output_token_ids.long()
    model.init_rope(torch.device(device))
    if int8:
        model.quantize_int8()
    return model.eval()


def load_target(
    path: str | Path, precision: TargetPrecision, device: str | torch.device = "cpu"
) -> LlamaModel:
    """A target at `precision` (`precision.check_target_precision`): its dtype, and int8 linear
    layers with one activation scale per token where it says int8."""
    model = load_model(path, dtype=precision.dtype, device=device)
    if precision.int8:
        model.quantize_int8(per_token=True)
    return model


def _load_layer(layer: DecoderLayer, cfg: ModelConfig, w: _Tensors, p: str) -> None:
    """One decoder layer's weights (prefix `p`), q/k/v and gate/up fused."""
    layer.input_norm.copy_(w.take(p + "input_layernorm.weight"))
    layer.post_attn_norm.copy_(w.take(p + "post_attention_layernorm.weight"))
    qkv = [w.take(p + f"self_attn.{n}_proj.weight") for n in "qkv"]
    layer.qkv_proj.weight.copy_(torch.cat(qkv, 0))
    if cfg.has_qkv_bias:
        layer.qkv_proj.bias.copy_(
            torch.cat([w.take(p + f"self_attn.{n}_proj.bias") for n in "qkv"], 0)
        )
    layer.o_proj.weight.copy_(w.take(p + "self_attn.o_proj.weight"))
    if cfg.has_o_bias:
        layer.o_proj.bias.copy_(w.take(p + "self_attn.o_proj.bias"))
    if layer.q_norm is not None and layer.k_norm is not None:
        layer.q_norm.copy_(w.take(p + "self_attn.q_norm.weight"))
        layer.k_norm.copy_(w.take(p + "self_attn.k_norm.weight"))
    gate_up = [w.take(p + f"mlp.{n}_proj.weight") for n in ("gate", "up")]
    layer.gate_up_proj.weight.copy_(torch.cat(gate_up, 0))
    layer.down_proj.weight.copy_(w.take(p + "mlp.down_proj.weight"))
    if cfg.has_mlp_bias:
        gate_up_bias = [w.take(p + f"mlp.{n}_proj.bias") for n in ("gate", "up")]
        layer.gate_up_proj.bias.copy_(torch.cat(gate_up_bias, 0))
        layer.down_proj.bias.copy_(w.take(p + "mlp.down_proj.bias"))


def _load_head(model: LlamaModel, cfg: ModelConfig, w: _Tensors) -> None:
    """The output head: stored, or tied to the input embedding where the config says so."""
    plainly_tied = (
        cfg.tie_word_embeddings
        and cfg.num_output_tokens is None
        and cfg.embedding_rank is None
        and not cfg.shares_target_embedding
    )
    if "lm_head.weight" in w:
        head = w.take("lm_head.weight")
        if plainly_tied and not torch.equal(head, model.embed_tokens.weight.to(head.dtype)):
            raise UnsupportedModelError(
                f"checkpoint {w.path} ties its embeddings (tie_word_embeddings) but stores a "
                "different lm_head.weight"
            )
        model.lm_head.weight.copy_(head)
    elif plainly_tied:
        model.lm_head.weight = model.embed_tokens.weight
    else:
        raise UnsupportedModelError(f"checkpoint {w.path} lacks lm_head.weight")
