"""GGUF files as checkpoints: converted once into a safetensors checkpoint directory in the cache.

`load_model("model.gguf")`, `--target model.gguf` and `--draft model.gguf` come here through
`shared.model.loader.checkpoint_dir`. transformers reads the file (through the `gguf`
package) and dequantizes every tensor to fp32 (F32, F16, BF16, Q4_0..Q8_0 and the K-quants
alike); we write the tensors as safetensors shards beside the config and the tokenizer the file
carries. The result is an ordinary checkpoint directory, loaded and checked like any other.

Before converting, the file's metadata and tensors are checked against what the conversion
carries over faithfully: an architecture we do not run, RoPE scaling recorded in the file (which
transformers' GGUF reader does not read for these architectures), a rotary dimension other than
the head size, or a tensor that would not land in the converted checkpoint is refused by name.

The cache entry is named after the file and keyed by the caller's sha256 of it (the model sets
pin one) or else by its size and modification time, so a changed file converts again.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from pathlib import Path
from typing import Any

from tqdm import tqdm

from shared.errors import UnsupportedModelError
from shared.model.gguf_header import GgufArray, GgufHeader, read_gguf_header
from shared.model.smollm2 import default_cache_dir

# GGUF `general.architecture` values we convert; others are refused.
GGUF_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")
SHARD_BYTES = 1 << 30  # bounds the extra memory of writing (each shard is copied once)

_LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_GLOBAL_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}


def gguf_tensor_name(hf_name: str) -> str:
    """The GGUF name (llama.cpp's) of a Hugging Face tensor name of these architectures."""
    if hf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[hf_name]
    m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)\.(weight|bias)", hf_name)
    if m is None or m.group(2) not in _LAYER_NAMES:
        raise UnsupportedModelError(f"tensor {hf_name!r} has no GGUF counterpart we know")
    return f"blk.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}.{m.group(3)}"


def _field(header: GgufHeader, key: str) -> Any:
    """A scalar or string metadata value, or None (arrays are not read)."""
    value = header.fields.get(key)
    return None if isinstance(value, GgufArray) else value


def check_gguf(path: Path) -> tuple[list[str], int, int | None]:
    """Refuse what the conversion would not carry over faithfully; the file's tensor names, its
    head size, and the head size transformers' GGUF reader assumes (rope.dimension_count for
    llama and mistral, else embedding_length / head_count; None for qwen3, its config class's
    default)."""
    header = read_gguf_header(path)
    arch = _field(header, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise UnsupportedModelError(
            f"{path}: general.architecture {arch!r} is not supported; "
            f"supported: {list(GGUF_ARCHITECTURES)}"
        )
    scaling = _field(header, f"{arch}.rope.scaling.type")
    if scaling not in (None, "none"):
        raise UnsupportedModelError(
            f"{path}: {arch}.rope.scaling.type {scaling!r} is not supported in GGUF files "
            "(convert the Hugging Face checkpoint, whose rope_scaling we read)"
        )
    names = [t.name for t in header.tensors]
    if "rope_freqs.weight" in names:
        raise UnsupportedModelError(
            f"{path}: tensor 'rope_freqs.weight' (llama.cpp's Llama-3 rope scaling) is not "
            "supported in GGUF files (convert the Hugging Face checkpoint instead)"
        )
    heads = _field(header, f"{arch}.attention.head_count")
    width = _field(header, f"{arch}.embedding_length")
    head_dim = gguf_head_dim(header, arch)
    value_length = _field(header, f"{arch}.attention.value_length")
    if value_length is not None and value_length != head_dim:
        raise UnsupportedModelError(
            f"{path}: {arch}.attention.value_length {value_length} differs from the key length "
            f"{head_dim}"
        )
    rotary = _field(header, f"{arch}.rope.dimension_count")
    if rotary is not None and rotary != head_dim:
        raise UnsupportedModelError(
            f"{path}: {arch}.rope.dimension_count {rotary} differs from the head size {head_dim} "
            "(partial rotary embeddings are not supported)"
        )
    q = next((t for t in header.tensors if t.name == "blk.0.attn_q.weight"), None)
    if q is not None and heads and q.dims[-1] != heads * head_dim:
        raise UnsupportedModelError(
            f"{path}: blk.0.attn_q.weight has {q.dims[-1]} rows, not head_count {heads} x "
            f"head size {head_dim} (from attention.key_length, or embedding_length {width} / "
            "head_count)"
        )
    window = _field(header, f"{arch}.attention.sliding_window")
    if window:
        raise UnsupportedModelError(
            f"{path}: {arch}.attention.sliding_window {window} is not supported in GGUF files"
        )
    # qwen3: the config class's default head size (None: always set it)
    assumed = {"llama": rotary or width // heads, "mistral": rotary or width // heads}.get(
        arch, width // heads if arch == "qwen2" else None
    )
    return names, head_dim, assumed


def gguf_head_dim(header: GgufHeader, arch: str) -> int:
    """The head size llama.cpp records: attention.key_length, else rope.dimension_count, else
    embedding_length / head_count."""
    for key in ("attention.key_length", "rope.dimension_count"):
        value = _field(header, f"{arch}.{key}")
        if value is not None:
            return int(value)
    width = _field(header, f"{arch}.embedding_length")
    return int(width // _field(header, f"{arch}.attention.head_count"))


def file_key(path: Path) -> str:
    """A cheap identity of a file's contents: its size and modification time."""
    stat = path.stat()
    return hashlib.sha256(f"{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()


def converted_dir(path: Path, *, cache_dir: Path | None = None, sha256: str | None = None) -> Path:
    key = (sha256 or file_key(path))[:16]
    return (cache_dir or default_cache_dir()) / "gguf" / f"{path.stem}-{key}"


def ensure_converted(
    path: str | Path, *, cache_dir: Path | None = None, sha256: str | None = None
) -> Path:
    """The checkpoint directory converted from the GGUF file `path`, converting it the first
    time (minutes for a 1.5B model, about four bytes of memory per parameter)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file {path} not found")
    target = converted_dir(path, cache_dir=cache_dir, sha256=sha256)
    if (target / "config.json").is_file():
        return target
    staging = target.with_name(target.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    convert(path, staging)
    shutil.rmtree(target, ignore_errors=True)
    staging.rename(target)
    return target


def convert(path: Path, out: Path) -> None:
    """Dequantize the GGUF file `path` into a checkpoint directory `out`."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    steps = tqdm(total=4, desc=f"converting {path.name} (once)", unit="step")
    names, head_dim, default_head_dim = check_gguf(path)
    gguf_names = set(names)
    steps.update()
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    steps.update()
    # transformers' GGUF reader takes the head size from rope.dimension_count (llama, mistral)
    # or not at all (qwen2, qwen3: the config class's default); the file's own overrides it
    kwargs: dict[str, Any] = {}
    if head_dim != default_head_dim:  # (reading the config parses the file's metadata again)
        kwargs["config"] = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
        kwargs["config"].head_dim = head_dim
    model = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32, **kwargs
    )
    steps.update()
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    carried = {gguf_tensor_name(name) for name in state}
    dropped, invented = sorted(gguf_names - carried), sorted(carried - gguf_names)
    if dropped or invented:
        raise UnsupportedModelError(
            f"{path}: the conversion would drop GGUF tensors {dropped[:8]} and invent "
            f"{invented[:8]}; this file's layout is not supported"
        )
    out.mkdir(parents=True)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in state.items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += nbytes
    for i, shard in enumerate(tqdm(shards, desc="writing", unit="shard", leave=False)):
        save_file(shard, str(out / f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"))
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config["architectures"] = [type(model).__name__]
    config["augury_converted_from"] = path.name
    (out / "config.json").write_text(json.dumps(config, indent=2))
    tokenizer.save_pretrained(out)
    steps.update()
    steps.close()
