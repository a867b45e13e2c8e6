"""Our LLaMA-family forward pass over one packed batch (no padding).

Every token of the batch (prompt chunks, single decode tokens, tree nodes of several requests)
goes through each layer together; only attention looks at request boundaries, through
`AttentionMetadata`. Logits are computed only for the rows the caller asks for.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Literal

import torch
from torch import nn

from kernels.attention_metadata import AttentionMetadata
from shared.model.config import ModelConfig
from shared.model.linear import (
    DEFAULT_TOKEN_COUNTS,
    LinearPlan,
    PlannedLinear,
    available_kernels,
    batch_invariant_kernels,
    choose,
    measure,
)
from shared.model.quantized import (
    HEAD_OUTLIER_CHANNELS,
    Int8TokenLinear,
    int8_supported,
    quantized_linear,
)
from shared.model.rope import RopeScaling, inverse_frequencies

AttentionFn = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata, float], torch.Tensor
]


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


class RotaryEmbedding:
    """cos/sin tables for all positions, computed once (HF's rotate-half convention)."""

    def __init__(
        self,
        head_dim: int,
        theta: float,
        max_positions: int,
        device: torch.device,
        scaling: RopeScaling | None = None,
    ):
        inv_freq, attention_factor = inverse_frequencies(head_dim, theta, scaling)
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)
        self.cos = (emb.cos() * attention_factor).to(device)  # [P, D]
        self.sin = (emb.sin() * attention_factor).to(device)

    def tables(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for these positions, [T, 1, D], computed once per forward."""
        return (
            self.cos[positions].unsqueeze(1).to(dtype),
            self.sin[positions].unsqueeze(1).to(dtype),
        )

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [T, H, D] -> rotated x."""
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rotated * sin


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        q_size = cfg.num_heads * cfg.head_dim
        kv_size = cfg.num_kv_heads * cfg.head_dim
        self.q_size, self.kv_size = q_size, kv_size
        self.input_norm = nn.Parameter(torch.ones(cfg.hidden_size), requires_grad=False)
        self.post_attn_norm = nn.Parameter(torch.ones(cfg.hidden_size), requires_grad=False)
        self.qkv_proj = nn.Linear(cfg.hidden_size, q_size + 2 * kv_size, bias=cfg.has_qkv_bias)
        self.o_proj = nn.Linear(q_size, cfg.hidden_size, bias=cfg.has_o_bias)
        self.gate_up_proj = nn.Linear(
            cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.has_mlp_bias
        )
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.has_mlp_bias)
        # Qwen3: RMSNorm weights over each q and k head, applied before RoPE
        self.q_norm: nn.Parameter | None = None
        self.k_norm: nn.Parameter | None = None
        if cfg.has_qk_norm:
            self.q_norm = nn.Parameter(torch.ones(cfg.head_dim), requires_grad=False)
            self.k_norm = nn.Parameter(torch.ones(cfg.head_dim), requires_grad=False)


class LlamaModel(nn.Module):
    """Weights plus a stateless forward; the KV cache is passed in (the runner owns it)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        num_out = cfg.num_output_tokens or cfg.vocab_size
        rank = cfg.embedding_rank
        self.embed_tokens = nn.Embedding(cfg.vocab_size, rank or cfg.hidden_size)
        self.embed_proj = nn.Linear(rank, cfg.hidden_size, bias=False) if rank else None
        feature = cfg.feature_size
        # [hidden, hidden + feature]: fuses (token embedding, feature) into the first layer's input
        self.feature_fc = (
            nn.Linear(cfg.hidden_size + feature, cfg.hidden_size, bias=False) if feature else None
        )
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = nn.Parameter(torch.ones(cfg.hidden_size), requires_grad=False)
        self.lm_head = nn.Linear(cfg.hidden_size, num_out, bias=False)
        # Full-vocabulary id of each output row (identity unless the output vocab is reduced).
        self.register_buffer("output_token_ids", torch.arange(num_out), persistent=False)
        self.rope: RotaryEmbedding | None = None
        # Per-layer (qkv, o, gate_up, down) and head callables chosen by `plan_kernels`;
        # None = the nn.Linear modules themselves (plain F.linear).
        self.linear_plan: LinearPlan | None = None
        self._layer_linears: list[tuple[Callable[[torch.Tensor], torch.Tensor], ...]] | None = None
        self._head_linear: Callable[[torch.Tensor], torch.Tensor] | None = None
        # `quantize_int8` was applied: "tensor" (a draft's) or "token" (a target's) scales
        self.int8_scales: Literal["tensor", "token"] | None = None
        self.requires_grad_(False)

    def init_rope(self, device: torch.device) -> None:
        cfg = self.cfg
        self.rope = RotaryEmbedding(
            cfg.head_dim, cfg.rope_theta, cfg.max_position_embeddings, device, cfg.rope_scaling
        )

    # ---- kernel choice per layer shape and token count (see shared/model/linear.py) -----------
    LAYER_ROLES = ("qkv", "o", "gate_up", "down")

    def _role_linears(self) -> dict[str, list[nn.Linear]]:
        roles: dict[str, list[nn.Linear]] = {r: [] for r in self.LAYER_ROLES}
        for layer in self.layers:
            for role, mod in zip(self.LAYER_ROLES, self._layer_modules(layer), strict=True):
                roles[role].append(mod)
        roles["lm_head"] = [self.lm_head]
        return roles

    @staticmethod
    def _layer_modules(layer: DecoderLayer) -> tuple[nn.Linear, ...]:
        return (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj)

    def plan_kernels(
        self,
        token_counts: Sequence[int] = DEFAULT_TOKEN_COUNTS,
        *,
        plan: LinearPlan | None = None,
        rounds: int = 5,
        copy_gain: float = 0.10,
        uniform_tolerance: float = 0.10,
    ) -> LinearPlan:
        """Choose each linear layer's kernel per token-count bucket and use it from now on.

        Without `plan`, measures every candidate on this model's weights (a few seconds) and
        chooses with `linear.choose`; with `plan` (e.g. `LinearPlan.from_dict` of another
        process's plan) applies it as is. Call after moving the model to its device and after
        loading its weights. Returns the plan in use.
        """
        if self.is_int8:
            raise RuntimeError("an int8 model runs its own kernels; plan before quantize_int8()")
        device = next(self.parameters()).device
        kernels = available_kernels(device)
        roles = self._role_linears()
        if plan is None:
            weights = {r: [(m.weight, m.bias) for m in mods] for r, mods in roles.items()}
            buckets = sorted(set(token_counts))
            timings = measure(weights, buckets, kernels, rounds=rounds)
            plan = choose(
                timings,
                buckets,
                kernels,
                copy_gain=copy_gain,
                invariant=batch_invariant_kernels(weights, buckets, kernels),
                uniform_tolerance=uniform_tolerance,
            )
        self.set_linear_plan(plan)
        return plan

    def set_linear_plan(self, plan: LinearPlan | None) -> None:
        """Use `plan` (None: plain F.linear everywhere, the default)."""
        if self.is_int8:
            raise RuntimeError("an int8 model runs its own kernels and takes no linear plan")
        self.linear_plan = plan
        if plan is None:
            self._layer_linears = None
            self._head_linear = None
            return
        kernels = available_kernels(next(self.parameters()).device)
        self._layer_linears = [
            tuple(
                PlannedLinear(m.weight, m.bias, role, plan, kernels)
                for role, m in zip(self.LAYER_ROLES, self._layer_modules(layer), strict=True)
            )
            for layer in self.layers
        ]
        self._head_linear = PlannedLinear(
            self.lm_head.weight, self.lm_head.bias, "lm_head", plan, kernels
        )

    @property
    def is_int8(self) -> bool:
        return self.int8_scales is not None

    def quantize_int8(self, *, per_token: bool = False) -> None:
        """Run the decoder layers' linear layers and the output head with int8 weights from
        now on (`shared/model/quantized.py`): on a CPU, where a forward is bound by the bytes of
        its weights. A draft's activations take one scale per call; with `per_token` (a
        target's) one per token, so no token's result depends on the others of its forward.
        Input projections, embeddings and norms stay as they are, and so do the full-precision
        weights (training and export read them). Irreversible."""
        if not int8_supported(next(self.parameters()).device, per_token=per_token):
            raise RuntimeError(
                "an int8 target needs PyTorch's int8 matrix product on a CPU"
                if per_token
                else "int8 weights need PyTorch's FBGEMM kernels on an x86 CPU"
            )
        scales: Literal["tensor", "token"] = "token" if per_token else "tensor"
        if self.int8_scales is not None:
            if self.int8_scales != scales:
                raise RuntimeError(f"already int8 with one scale per {self.int8_scales}")
            return
        self.linear_plan = None
        if per_token:
            self._layer_linears = [
                tuple(Int8TokenLinear(m.weight, m.bias) for m in self._layer_modules(layer))
                for layer in self.layers
            ]
            self._head_linear = Int8TokenLinear(self.lm_head.weight, self.lm_head.bias)
        else:
            self._layer_linears = [
                tuple(quantized_linear(m) for m in self._layer_modules(layer))
                for layer in self.layers
            ]
            # a feature-level draft's head reads a (predicted) target feature, whose few huge
            # channels would set the activation scale for all (shared/model/quantized.py)
            outliers = HEAD_OUTLIER_CHANNELS if self.cfg.feature_size else 0
            self._head_linear = quantized_linear(self.lm_head, outliers)
        self.int8_scales = scales

    def planned_extra_bytes(self) -> int:
        """Memory the plan's weight copies (transposed / packed layouts) take."""
        linears = [*(lin for lins in self._layer_linears or () for lin in lins)]
        if self._head_linear is not None:
            linears.append(self._head_linear)
        return sum(lin.extra_bytes() for lin in linears if isinstance(lin, PlannedLinear))

    def hidden_states(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        meta: AttentionMetadata,
        k_cache: torch.Tensor,  # [L, num_blocks, block_size, Hkv, D]
        v_cache: torch.Tensor,
        attention: AttentionFn,
        features: torch.Tensor | None = None,  # [T, feature_size]: feature-level models only
    ) -> torch.Tensor:  # [T, hidden]
        cfg = self.cfg
        assert self.rope is not None, "call init_rope() after moving the model to its device"
        num_tokens = input_ids.shape[0]
        scale = cfg.head_dim**-0.5
        slots = meta.slot_mapping
        x = self.embed_tokens(input_ids)
        if self.embed_proj is not None:
            x = self.embed_proj(x)
        if self.feature_fc is not None:
            if features is None or features.shape != (num_tokens, cfg.feature_size):
                got = None if features is None else tuple(features.shape)
                raise ValueError(
                    f"a feature-level model needs features [{num_tokens}, {cfg.feature_size}], "
                    f"got {got}"
                )
            x = self.feature_fc(torch.cat([x, features.to(x.dtype)], dim=-1))
        cos, sin = self.rope.tables(positions, x.dtype)
        planned = self._layer_linears
        for i, layer in enumerate(self.layers):
            qkv_proj, o_proj, gate_up_proj, down_proj = (
                planned[i] if planned is not None else self._layer_modules(layer)
            )
            h = rms_norm(x, layer.input_norm, cfg.rms_norm_eps)
            qkv = qkv_proj(h)
            qk_size = layer.q_size + layer.kv_size
            # q and k lie side by side in qkv: one rotation covers both heads
            qk = qkv[:, :qk_size].view(num_tokens, cfg.num_heads + cfg.num_kv_heads, cfg.head_dim)
            if layer.q_norm is not None and layer.k_norm is not None:
                q, k = qk.split([cfg.num_heads, cfg.num_kv_heads], dim=1)
                qk = torch.cat(
                    [
                        rms_norm(q, layer.q_norm, cfg.rms_norm_eps),
                        rms_norm(k, layer.k_norm, cfg.rms_norm_eps),
                    ],
                    dim=1,
                )
            qk = self.rope.apply(qk, cos, sin)
            q, k = qk.split([cfg.num_heads, cfg.num_kv_heads], dim=1)
            v = qkv[:, qk_size:].view(num_tokens, cfg.num_kv_heads, cfg.head_dim)
            k_cache[i].flatten(0, 1)[slots] = k
            v_cache[i].flatten(0, 1)[slots] = v
            o = attention(q, k_cache[i], v_cache[i], meta, scale)
            x = x + o_proj(o.reshape(num_tokens, -1))
            h = rms_norm(x, layer.post_attn_norm, cfg.rms_norm_eps)
            gate, up = gate_up_proj(h).chunk(2, dim=-1)
            x = x + down_proj(torch.nn.functional.silu(gate) * up)
        return x

    def output_features(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, hidden]
        """What the output head reads: the last layer's output after the final norm. The
        target's are the features a feature-level draft consumes; a feature-level draft's own
        are its prediction of the target's features at the next position."""
        return rms_norm(hidden, self.norm, self.cfg.rms_norm_eps)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [N, hidden] -> [N, num_out]
        return self.head_logits(self.output_features(hidden))

    def head_logits(self, features: torch.Tensor) -> torch.Tensor:  # [N, hidden] -> [N, num_out]
        """Logits from `output_features` already computed."""
        head = self._head_linear or self.lm_head
        return head(features).float()
