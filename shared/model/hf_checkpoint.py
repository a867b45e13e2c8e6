"""A transformers model from one of our checkpoint directories (references, distillation).

Our converted checkpoints are split into shards without an index file, which transformers'
`from_pretrained` does not read; this loads them shard by shard, strictly: every tensor of the
model must be found and every tensor found must be used.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file


def load_transformers_model(path: Path, dtype: torch.dtype) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), dtype=dtype)
    params = model.state_dict()
    loaded: set[str] = set()
    with torch.no_grad():
        for shard in sorted(path.glob("*.safetensors")):
            for name, tensor in load_file(shard).items():
                if name not in params:
                    raise ValueError(f"{shard} holds {name!r}, which the model does not use")
                params[name].copy_(tensor)
                loaded.add(name)
    if model.config.tie_word_embeddings:
        loaded.add("lm_head.weight")  # the embedding's own tensor
    missing = sorted(set(params) - loaded)
    if missing:
        raise ValueError(f"checkpoint {path} lacks {missing[:8]}")
    return model.to(dtype).eval()
