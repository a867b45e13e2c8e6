"""Paged KV cache: fixed-size blocks from one pool sized by a memory budget in bytes.

A request owns a list of blocks (its block table); logical token i of the request lives in slot
`blocks[i // block_size] * block_size + i % block_size`. Blocks are freed when the request ends,
or swapped to host memory when the scheduler preempts it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from shared.errors import OutOfKVMemoryError
from shared.model.config import ModelConfig


class BlockAllocator:
    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfKVMemoryError(
                f"KV cache exhausted: need {n} more blocks, {len(self._free)} of "
                f"{self.num_blocks} free"
            )
        # The free list is a stack with the next block on top. Blocks leave it in ascending order
        # and freed ones go back so that they leave again in the same order: a request's blocks
        # are then often consecutive (a view of the cache, not a gather, in CPU attention).
        taken = self._free[len(self._free) - n :][::-1]
        del self._free[len(self._free) - n :]
        return taken

    def free(self, blocks: list[int]) -> None:
        self._free.extend(reversed(blocks))


@dataclass
class SwappedKV:
    """A preempted request's KV, moved to host memory: [num_layers, num_tokens, Hkv, D]."""

    k: torch.Tensor
    v: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return self.k.shape[1]


def block_bytes(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    elem = torch.tensor([], dtype=dtype).element_size()
    return 2 * cfg.num_layers * block_size * cfg.num_kv_heads * cfg.head_dim * elem


class PagedKVCache:
    def __init__(
        self,
        cfg: ModelConfig,
        *,
        block_size: int,
        memory_bytes: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        per_block = block_bytes(cfg, block_size, dtype)
        num_blocks = memory_bytes // per_block
        if num_blocks < 1:
            raise ValueError(
                f"KV memory budget of {memory_bytes} bytes is below one block ({per_block} bytes)"
            )
        self.block_size = block_size
        shape = (cfg.num_layers, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.allocator = BlockAllocator(num_blocks)
        self._blocks: dict[str, list[int]] = {}

    @property
    def num_blocks(self) -> int:
        return self.allocator.num_blocks

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def blocks(self, request_id: str) -> list[int]:
        return self._blocks[request_id]

    def has(self, request_id: str) -> bool:
        return request_id in self._blocks

    def add(self, request_id: str) -> None:
        if request_id in self._blocks:
            raise ValueError(f"request {request_id!r} already has a KV cache")
        self._blocks[request_id] = []

    def num_blocks_for(self, num_tokens: int) -> int:
        return (num_tokens + self.block_size - 1) // self.block_size

    def reserve(self, request_id: str, num_tokens: int) -> None:
        """Grow the request's blocks to hold `num_tokens` tokens (all or nothing)."""
        blocks = self._blocks[request_id]
        missing = self.num_blocks_for(num_tokens) - len(blocks)
        if missing > 0:
            blocks.extend(self.allocator.allocate(missing))

    def shrink(self, request_id: str, num_tokens: int) -> None:
        """Free the request's blocks past what `num_tokens` tokens need."""
        blocks = self._blocks[request_id]
        keep = self.num_blocks_for(num_tokens)
        if len(blocks) > keep:
            self.allocator.free(blocks[keep:])
            del blocks[keep:]

    def free(self, request_id: str) -> None:
        self.allocator.free(self._blocks.pop(request_id))

    def slots(self, request_id: str, start: int, end: int) -> np.ndarray:
        """Cache slots of the request's logical tokens [start, end)."""
        idx = np.arange(start, end)
        table = np.asarray(self._blocks[request_id], dtype=np.int64)
        return table[idx // self.block_size] * self.block_size + idx % self.block_size

    def gather(self, request_id: str, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The request's first `num_tokens` KV entries: two [num_layers, num_tokens, Hkv, D]."""
        slots = torch.from_numpy(self.slots(request_id, 0, num_tokens)).to(self.k.device)
        return self.k.flatten(1, 2)[:, slots], self.v.flatten(1, 2)[:, slots]

    def swap_out(self, request_id: str, num_tokens: int) -> SwappedKV:
        k, v = self.gather(request_id, num_tokens)
        self.free(request_id)
        return SwappedKV(k=k.to("cpu", copy=True), v=v.to("cpu", copy=True))

    def swap_in(self, request_id: str, swapped: SwappedKV) -> None:
        self.add(request_id)
        try:
            self.reserve(request_id, swapped.num_tokens)
        except OutOfKVMemoryError:
            self.free(request_id)
            raise
        slots = torch.from_numpy(self.slots(request_id, 0, swapped.num_tokens)).to(self.k.device)
        self.k.flatten(1, 2)[:, slots] = swapped.k.to(self.k.device)
        self.v.flatten(1, 2)[:, slots] = swapped.v.to(self.v.device)
