"""Paged KV cache: fixed-size blocks from one pool sized by a memory budget in bytes.

A request owns a list of blocks (its block table); logical token i of the request lives in slot
`blocks[i // block_size] * block_size + i % block_size`. Blocks are freed when the request ends,
or swapped to host memory when the scheduler preempts it. With prefix caching, full blocks of
committed tokens are shared between requests and kept after them (`shared/model/prefix_cache.py`):
a request's block table then need not be one consecutive run.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from shared.errors import OutOfKVMemoryError
from shared.model.config import ModelConfig
from shared.model.prefix_cache import PrefixCache


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

    Prefix caching (`shared/model/prefix_cache.py`): a block has a count of its holders; a block
    the prefix cache named (`keep_when_released`) is not freed when its last holder lets go but
    *kept*, and a kept block is evicted, least recently released first, only when an allocation
    needs it or more than `max_kept` blocks are kept. Kept blocks count as free (`num_free`).
    """

    def __init__(self, num_blocks: int, max_kept: int | None = None) -> None:
        self.num_blocks = num_blocks
        self.max_kept = num_blocks if max_kept is None else max_kept
        self._is_free = np.ones(num_blocks, dtype=bool)
        self._num_free = num_blocks
        self._refs = np.zeros(num_blocks, dtype=np.int64)
        self._is_named = np.zeros(num_blocks, dtype=bool)
        self._kept: OrderedDict[int, None] = OrderedDict()  # held by none, oldest release first
        self.on_evict: Callable[[int], None] | None = None  # the prefix cache forgets the block

    @property
    def num_free(self) -> int:
        """Blocks an allocation can have: free ones and kept ones (evicted on demand)."""
        return self._num_free + len(self._kept)

    @property
    def num_kept(self) -> int:
        return len(self._kept)

    def refs(self, block: int) -> int:
        return int(self._refs[block])

    def allocate(self, n: int, after: int | None = None) -> list[int]:
        """`n` blocks (all or nothing), continuing after block `after` where those are free."""
        if n > self.num_free:
            raise OutOfKVMemoryError(
                f"KV cache exhausted: need {n} more blocks, {self.num_free} of "
                f"{self.num_blocks} free"
            )
        for _ in range(n - self._num_free):
            self._evict_oldest()
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
        self._refs[taken] = 1
        return taken

    def _place(self, n: int) -> list[int]:
        padded = np.concatenate(([False], self._is_free, [False]))
        edges = np.flatnonzero(padded[1:] != padded[:-1])  # run starts and ends, alternating
        starts, ends = edges[0::2], edges[1::2]  # at least one run: n <= the free blocks
        longest = int(np.argmax(ends - starts))
        start, length = int(starts[longest]), int(ends[longest] - starts[longest])
        if length < n:
            return np.flatnonzero(self._is_free)[:n].tolist()
        if start > 0 and self._refs[start - 1] > 0:  # the run follows a held block (not a
            start += (length - n) // 2  # kept one): leave its owner half the room to grow
        return list(range(start, start + n))

    def acquire(self, blocks: list[int]) -> None:
        """One more holder for each of `blocks`: held or kept blocks, never free ones."""
        if self._is_free[blocks].any():
            raise ValueError(f"acquiring free blocks: {blocks}")
        for block in blocks:
            if self._refs[block] == 0:
                del self._kept[block]
            self._refs[block] += 1

    def keep_when_released(self, block: int) -> None:
        """The block is named by the prefix cache: keep it when its last holder lets go."""
        if self._refs[block] < 1:
            raise ValueError(f"block {block} is not held")
        self._is_named[block] = True

    def free(self, blocks: list[int]) -> None:
        """One holder fewer for each of `blocks`: a block nobody holds is freed, or kept."""
        if not blocks:
            return
        if len(set(blocks)) < len(blocks) or (self._refs[blocks] < 1).any():
            raise ValueError(f"freeing blocks that are already free: {blocks}")
        self._refs[blocks] -= 1
        for block in blocks:
            if self._refs[block] > 0:
                continue
            if self._is_named[block] and self.max_kept > 0:
                self._kept[block] = None
            else:
                self._release(block)
        while len(self._kept) > self.max_kept:
            self._evict_oldest()

    def _evict_oldest(self) -> None:
        block, _ = self._kept.popitem(last=False)
        self._release(block)

    def _release(self, block: int) -> None:
        if self._is_named[block]:
            self._is_named[block] = False
            if self.on_evict is not None:
                self.on_evict(block)
        self._is_free[block] = True
        self._num_free += 1


@dataclass
class SwappedKV:
    """A preempted request's KV, moved to host memory: [num_layers, num_tokens, Hkv, D]."""

    k: torch.Tensor
    v: torch.Tensor
    token_ids: tuple[int, ...] = ()  # the tokens whose KV this is (to name its blocks again)

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
        prefix_caching: bool = True,
        max_kept_fraction: float = 1.0,
    ) -> None:
        """`scratch_block`: one more block past the allocator's, owned by no request (padded
        tokens of a CUDA-graph forward write their KV there); `scratch_slot` is its first slot.
        `prefix_caching`: full committed blocks are named and shared (`self.prefix`), and up to
        `max_kept_fraction` of the blocks are kept for reuse once no request holds them."""
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
        if not 0.0 <= max_kept_fraction <= 1.0:
            raise ValueError(f"max_kept_fraction {max_kept_fraction} is not in [0, 1]")
        self.allocator = BlockAllocator(num_blocks, max_kept=int(max_kept_fraction * num_blocks))
        self.prefix = PrefixCache(self.allocator, block_size) if prefix_caching else None
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

    def extend(self, request_id: str, blocks: list[int]) -> None:
        """Append held or kept (cached) `blocks` to the request's blocks, as one more holder."""
        self.allocator.acquire(blocks)
        self._blocks[request_id].extend(blocks)

    def num_blocks_alone(self, request_id: str) -> int:
        """The request's blocks no other request holds (what freeing it gives back)."""
        return sum(1 for b in self._blocks.get(request_id, []) if self.allocator.refs(b) == 1)

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
