"""A committed Augury draft as a transformers `LlamaForCausalLM` computing the same function.

Our drafts factorize the input embedding (or share the target's) and predict a reduced
vocabulary; transformers' assisted generation needs a plain LlamaForCausalLM, so we materialize the
embedding (E @ P^T, or the target's rows) and give the lm_head a bias of -inf (as -1e9) on every
token outside the draft's output vocabulary.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import LlamaConfig, LlamaForCausalLM

from shared.model.loader import read_target_embedding

NEG_INF = -1e9


def hf_llama_from_draft(draft_dir: Path, target_dir: Path) -> LlamaForCausalLM:
    """`target_dir` supplies the input embedding of a draft that shares the target's."""
    cfg = json.loads((draft_dir / "config.json").read_text())
    w = {
        k: v.float() if v.is_floating_point() else v
        for k, v in load_file(str(draft_dir / "model.safetensors")).items()
    }
    if cfg.get("augury_shares_target_embedding"):
        w["model.embed_tokens.weight"] = read_target_embedding(draft_dir, target_dir).float()
    hf_cfg = LlamaConfig(
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_hidden_layers=cfg["num_hidden_layers"],
        num_attention_heads=cfg["num_attention_heads"],
        num_key_value_heads=cfg["num_key_value_heads"],
        head_dim=cfg.get("head_dim"),
        max_position_embeddings=cfg["max_position_embeddings"],
        rms_norm_eps=cfg["rms_norm_eps"],
        rope_theta=cfg.get("rope_theta", 10000.0),
        tie_word_embeddings=False,
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_id=cfg.get("eos_token_id"),
    )
    model = LlamaForCausalLM(hf_cfg)
    embed = w.pop("model.embed_tokens.weight")
    if "augury.embed_proj.weight" in w:
        embed = embed @ w.pop("augury.embed_proj.weight").T  # [vocab, rank] @ [rank, hidden]
    state = {"model.embed_tokens.weight": embed}
    output_ids = w.pop("augury.output_token_ids", None)
    head = w.pop("lm_head.weight")
    state.update(w)
    missing = model.load_state_dict(state, strict=False)
    assert set(missing.missing_keys) <= {"lm_head.weight"}, missing
    lm_head = torch.nn.Linear(hf_cfg.hidden_size, hf_cfg.vocab_size, bias=True)
    with torch.no_grad():
        if output_ids is None:
            lm_head.weight.copy_(head)
            lm_head.bias.zero_()
        else:
            lm_head.weight.zero_()
            lm_head.weight[output_ids] = head
            lm_head.bias.fill_(NEG_INF)
            lm_head.bias[output_ids] = 0.0
    model.lm_head = lm_head
    return model.eval()
