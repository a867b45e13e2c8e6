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
    """Hands out cache blocks so that each request's blocks stay consecutive where it can.

    A consecutive run of blocks is one view of the cache; anything else is a gather in every
    layer of every forward (CPU attention, `kernels/cpu_tree_attention.py`). So:

    - a request that grows takes the blocks right after its last one while they are free;
    - a request's first blocks (and the rest of a growth that ran into another request) go to the
      largest free run: at its start when nothing precedes it, else at its middle, which leaves
      the request before the run room to grow into;
    - when no free run is long enough, any free blocks, lowest first.

    Placement never costs capacity: every free block can be handed out.
    """

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._is_free = np.ones(num_blocks, dtype=bool)
        self._num_free = num_blocks

    @property
    def num_free(self) -> int:
        return self._num_free

    def allocate(self, n: int, after: int | None = None) -> list[int]:
        """`n` blocks (all or nothing), continuing after block `after` where those are free."""
        if n > self._num_free:
            raise OutOfKVMemoryError(
                f"KV cache exhausted: need {n} more blocks, {self._num_free} of "
                f"{self.num_blocks} free"
            )
        taken: list[int] = []
        if after is not None:
            block = after + 1
            while len(taken) < n and block < self.num_blocks and self._is_free[block]:
                taken.append(block)
                block += 1
            self._is_free[taken] = False
        if len(taken) < n:
            placed = self._place(n - len(taken))
            self._is_free[placed] = False
            taken += placed
        self._num_free -= n
        return taken

    def _place(self, n: int) -> list[int]:
        padded = np.concatenate(([False], self._is_free, [False]))
        edges = np.flatnonzero(padded[1:] != padded[:-1])  # run starts and ends, alternating
        starts, ends = edges[0::2], edges[1::2]  # at least one run: n <= the free blocks
        longest = int(np.argmax(ends - starts))
        start, length = int(starts[longest]), int(ends[longest] - starts[longest])
        if length < n:
            return np.flatnonzero(self._is_free)[:n].tolist()
        if start > 0:  # the run follows a held block: leave its owner half the room
            start += (length - n) // 2
        return list(range(start, start + n))

    def free(self, blocks: list[int]) -> None:
        if not blocks:
            return
        if len(set(blocks)) < len(blocks) or self._is_free[blocks].any():
            raise ValueError(f"freeing blocks that are already free: {blocks}")
        self._is_free[blocks] = True
        self._num_free += len(blocks)


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
        scratch_block: bool = False,
    ) -> None:
        """`scratch_block`: one more block past the allocator's, owned by no request (padded
        tokens of a CUDA-graph forward write their KV there); `scratch_slot` is its first slot."""
        per_block = block_bytes(cfg, block_size, dtype)
        num_blocks = memory_bytes // per_block
        if num_blocks < 1:
            raise ValueError(
                f"KV memory budget of {memory_bytes} bytes is below one block ({per_block} bytes)"
            )
        self.block_size = block_size
        self.scratch_slot = num_blocks * block_size if scratch_block else None
        total_blocks = num_blocks + int(scratch_block)
        shape = (cfg.num_layers, total_blocks, block_size, cfg.num_kv_heads, cfg.head_dim)
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
            blocks.extend(self.allocator.allocate(missing, after=blocks[-1] if blocks else None))

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
