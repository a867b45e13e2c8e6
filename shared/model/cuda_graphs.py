"""CUDA graphs of the model forward: one recorded launch sequence per padded token count.

An eager forward issues about 33 kernels per layer from Python; for a small model, or a large
one at small batches, the GPU then waits on the host (measured on an H200: 18-24 ms per
SmolLM2-135M forward for 2-3 ms of kernels; `bench/bench_gpu_forward.py`). A CUDA graph records
the forward's kernels once and replays them in one call.

A graph replays fixed shapes and fixed addresses, so every forward of up to `max_tokens` tokens
goes through static buffers:

- the batch's T tokens are padded to the next bucket n (1, 2, 4, 8, 12, 16, 24, ...); padded
  tokens write their KV to a scratch slot no request owns, and no attention work reads them;
- tree attention runs as a fixed launch (`kernels.attention_metadata.FixedLaunch`): a work table
  of ⌈n / tile⌉ + `max_requests` rows (what any batch of up to n tokens over up to
  `max_requests` requests needs), the rows past the batch's work no-ops; each no-op row is still
  a program per KV head, which cost 30-70 ns each on an H200, so the table is kept that short
  rather than one row per token; long prefixes are not decomposed over programs (Spin's
  request decomposition is eager-only);
- the block tables have a fixed width (the model's context in blocks) and the tree masks a fixed
  number of words; a batch wider than either, or of more than `max_requests` requests, runs
  eagerly.

Each bucket is captured on first use (a warm-up forward, then the recording), all in one shared
memory pool. The hidden states a replay returns are a view of the graph's output buffer, valid
until the next forward. Only the Triton attention can be captured: the runner builds graphs on
CUDA only.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kernels.attention_metadata import AttentionMetadata, FixedLaunch
from shared.model.llama import AttentionFn, LlamaModel

DEFAULT_MAX_TOKENS = 512
DEFAULT_MAX_REQUESTS = 64  # the services' running-set limit
MAX_TREE_WORDS = 8  # tree regions of up to 512 nodes


def graph_buckets(max_tokens: int) -> list[int]:
    """Padded token counts: 1, 2, 4, 8, then powers of two and their 1.5x midpoints, up to and
    including `max_tokens` (at most a third of a forward's rows are padding past 8)."""
    buckets = {max_tokens}
    p = 1
    while p < max_tokens:
        buckets.add(p)
        if p >= 8 and p * 3 // 2 < max_tokens:
            buckets.add(p * 3 // 2)
        p *= 2
    return sorted(buckets)


@dataclass
class PackedBatch:
    """One forward as the runner plans it on the host: T tokens over R requests."""

    tokens: list[int]  # [T]
    positions: list[int]  # [T]
    slots: np.ndarray  # [T] int64, cache slot of each token's KV
    tree_mask: np.ndarray  # [T, W] int64, ancestor bitmask words
    query_start: list[int]  # [R + 1]
    prefix_lens: list[int]  # [R]
    tree_lens: list[int]  # [R]
    block_table: np.ndarray  # [R, max_blocks] int32, -1 past each request's blocks
    features: torch.Tensor | None  # [T, feature_size] for a feature-level model

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)


class GraphedForward:
    """The model's `hidden_states` as CUDA graphs over static buffers (see the module doc)."""

    def __init__(
        self,
        model: LlamaModel,
        k_cache: torch.Tensor,  # [L, num_blocks, block_size, Hkv, D], with a scratch block
        v_cache: torch.Tensor,
        attention: AttentionFn,
        *,
        scratch_slot: int,
        max_blocks_per_request: int,
        max_tokens: int = DEFAULT_MAX_TOKENS,
        max_requests: int = DEFAULT_MAX_REQUESTS,
        capture: bool = True,
    ) -> None:
        """`capture=False` runs the same padded static-buffer forward eagerly (no graph), so
        everything but the recording can be checked on a machine without CUDA."""
        if max_tokens < 1 or max_requests < 1:
            raise ValueError(
                f"max_tokens and max_requests must be at least 1, not {max_tokens}, {max_requests}"
            )
        # imported here: importing triton chooses its interpreter or a GPU for the process
        from kernels.triton_tree_attention import (
            NUM_WORK_FIELDS,
            fixed_block_m,
            fixed_work_items,
            fixed_work_rows,
        )

        self._work_items = fixed_work_items
        cfg = model.cfg
        device = k_cache.device
        self.model, self.k_cache, self.v_cache, self.attention = model, k_cache, v_cache, attention
        self.scratch_slot = scratch_slot
        self.max_tokens = max_tokens
        self.max_requests = max_requests
        self.max_blocks = max_blocks_per_request
        self.is_capturing = capture
        self.buckets = graph_buckets(max_tokens)
        n, words = max_tokens, MAX_TREE_WORDS
        self._tokens = torch.zeros(n, dtype=torch.long, device=device)
        self._positions = torch.zeros(n, dtype=torch.long, device=device)
        self._slots = torch.full((n,), scratch_slot, dtype=torch.long, device=device)
        self._tree_mask = torch.zeros(n, words, dtype=torch.long, device=device)
        self._block_tables = torch.zeros(
            max_requests, self.max_blocks, dtype=torch.int32, device=device
        )
        self._block_m = {b: fixed_block_m(b, cfg.num_heads, cfg.num_kv_heads) for b in self.buckets}
        heads = (cfg.num_heads, cfg.num_kv_heads)
        self._rows = {
            b: fixed_work_rows(b, max_requests, self._block_m[b], *heads) for b in self.buckets
        }
        self._items = torch.zeros(
            max(self._rows.values()), NUM_WORK_FIELDS, dtype=torch.int32, device=device
        )
        self._features = (
            torch.zeros(n, cfg.feature_size, dtype=k_cache.dtype, device=device)
            if cfg.feature_size
            else None
        )
        # what a fixed launch does not read (it reads block tables, slots, masks, work rows)
        self._unread = torch.empty(0, dtype=torch.int32, device=device)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool = None

    # ---- which forwards fit ---------------------------------------------------------------------
    def bucket(self, num_tokens: int) -> int:
        return next(b for b in self.buckets if b >= num_tokens)

    def fits(self, batch: PackedBatch) -> bool:
        return (
            batch.num_tokens <= self.max_tokens
            and len(batch.prefix_lens) <= self.max_requests
            and batch.block_table.shape[1] <= self.max_blocks
            and batch.tree_mask.shape[1] <= MAX_TREE_WORDS
        )

    @property
    def num_graphs(self) -> int:
        return len(self._graphs)

    # ---- the forward ----------------------------------------------------------------------------
    def hidden_states(self, batch: PackedBatch) -> torch.Tensor:
        """[T, hidden] for a batch that `fits`: a view valid until the next call."""
        if not self.fits(batch):
            raise ValueError("the batch does not fit the graphs' static buffers")
        t, n = batch.num_tokens, self.bucket(batch.num_tokens)
        self._load(batch, n)
        if not self.is_capturing:
            return self._forward(n, batch)[:t]
        if n not in self._graphs:
            self._capture(n, batch)
        graph, out = self._graphs[n]
        graph.replay()
        return out[:t]

    def capture_all(self) -> None:
        """Record every bucket now, largest first (smaller ones reuse its memory), so that no
        forward while serving pays for a recording. The warm-up forwards write only the scratch
        slot and read only its block."""
        block_size = self.k_cache.shape[2]
        dummy = PackedBatch(
            tokens=[0],
            positions=[0],
            slots=np.array([self.scratch_slot], dtype=np.int64),
            tree_mask=np.ones((1, 1), dtype=np.int64),
            query_start=[0, 1],
            prefix_lens=[0],
            tree_lens=[1],
            block_table=np.array([[self.scratch_slot // block_size]], dtype=np.int32),
            features=None if self._features is None else self._features[:1].clone(),
        )
        for n in reversed(self.buckets):
            if n not in self._graphs:
                self._load(dummy, n)
                self._capture(n, dummy)

    def _load(self, batch: PackedBatch, n: int) -> None:
        """Copy the batch into the static buffers; rows t..n are padding."""
        t, r = batch.num_tokens, len(batch.prefix_lens)
        dev = self._tokens.device

        def put(dst: torch.Tensor, src: np.ndarray | list[int], dtype: torch.dtype) -> None:
            dst.copy_(torch.as_tensor(src, dtype=dtype), non_blocking=True)

        put(self._tokens[:t], batch.tokens, torch.long)
        put(self._positions[:t], batch.positions, torch.long)
        put(self._slots[:t], batch.slots, torch.long)
        self._slots[t:n].fill_(self.scratch_slot)
        words = batch.tree_mask.shape[1]
        put(self._tree_mask[:t, :words], batch.tree_mask, torch.long)
        put(self._block_tables[:r, : batch.block_table.shape[1]], batch.block_table, torch.int32)
        rows = self._work_items(
            self._metadata(batch, n),
            self._block_m[n],
            self.model.cfg.num_heads,
            self.model.cfg.num_kv_heads,
        )
        padded = np.zeros((self._rows[n], rows.shape[1]), dtype=np.int32)
        padded[: len(rows)] = rows  # never more: at most ceil(t / tile) + one row per request
        put(self._items[: self._rows[n]], padded, torch.int32)
        if self._features is not None:
            if batch.features is None:
                raise ValueError("a feature-level model needs features")
            self._features[:t].copy_(batch.features.to(dev, self._features.dtype))

    def _metadata(self, batch: PackedBatch, n: int) -> AttentionMetadata:
        """The static buffers of bucket n as attention metadata, with the batch's host lists."""
        return AttentionMetadata(
            query_start_loc=self._unread,
            prefix_lens=self._unread,
            tree_lens=self._unread,
            block_tables=self._block_tables,
            slot_mapping=self._slots[:n],
            tree_mask=self._tree_mask[:n],
            query_start_host=batch.query_start,
            prefix_lens_host=batch.prefix_lens,
            tree_lens_host=batch.tree_lens,
            fixed_launch=FixedLaunch(self._block_m[n], self._items[: self._rows[n]]),
        )

    def _forward(self, n: int, batch: PackedBatch) -> torch.Tensor:
        """The model over the first n rows of the static buffers."""
        features = self._features[:n] if self._features is not None else None
        return self.model.hidden_states(
            self._tokens[:n],
            self._positions[:n],
            self._metadata(batch, n),
            self.k_cache,
            self.v_cache,
            self.attention,
            features,
        )

    def _capture(self, n: int, batch: PackedBatch) -> None:
        # Warm-up on a side stream (Triton compiles, cuBLAS picks its kernels), then record.
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self._forward(n, batch)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        with torch.cuda.graph(graph, pool=self._pool):
            out = self._forward(n, batch)
        self._graphs[n] = (graph, out)
