"""Tensor parallelism of an already-built `LlamaModel`: Megatron-style sharding in place.

Each of `size` ranks keeps:

- a contiguous share of the attention heads and of the KV heads: the fused q/k/v projection is
  *column-parallel* (the rows of its heads, its bias likewise), the output projection
  *row-parallel* (the columns of its heads), followed by an all-reduce of the partial sums and
  then its bias, added once;
- a share of the MLP's intermediate channels: gate/up column-parallel, down row-parallel with an
  all-reduce (the share may be uneven: no cache depends on it);
- a share of the vocabulary rows of the output head; each rank's logits are all-gathered, so
  every rank gets the full logits (sampling reads them on rank 0);
- everything else whole: the input embedding, the norms, the rotary tables.

`model.cfg` becomes the rank's share (num_heads, num_kv_heads and intermediate_size divided),
so the unchanged forward (`LlamaModel.hidden_states`) runs the rank's heads and a `ModelRunner`
built on the sharded model sizes its paged KV cache for the rank's KV heads; the whole model's
config is kept in `model.tensor_parallel`. After the two all-reduces of each layer every rank
holds the full hidden state, so the final features a feature-level draft reads are whole on
rank 0 with no gather.

Heads that do not divide by the size are refused (`check_shardable`): replicating KV heads
would cost memory on every rank and a head split unevenly would give ranks KV caches of
different sizes, whose block tables could not be shared.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
from torch import nn

from shared.errors import UnsupportedModelError
from shared.model.config import ModelConfig
from shared.model.linear import LinearPlan
from shared.model.llama import LlamaModel

Linear = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class TensorParallelShard:
    """Which share of the whole model this rank holds."""

    rank: int
    size: int
    full_cfg: ModelConfig  # the unsharded architecture (cost profiles key on it)


def valid_sizes(cfg: ModelConfig) -> list[int]:
    """Tensor-parallel sizes the model can be split into: divisors of both head counts."""
    common = math.gcd(cfg.num_heads, cfg.num_kv_heads)
    return [n for n in range(1, common + 1) if common % n == 0]


def check_shardable(cfg: ModelConfig, size: int) -> None:
    """Refuse a split the model's heads do not allow (or a draft's extra inputs)."""
    if size < 1:
        raise UnsupportedModelError(f"tensor-parallel size must be at least 1, not {size}")
    if cfg.feature_size or cfg.embedding_rank:
        raise UnsupportedModelError("drafts run on one device; only a target is sharded")
    if cfg.num_heads % size or cfg.num_kv_heads % size:
        raise UnsupportedModelError(
            f"tensor-parallel size {size} does not divide the model's {cfg.num_heads} attention "
            f"heads and {cfg.num_kv_heads} KV heads; sizes that do: {valid_sizes(cfg)}"
        )
    if cfg.intermediate_size < size:
        raise UnsupportedModelError(f"{cfg.intermediate_size} MLP channels over {size} ranks")


def shard_bounds(total: int, size: int) -> list[int]:
    """Boundaries of `size` near-equal contiguous shares of `total` (the first ones larger)."""
    base, extra = divmod(total, size)
    bounds = [0]
    for r in range(size):
        bounds.append(bounds[-1] + base + (1 if r < extra else 0))
    return bounds


def _frozen(t: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(t.contiguous().clone(), requires_grad=False)


def _column_slice(linear: nn.Linear, rows: torch.Tensor) -> nn.Linear:
    """A Linear holding the given output rows (weight and bias alike)."""
    out = nn.Linear(linear.in_features, len(rows), bias=linear.bias is not None, device="meta")
    out.weight = _frozen(linear.weight.detach()[rows])
    if linear.bias is not None:
        out.bias = _frozen(linear.bias.detach()[rows])
    return out


class RowParallelLinear(nn.Module):
    """The input columns of one rank; `forward` sums the ranks' partial outputs (all-reduce) and
    adds the bias once. `bias` is None so that a kernel plan (`PlannedLinear(m.weight, m.bias)`)
    computes the partial product only; `reduce` finishes it."""

    def __init__(self, linear: nn.Linear, lo: int, hi: int, group: dist.ProcessGroup | None):
        super().__init__()
        self.group = group
        self.in_features, self.out_features = hi - lo, linear.out_features
        self.weight = _frozen(linear.weight.detach()[:, lo:hi])
        self.bias = None
        self.reduced_bias = None if linear.bias is None else _frozen(linear.bias.detach())

    def reduce(self, partial: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(partial, group=self.group)
        return partial if self.reduced_bias is None else partial + self.reduced_bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.reduce(nn.functional.linear(x, self.weight))


class VocabParallelHead(nn.Module):
    """One rank's rows of the output head, padded to an equal share; `forward` all-gathers the
    ranks' logits and cuts the padding, so every rank returns [N, vocab]."""

    def __init__(self, head: nn.Linear, rank: int, size: int, group: dist.ProcessGroup | None):
        super().__init__()
        self.group, self.size = group, size
        self.out_features = head.out_features
        share = -(-head.out_features // size)
        lo, hi = min(rank * share, head.out_features), min((rank + 1) * share, head.out_features)
        weight = head.weight.detach().new_zeros(share, head.in_features)
        weight[: hi - lo] = head.weight.detach()[lo:hi]
        self.weight = _frozen(weight)
        self.bias = None
        if head.bias is not None:
            bias = head.bias.detach().new_zeros(share)
            bias[: hi - lo] = head.bias.detach()[lo:hi]
            self.bias = _frozen(bias)

    def gather(self, local: torch.Tensor) -> torch.Tensor:
        local = local.contiguous()
        parts = [torch.empty_like(local) for _ in range(self.size)]
        dist.all_gather(parts, local, group=self.group)
        return torch.cat(parts, dim=-1)[..., : self.out_features]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gather(nn.functional.linear(x, self.weight, self.bias))


class _Then:
    """A planned linear layer followed by a collective (the row-parallel reduce, the head's
    gather)."""

    def __init__(self, linear: Linear, then: Linear) -> None:
        self.linear, self.then = linear, then

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return self.then(self.linear(x))

    def extra_bytes(self) -> int:
        extra = getattr(self.linear, "extra_bytes", None)
        return extra() if extra is not None else 0


class ShardedLlamaModel(LlamaModel):
    """A `LlamaModel` after `shard_model`: kernel plans keep the collectives; no int8."""

    tensor_parallel: TensorParallelShard

    def set_linear_plan(self, plan: LinearPlan | None) -> None:
        super().set_linear_plan(plan)
        if self._layer_linears is None or self._head_linear is None:
            return
        wrapped = []
        for layer, (qkv, o, gate_up, down) in zip(self.layers, self._layer_linears, strict=True):
            o = _Then(o, layer.o_proj.reduce)
            down = _Then(down, layer.down_proj.reduce)
            wrapped.append((qkv, o, gate_up, down))
        self._layer_linears = wrapped
        self._head_linear = _Then(self._head_linear, self.lm_head.gather)

    def planned_extra_bytes(self) -> int:
        linears = [lin for lins in self._layer_linears or () for lin in lins]
        if self._head_linear is not None:
            linears.append(self._head_linear)
        return sum(getattr(lin, "extra_bytes", lambda: 0)() for lin in linears)

    def quantize_int8(self) -> None:
        raise RuntimeError("a sharded target keeps its own weights (int8 is for drafts)")


def _rows(spans: Sequence[tuple[int, int]]) -> torch.Tensor:
    return torch.cat([torch.arange(lo, hi) for lo, hi in spans])


def shard_model(
    model: LlamaModel, rank: int, size: int, group: dist.ProcessGroup | None = None
) -> ShardedLlamaModel:
    """Keep rank `rank`'s share of `model` (in place; the module doc says what each rank holds)
    and return it. `group`: the process group of the ranks (None: the default group). Call after
    loading the weights and before building the model's `ModelRunner`."""
    cfg = model.cfg
    check_shardable(cfg, size)
    if model.is_int8:
        raise RuntimeError("an int8 model cannot be sharded")
    model.set_linear_plan(None)  # a plan holds the whole weights; re-plan after sharding
    d = cfg.head_dim
    heads, kv_heads = cfg.num_heads // size, cfg.num_kv_heads // size
    q_lo, kv_lo = rank * heads * d, rank * kv_heads * d
    q_total, kv_total = cfg.num_heads * d, cfg.num_kv_heads * d
    qkv_rows = _rows(
        [
            (q_lo, q_lo + heads * d),
            (q_total + kv_lo, q_total + kv_lo + kv_heads * d),
            (q_total + kv_total + kv_lo, q_total + kv_total + kv_lo + kv_heads * d),
        ]
    )
    inter = shard_bounds(cfg.intermediate_size, size)
    i_lo, i_hi = inter[rank], inter[rank + 1]
    total = cfg.intermediate_size
    gate_up_rows = _rows([(i_lo, i_hi), (total + i_lo, total + i_hi)])
    for layer in model.layers:
        layer.qkv_proj = _column_slice(layer.qkv_proj, qkv_rows)
        layer.o_proj = RowParallelLinear(layer.o_proj, q_lo, q_lo + heads * d, group)
        layer.gate_up_proj = _column_slice(layer.gate_up_proj, gate_up_rows)
        layer.down_proj = RowParallelLinear(layer.down_proj, i_lo, i_hi, group)
        layer.q_size, layer.kv_size = heads * d, kv_heads * d
    model.lm_head = VocabParallelHead(model.lm_head, rank, size, group)
    model.cfg = replace(cfg, num_heads=heads, num_kv_heads=kv_heads, intermediate_size=i_hi - i_lo)
    model.__class__ = ShardedLlamaModel
    sharded: ShardedLlamaModel = model  # type: ignore[assignment]
    sharded.tensor_parallel = TensorParallelShard(rank, size, cfg)
    return sharded


def tensor_parallel_size(model: LlamaModel) -> int:
    shard = getattr(model, "tensor_parallel", None)
    return 1 if shard is None else shard.size


def full_config(model: LlamaModel) -> ModelConfig:
    """The whole model's architecture, sharded or not."""
    shard = getattr(model, "tensor_parallel", None)
    return model.cfg if shard is None else shard.full_cfg
