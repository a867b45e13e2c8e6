"""Architecture of a LLaMA-family checkpoint, read from its Hugging Face `config.json`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from shared.errors import UnsupportedModelError

SUPPORTED_ARCHITECTURES = {"LlamaForCausalLM", "Qwen2ForCausalLM", "MistralForCausalLM"}


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    has_qkv_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # A reduced output vocabulary (a draft that predicts only the target's most frequent tokens):
    # output row i of lm_head is token `output_token_ids[i]` of the full vocabulary.
    num_output_tokens: int | None = None
    # A factorized input embedding (small drafts): embed_tokens is [vocab, rank] and a learned
    # projection `embed_proj` [hidden, rank] lifts it to the hidden size.
    embedding_rank: int | None = None
    # A draft whose input embedding is the target's own: the checkpoint does not store it and
    # `load_model` reads it from the target checkpoint (hidden sizes must match).
    shares_target_embedding: bool = False
    # A feature-level draft (EAGLE-style): each input position also reads a feature vector of
    # this width (the target's last-layer hidden state), fused with the token embedding by
    # `feature_fc`. None: an ordinary token-only model.
    feature_size: int | None = None
    # The output head is the target's own (its rows for `output_token_ids`), read from the target
    # checkpoint like a shared embedding.
    shares_target_head: bool = False

    @property
    def num_query_per_kv(self) -> int:
        return self.num_heads // self.num_kv_heads

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> ModelConfig:
        archs = set(cfg.get("architectures") or ["LlamaForCausalLM"])
        if not archs & SUPPORTED_ARCHITECTURES:
            raise UnsupportedModelError(
                f"architecture {sorted(archs)} is not supported; "
                f"supported: {sorted(SUPPORTED_ARCHITECTURES)}"
            )
        for key in ("rope_scaling", "rope_parameters"):
            rope = cfg.get(key) or {}
            if rope.get("rope_type", rope.get("type")) not in (None, "default"):
                raise UnsupportedModelError(f"{key} {rope} is not supported (only default RoPE)")
        if cfg.get("hidden_act", "silu") != "silu":
            raise UnsupportedModelError(f"hidden_act {cfg.get('hidden_act')!r} is not supported")
        num_heads = cfg["num_attention_heads"]
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        rope_theta = cfg.get("rope_theta")
        if rope_theta is None:  # transformers >= 5 nests it under rope_parameters
            rope_theta = (cfg.get("rope_parameters") or {}).get("rope_theta", 10000.0)
        is_qwen2 = "Qwen2ForCausalLM" in archs
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // num_heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            max_position_embeddings=_context_length(cfg),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            has_qkv_bias=bool(cfg.get("attention_bias", False)) or is_qwen2,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            num_output_tokens=cfg.get("augury_num_output_tokens"),
            embedding_rank=cfg.get("augury_embedding_rank"),
            shares_target_embedding=bool(cfg.get("augury_shares_target_embedding", False)),
            feature_size=cfg.get("augury_feature_size"),
            shares_target_head=bool(cfg.get("augury_shares_target_head", False)),
        )


def _context_length(cfg: dict[str, Any]) -> int:
    """Positions we serve exactly: a sliding attention window (Mistral) caps the context, since
    our attention always sees the whole prefix."""
    context = cfg.get("max_position_embeddings", 2048)
    window = cfg.get("sliding_window")
    if window and cfg.get("use_sliding_window", True):
        context = min(context, window)
    return context
