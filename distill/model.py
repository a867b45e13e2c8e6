"""Draft architectures, the trainable LLaMA module, and export to an Augury checkpoint directory.

A draft is a LLaMA-architecture decoder with size-saving twists that `shared.model.load_model`
understands:

- a factorized input embedding: `model.embed_tokens.weight` [vocab, rank] and
  `augury.embed_proj.weight` [hidden, rank] (config key `augury_embedding_rank`), initialized from
  the principal components of the target's embedding matrix;
- or, for a draft as wide as the target, the target's own input embedding, not stored (config key
  `augury_shares_target_embedding`; the loader reads it from the target checkpoint), with layers
  initialized from the target's first layers (`DraftSpec.target_layers`);
- a reduced output vocabulary: `lm_head.weight` [N, hidden] over the target's N most frequent
  predicted tokens, `augury.output_token_ids` maps rows to full-vocabulary ids (config key
  `augury_num_output_tokens`). Verification stays exact: the target checks every drafted token.

The forward here (padded batch, causal SDPA) computes the same function as our runtime's forward
over the paged KV cache; `tests/test_drafts.py` checks that on an exported draft.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

from shared.model.loader import read_target_embedding
from shared.model.model_set import ALL_DRAFT_NAMES, QWEN_FEATURE_DRAFT_NAME, SMOLLM2


@dataclass(frozen=True)
class DraftSpec:
    name: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    embedding_rank: int | None  # None: the full-width input embedding
    num_output_tokens: int
    train_steps: int
    lr: float
    # Initialize layer i from target layer `target_layers[i]` (same width as the target).
    target_layers: tuple[int, ...] = ()
    # The input embedding is the target's own: frozen, not exported (the loader reads it from
    # the target checkpoint). Needs hidden_size equal to the target's.
    shares_target_embedding: bool = False
    # Feature-level (EAGLE-style) when > 0: each position reads the target's feature of this width
    # beside its token, fused by `feature_fc`; the draft predicts the target's next feature and
    # reads the target's own output head (frozen, not exported) from it.
    feature_size: int = 0
    # EAGLE-3's fusion (an experiment, `python -m distill fusion`): the target's features are the
    # outputs of these target layers side by side (low, middle, high), projected to
    # `feature_size` by `fuse`; deeper tree levels read the draft's own output instead, and no
    # loss regresses it onto the target's features. Empty: the last layer's (after the final norm).
    fused_layers: tuple[int, ...] = ()

    @property
    def is_feature_level(self) -> bool:
        return self.feature_size > 0

    @property
    def regresses_features(self) -> bool:
        """Whether training pulls the draft's output toward the target's next feature."""
        return self.is_feature_level and not self.fused_layers

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


# Three heterogeneous drafts (Spin's SSM set), all under 60 MB of fp16 together:
# - draft-s: a narrow 1-layer decoder trained from scratch (factorized input embedding);
# - draft-m, draft-l: the target's own first 1 / 3 layers at full width, then distilled; they
#   share the target's input embedding and train their own reduced-vocabulary head.
DRAFT_SPECS: dict[str, DraftSpec] = {
    "draft-s": DraftSpec(
        "draft-s", hidden_size=256, num_layers=1, num_heads=4, num_kv_heads=2,
        intermediate_size=768, embedding_rank=48, num_output_tokens=8192,
        train_steps=3000, lr=3e-3,
    ),
    "draft-m": DraftSpec(
        "draft-m", hidden_size=576, num_layers=1, num_heads=9, num_kv_heads=3,
        intermediate_size=1536, embedding_rank=None, num_output_tokens=8192,
        train_steps=2000, lr=1e-3, target_layers=(0,), shares_target_embedding=True,
    ),
    "draft-l": DraftSpec(
        "draft-l", hidden_size=576, num_layers=3, num_heads=9, num_kv_heads=3,
        intermediate_size=1536, embedding_rank=None, num_output_tokens=8192,
        train_steps=3000, lr=1e-3, target_layers=(0, 1, 2), shares_target_embedding=True,
    ),
    "draft-e": DraftSpec(
        "draft-e", hidden_size=576, num_layers=1, num_heads=9, num_kv_heads=3,
        intermediate_size=1536, embedding_rank=None, num_output_tokens=8192,
        train_steps=3000, lr=1e-3, shares_target_embedding=True, feature_size=576,
    ),
    # The qwen2.5-coder 1.5B's feature draft: one layer at the target's width (12 / 2 heads of
    # 128 as the target's), a narrower MLP than the target's 8960 to train in under an hour on
    # two cores; its output vocabulary is the 32k-token head's of `qwen2.5-coder-0.5b-32k`.
    "qwen2.5-coder-e": DraftSpec(
        "qwen2.5-coder-e", hidden_size=1536, num_layers=1, num_heads=12, num_kv_heads=2,
        intermediate_size=4096, embedding_rank=None, num_output_tokens=32768,
        train_steps=1200, lr=1e-3, shares_target_embedding=True, feature_size=1536,
    ),
}  # fmt: skip
# The drafts `python -m distill build --model-set NAME` trains, in seed order.
MODEL_SET_DRAFTS: dict[str, tuple[str, ...]] = {
    SMOLLM2: ALL_DRAFT_NAMES,
    "qwen2.5-coder": (QWEN_FEATURE_DRAFT_NAME,),
}


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def own_features(inputs: torch.Tensor, predicted: torch.Tensor) -> torch.Tensor:
    """Pair i reads the feature predicted at pair i-1 (pair 0 keeps the target's): [B, T, F]."""
    return torch.cat([inputs[:, :1], predicted[:, :-1].to(inputs.dtype)], dim=1)


def _chain_mask(seq: int, level: int, device: torch.device) -> torch.Tensor:
    """Which keys a query of pass `level` (0-based; level + 1 is the tree level) may see, over
    the keys of passes 0..level laid side by side: [seq, (level + 1) * seq], True = visible.
    Pair i sees pass 0 at pairs <= i - level (the committed context and its chain's root) and
    pass l at pair i - level + l (its chain), as a draft's tree node level + 1 deep does."""
    i = torch.arange(seq, device=device)[:, None]
    j = torch.arange(seq, device=device)[None, :]
    blocks = [j <= i - level] + [j == i - level + lv for lv in range(1, level + 1)]
    return torch.cat(blocks, dim=1)


class _Layer(nn.Module):
    def __init__(self, spec: DraftSpec) -> None:
        super().__init__()
        h, d = spec.hidden_size, spec.head_dim
        self.input_norm = nn.Parameter(torch.ones(h))
        self.post_attn_norm = nn.Parameter(torch.ones(h))
        self.q_proj = nn.Linear(h, spec.num_heads * d, bias=False)
        self.k_proj = nn.Linear(h, spec.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(h, spec.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(spec.num_heads * d, h, bias=False)
        self.gate_proj = nn.Linear(h, spec.intermediate_size, bias=False)
        self.up_proj = nn.Linear(h, spec.intermediate_size, bias=False)
        self.down_proj = nn.Linear(spec.intermediate_size, h, bias=False)


class TrainableDraft(nn.Module):
    """The draft as a plain module over padded [B, T] batches (training and offline scoring)."""

    def __init__(
        self,
        spec: DraftSpec,
        vocab_size: int,
        output_token_ids: torch.Tensor,
        *,
        rope_theta: float = 10000.0,
        max_positions: int = 2048,
        rms_norm_eps: float = 1e-5,
    ) -> None:
        super().__init__()
        self.spec = spec
        self.vocab_size = vocab_size
        self.rope_theta = rope_theta
        self.max_positions = max_positions
        self.eps = rms_norm_eps
        rank = spec.embedding_rank
        self.embed_tokens = nn.Embedding(vocab_size, rank or spec.hidden_size)
        self.embed_proj = nn.Linear(rank, spec.hidden_size, bias=False) if rank else None
        self.feature_fc = (
            nn.Linear(spec.hidden_size + spec.feature_size, spec.hidden_size, bias=False)
            if spec.is_feature_level
            else None
        )
        width = len(spec.fused_layers) * spec.feature_size
        self.fuse = nn.Linear(width, spec.feature_size, bias=False) if width else None
        self.layers = nn.ModuleList(_Layer(spec) for _ in range(spec.num_layers))
        self.norm = nn.Parameter(torch.ones(spec.hidden_size))
        self.lm_head = nn.Linear(spec.hidden_size, len(output_token_ids), bias=False)
        self.register_buffer("output_token_ids", output_token_ids.long().clone())
        d = spec.head_dim
        inv_freq = 1.0 / (rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin(), persistent=False)

    def freeze_target_tensors(self) -> None:
        """The target's own tensors a draft reads (shared embedding, a feature draft's head) are
        not trained: they are not exported, the runtime reads the target's."""
        self.embed_tokens.weight.requires_grad_(not self.spec.shares_target_embedding)
        self.lm_head.weight.requires_grad_(not self.spec.is_feature_level)

    def init_from_target(self, target: dict[str, torch.Tensor], seed: int) -> None:
        """Initialize from the target's tensors (HF names).

        Random layers (GPT-2 scaled residual init) unless `spec.target_layers` names target layers
        to copy. The input embedding is the target's own when shared, else a factorized one from
        the top principal directions of the target's embedding; the output head is the target's
        rows for the draft's vocabulary when shared, else the transposed input path.
        """
        gen = torch.Generator().manual_seed(seed)
        spec = self.spec
        std = 0.02
        for p in self.parameters():
            if p.dim() == 2:
                p.data.normal_(0.0, std, generator=gen)
        for layer in self.layers:
            assert isinstance(layer, _Layer)
            for lin in (layer.o_proj, layer.down_proj):
                lin.weight.data.mul_(1.0 / (2 * spec.num_layers) ** 0.5)
        for layer, source in zip(self.layers, spec.target_layers, strict=False):
            assert isinstance(layer, _Layer)
            _copy_target_layer(layer, target, source)
        emb = target["model.embed_tokens.weight"].float()
        head_rows = target.get("lm_head.weight", target["model.embed_tokens.weight"]).float()
        if self.embed_proj is None:  # full width: the target's embedding, head and final norm
            self.embed_tokens.weight.data.copy_(emb)
            self.lm_head.weight.data.copy_(head_rows[self.output_token_ids])
            self.freeze_target_tensors()
            self.norm.data.copy_(target["model.norm.weight"].float())
            if self.feature_fc is not None:  # start by passing the target's feature through
                fc = self.feature_fc.weight.data  # [hidden, hidden + feature]
                fc[:, spec.hidden_size :] = torch.eye(spec.hidden_size, spec.feature_size)
            if self.fuse is not None:  # ... and of the fused ones, the highest layer's
                fused = self.fuse.weight.data  # [feature, layers * feature]
                fused[:, -spec.feature_size :] += torch.eye(spec.feature_size)
            return
        centered = emb - emb.mean(0, keepdim=True)
        _, _, vh = torch.linalg.svd(centered[:: max(1, len(emb) // 16384)], full_matrices=False)
        basis = vh[: self.embed_proj.in_features]  # [r, target_hidden]
        low = emb @ basis.T  # [V, r]
        low = low / low.std()
        self.embed_tokens.weight.data.copy_(low)
        proj = self.embed_proj.weight.data  # [hidden, r]
        proj.normal_(0.0, 1.0 / proj.shape[1] ** 0.5, generator=gen)
        head = low[self.output_token_ids] @ proj.T  # [N, hidden]
        self.lm_head.weight.data.copy_(head / head.std() * std)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [B, T] -> logits [B, T, N] over the reduced output vocabulary (fp32)."""
        return self.forward_features(input_ids)[0]

    def target_features(self, features: torch.Tensor) -> torch.Tensor:
        """The target's features as the draft reads them: [B, T, F] (fused layers [B, T, L * F]
        projected to F by `fuse`; the last layer's as they are)."""
        return features if self.fuse is None else self.fuse(features.to(self.fuse.weight.dtype))

    def forward_features(
        self, input_ids: torch.Tensor, features: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """input_ids [B, T] (and, feature-level, the target's features [B, T, F] at the position
        before each token, as `target_features` returns them) -> logits [B, T, N] (fp32) and
        output features [B, T, hidden] (the final norm's output, what the head reads: a
        feature-level draft's prediction of the target's feature at the token's position)."""
        return self._forward(self._embed(input_ids), features, None)

    def forward_levels(
        self, input_ids: torch.Tensor, features: torch.Tensor, num_levels: int
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """A feature-level draft's tree levels 1..num_levels at every pair, teacher-forced.

        Level 1 is `forward_features` on the target's features (`target_features`). Level L
        at pair i is the node L - 1 deep in a chain rooted at pair i - L + 1: it reads the
        feature level L - 1 predicted at pair i - 1 and attends, as when drafting, to the
        committed context (level 1's keys at pairs <= i - L + 1) and to its chain (level l's
        key at pair i - L + l).
        Returns (logits [B, T, N], predicted features [B, T, hidden]) per level."""
        x0 = self._embed(input_ids)
        keys: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in self.layers]
        levels = []
        inputs = features
        for _ in range(num_levels):
            logits, predicted = self._forward(x0, inputs, keys)
            levels.append((logits, predicted))
            inputs = own_features(features, predicted)
        return levels

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        return x if self.embed_proj is None else self.embed_proj(x)

    def _forward(
        self,
        x: torch.Tensor,
        features: torch.Tensor | None,
        keys: list[list[tuple[torch.Tensor, torch.Tensor]]] | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One pass over the layers. `keys[layer]` holds the earlier levels' (k, v) [B, Hkv, T,
        D] (see `forward_levels`) and this pass's are appended; with none before it (or no
        `keys`: a plain forward) the mask is the causal one."""
        spec = self.spec
        bsz, seq = x.shape[:2]
        d = spec.head_dim
        cos = self.cos[:seq].to(self.norm.dtype)[None, None]
        sin = self.sin[:seq].to(self.norm.dtype)[None, None]
        if self.feature_fc is not None:
            assert features is not None, "a feature-level draft reads the target's features"
            x = self.feature_fc(torch.cat([x, features.to(x.dtype)], dim=-1))
        level = len(keys[0]) if keys is not None else 0
        mask = None if level == 0 else _chain_mask(seq, level, x.device)
        for i, layer in enumerate(self.layers):
            assert isinstance(layer, _Layer)
            h = _rms_norm(x, layer.input_norm, self.eps)
            q = layer.q_proj(h).view(bsz, seq, spec.num_heads, d).transpose(1, 2)
            k = layer.k_proj(h).view(bsz, seq, spec.num_kv_heads, d).transpose(1, 2)
            v = layer.v_proj(h).view(bsz, seq, spec.num_kv_heads, d).transpose(1, 2)
            q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
            if keys is not None:
                keys[i].append((k, v))
            if level > 0:
                k = torch.cat([kv[0] for kv in keys[i]], dim=2)
                v = torch.cat([kv[1] for kv in keys[i]], dim=2)
            if spec.num_kv_heads != spec.num_heads:
                rep = spec.num_heads // spec.num_kv_heads
                k = k.repeat_interleave(rep, dim=1)
                v = v.repeat_interleave(rep, dim=1)
            if mask is None:
                o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            else:
                o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            x = x + layer.o_proj(o.transpose(1, 2).reshape(bsz, seq, -1))
            h = _rms_norm(x, layer.post_attn_norm, self.eps)
            x = x + layer.down_proj(F.silu(layer.gate_proj(h)) * layer.up_proj(h))
        out = _rms_norm(x, self.norm, self.eps)
        return self.lm_head(out).float(), out

    def num_parameters(self) -> int:
        """Parameters the draft's checkpoint stores (a shared target embedding or head is not
        counted)."""
        shared = self.embed_tokens.weight.numel() if self.spec.shares_target_embedding else 0
        if self.spec.is_feature_level:
            shared += self.lm_head.weight.numel()
        return sum(p.numel() for p in self.parameters()) - shared


def _copy_target_layer(layer: _Layer, target: dict[str, torch.Tensor], source: int) -> None:
    p = f"model.layers.{source}."
    layer.input_norm.data.copy_(target[p + "input_layernorm.weight"].float())
    layer.post_attn_norm.data.copy_(target[p + "post_attention_layernorm.weight"].float())
    for n in ("q", "k", "v", "o"):
        getattr(layer, f"{n}_proj").weight.data.copy_(target[p + f"self_attn.{n}_proj.weight"])
    for n in ("gate", "up", "down"):
        getattr(layer, f"{n}_proj").weight.data.copy_(target[p + f"mlp.{n}_proj.weight"])


def hf_config(draft: TrainableDraft, *, bos_token_id: int, eos_token_id: int) -> dict:
    spec = draft.spec
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": draft.vocab_size,
        "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size,
        "num_hidden_layers": spec.num_layers,
        "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads,
        "head_dim": spec.head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": draft.eps,
        "rope_theta": draft.rope_theta,
        "max_position_embeddings": draft.max_positions,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "bos_token_id": bos_token_id,
        "eos_token_id": eos_token_id,
        "torch_dtype": "float16",
        "augury_num_output_tokens": len(draft.output_token_ids),
        "augury_embedding_rank": spec.embedding_rank,
        "augury_shares_target_embedding": spec.shares_target_embedding,
        "augury_draft_spec": asdict(spec),
    } | (
        {"augury_feature_size": spec.feature_size, "augury_shares_target_head": True}
        if spec.is_feature_level
        else {}
    )


def new_draft(
    spec: DraftSpec,
    target_dir: Path,
    tensors: dict[str, torch.Tensor],
    output_token_ids: torch.Tensor,
    seed: int,
) -> TrainableDraft:
    """A draft to train for the target in `target_dir` (its RoPE, context and norm epsilon),
    initialized from `tensors`, the target's own (`data.target_init_tensors`)."""
    cfg = json.loads((target_dir / "config.json").read_text())
    rope = cfg.get("rope_theta") or cfg["rope_parameters"]["rope_theta"]
    draft = TrainableDraft(
        spec,
        tensors["model.embed_tokens.weight"].shape[0],
        output_token_ids,
        rope_theta=float(rope),
        max_positions=int(cfg["max_position_embeddings"]),
        rms_norm_eps=float(cfg["rms_norm_eps"]),
    )
    draft.init_from_target(tensors, seed=seed)
    return draft


def export_draft(
    draft: TrainableDraft,
    out_dir: Path,
    *,
    bos_token_id: int,
    eos_token_id: int,
    metadata: dict,
) -> Path:
    """Write config.json + fp16 model.safetensors (HF LLaMA tensor names) + metadata.json."""
    if draft.fuse is not None:
        raise ValueError(
            f"{draft.spec.name} fuses several target layers: an experiment the serving runtime "
            "cannot feed (its verifier returns the last layer's features)"
        )
    out_dir.mkdir(parents=True, exist_ok=True)
    t: dict[str, torch.Tensor] = {"model.norm.weight": draft.norm}
    if not draft.spec.is_feature_level:  # a feature-level draft reads the target's head
        t["lm_head.weight"] = draft.lm_head.weight
    if not draft.spec.shares_target_embedding:  # a shared one is read from the target
        t["model.embed_tokens.weight"] = draft.embed_tokens.weight
    if draft.embed_proj is not None:
        t["augury.embed_proj.weight"] = draft.embed_proj.weight
    if draft.feature_fc is not None:
        t["augury.feature_fc.weight"] = draft.feature_fc.weight
    for i, layer in enumerate(draft.layers):
        assert isinstance(layer, _Layer)
        p = f"model.layers.{i}."
        t[p + "input_layernorm.weight"] = layer.input_norm
        t[p + "post_attention_layernorm.weight"] = layer.post_attn_norm
        for n in ("q", "k", "v", "o"):
            t[p + f"self_attn.{n}_proj.weight"] = getattr(layer, f"{n}_proj").weight
        for n in ("gate", "up", "down"):
            t[p + f"mlp.{n}_proj.weight"] = getattr(layer, f"{n}_proj").weight
    tensors = {k: v.detach().to(torch.float16).contiguous() for k, v in t.items()}
    tensors["augury.output_token_ids"] = draft.output_token_ids.detach().long().contiguous()
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    config = hf_config(draft, bos_token_id=bos_token_id, eos_token_id=eos_token_id)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out_dir / "metadata.json").write_text(json.dumps(metadata, indent=2) + "\n")
    return out_dir


def load_trainable(draft_dir: Path, target_dir: Path | None = None) -> TrainableDraft:
    """Rebuild the training module from an exported draft (fp32), e.g. to check the export.

    `target_dir` supplies the input embedding of a draft that shares the target's."""
    from safetensors.torch import load_file

    config = json.loads((draft_dir / "config.json").read_text())
    raw = config["augury_draft_spec"]
    spec = DraftSpec(**{**raw, "target_layers": tuple(raw.get("target_layers", ()))})
    w = load_file(str(draft_dir / "model.safetensors"))
    if spec.shares_target_embedding:
        w["model.embed_tokens.weight"] = read_target_embedding(draft_dir, target_dir)
    if spec.is_feature_level:
        head = read_target_embedding(draft_dir, target_dir, head=True)
        w["lm_head.weight"] = head[w["augury.output_token_ids"].long()]
    draft = TrainableDraft(
        spec,
        config["vocab_size"],
        w["augury.output_token_ids"],
        rope_theta=config["rope_theta"],
        max_positions=config["max_position_embeddings"],
        rms_norm_eps=config["rms_norm_eps"],
    )
    draft.embed_tokens.weight.data.copy_(w["model.embed_tokens.weight"])
    if draft.embed_proj is not None:
        draft.embed_proj.weight.data.copy_(w["augury.embed_proj.weight"])
    if draft.feature_fc is not None:
        draft.feature_fc.weight.data.copy_(w["augury.feature_fc.weight"])
    draft.norm.data.copy_(w["model.norm.weight"])
    draft.lm_head.weight.data.copy_(w["lm_head.weight"])
    for i, layer in enumerate(draft.layers):
        assert isinstance(layer, _Layer)
        p = f"model.layers.{i}."
        layer.input_norm.data.copy_(w[p + "input_layernorm.weight"])
        layer.post_attn_norm.data.copy_(w[p + "post_attention_layernorm.weight"])
        for n in ("q", "k", "v", "o"):
            getattr(layer, f"{n}_proj").weight.data.copy_(w[p + f"self_attn.{n}_proj.weight"])
        for n in ("gate", "up", "down"):
            getattr(layer, f"{n}_proj").weight.data.copy_(w[p + f"mlp.{n}_proj.weight"])
    return draft.float().eval()
