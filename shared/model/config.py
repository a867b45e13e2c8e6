"""Architecture of a LLaMA-family checkpoint, read from its Hugging Face `config.json`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from shared.errors import UnsupportedModelError
from shared.model.rope import ROPE_TYPES, RopeScaling

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "MistralForCausalLM",
}


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
    has_o_bias: bool = False  # Llama's and Qwen3's `attention_bias` covers o_proj too
    has_mlp_bias: bool = False  # Llama's `mlp_bias`: gate, up and down projections
    has_qk_norm: bool = False  # Qwen3: RMSNorm over each head of q and k before RoPE
    rope_scaling: RopeScaling | None = None
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
        if cfg.get("hidden_act", "silu") != "silu":
            raise UnsupportedModelError(f"hidden_act {cfg.get('hidden_act')!r} is not supported")
        num_heads = cfg["num_attention_heads"]
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        rope_theta, rope_scaling = _rope(cfg)
        is_qwen2 = "Qwen2ForCausalLM" in archs
        is_qwen3 = "Qwen3ForCausalLM" in archs
        # which projections carry biases, as each architecture's transformers model builds them
        attention_bias = bool(cfg.get("attention_bias", False))
        mlp_bias = bool(cfg.get("mlp_bias", False))
        if mlp_bias and "LlamaForCausalLM" not in archs:
            raise UnsupportedModelError(f"mlp_bias is not an option of {sorted(archs)}")
        if attention_bias and not archs & {"LlamaForCausalLM", "Qwen3ForCausalLM"}:
            raise UnsupportedModelError(f"attention_bias is not an option of {sorted(archs)}")
        return cls(
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // num_heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            max_position_embeddings=_context_length(cfg),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            has_qkv_bias=attention_bias or is_qwen2,
            has_o_bias=attention_bias,
            has_mlp_bias=mlp_bias,
            has_qk_norm=is_qwen3,
            rope_scaling=rope_scaling,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            num_output_tokens=cfg.get("augury_num_output_tokens"),
            embedding_rank=cfg.get("augury_embedding_rank"),
            shares_target_embedding=bool(cfg.get("augury_shares_target_embedding", False)),
            feature_size=cfg.get("augury_feature_size"),
            shares_target_head=bool(cfg.get("augury_shares_target_head", False)),
        )


# rope parameters that change nothing we compute (transformers writes some of them itself)
_IGNORED_ROPE_KEYS = {"rope_type", "type", "rope_theta"}
_ROPE_KEYS: dict[str, set[str]] = {
    "default": set(),
    "linear": {"factor"},
    "dynamic": {"factor"},
    "llama3": {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"},
    "yarn": {
        "factor",
        "original_max_position_embeddings",
        "beta_fast",
        "beta_slow",
        "attention_factor",
        "mscale",
        "mscale_all_dim",
        "truncate",
    },
}
_REQUIRED_ROPE_KEYS = {
    "linear": {"factor"},
    "dynamic": {"factor"},
    "llama3": {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"},
    "yarn": {"original_max_position_embeddings"},
}


def _rope(cfg: dict[str, Any]) -> tuple[float, RopeScaling | None]:
    """θ and the rope scaling of a config: the old layout (`rope_theta` beside `rope_scaling`) or
    transformers 5's (`rope_parameters` holding both). Anything we would not compute exactly is
    refused, naming the field."""
    if cfg.get("partial_rotary_factor", 1.0) != 1.0:
        raise UnsupportedModelError(
            f"partial_rotary_factor {cfg['partial_rotary_factor']} is not supported (only 1.0)"
        )
    field = "rope_parameters" if cfg.get("rope_parameters") else "rope_scaling"
    params: dict[str, Any] = dict(cfg.get(field) or {})
    if any(isinstance(v, dict) for v in params.values()):
        raise UnsupportedModelError(f"{field} {params} is not supported (per-layer rope types)")
    theta = cfg.get("rope_theta")
    if theta is None:
        theta = params.get("rope_theta", 10000.0)
    rope_type = params.get("rope_type", params.get("type")) or "default"
    if rope_type not in ROPE_TYPES:
        raise UnsupportedModelError(
            f"{field}.rope_type {rope_type!r} is not supported; supported: {list(ROPE_TYPES)}"
        )
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise UnsupportedModelError(
            f"{field}.partial_rotary_factor {params['partial_rotary_factor']} is not supported"
        )
    unknown = set(params) - _ROPE_KEYS[rope_type] - _IGNORED_ROPE_KEYS - {"partial_rotary_factor"}
    if unknown:
        raise UnsupportedModelError(
            f"{field} of rope_type {rope_type!r} has fields we do not implement: {sorted(unknown)}"
        )
    if rope_type == "default":
        return float(theta), None
    missing = _REQUIRED_ROPE_KEYS[rope_type] - set(params)
    if missing:
        raise UnsupportedModelError(f"{field} of rope_type {rope_type!r} lacks {sorted(missing)}")
    known = {k: v for k, v in params.items() if k in _ROPE_KEYS[rope_type]}
    if rope_type == "yarn" and known.get("factor") is None:
        known["factor"] = cfg["max_position_embeddings"] / known["original_max_position_embeddings"]
    if rope_type == "yarn":
        # transformers reads 0 or None as the defaults
        known["beta_fast"] = known.get("beta_fast") or 32.0
        known["beta_slow"] = known.get("beta_slow") or 1.0
    return float(theta), RopeScaling(rope_type=rope_type, **known)


def _context_length(cfg: dict[str, Any]) -> int:
    """Positions we serve exactly: a sliding attention window (Mistral) caps the context, since
    our attention always sees the whole prefix (within the window both are the same)."""
    # (with dynamic NTK rope scaling, `max_position_embeddings` is the pretraining context we
    # serve: shared/model/rope.py)
    context = cfg.get("max_position_embeddings", 2048)
    window = cfg.get("sliding_window")
    layer_types = cfg.get("layer_types") or ()
    if window and (cfg.get("use_sliding_window", True) or "sliding_attention" in layer_types):
        context = min(context, window)
    return context
