"""Prefix caching: full KV blocks found by their content and position, shared between requests.

A full block of committed tokens is named by a hash chained over every block before it (and a
salt for caches whose entries depend on more than the tokens): equal names mean equal tokens at
equal positions, so equal KV. `PrefixCache` maps names to the blocks of a `BlockAllocator`;
the allocator counts each block's holders and keeps blocks no request holds, least recently
released first out, until memory is needed (`docs/prefix-caching.md`).

Only full blocks are named, and only once every token in them is committed, so a named block is
never written again: a request that goes on writing does so in a block of its own.

A target verified for a feature-level draft also keeps, beside a named block, the features it
computed at the block's positions (`set_features`): like the KV, they depend only on the tokens
up to each position, so a request that finds the block finds its features too.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np

from shared.values.blocks import BlockHash


class BlockAllocator(Protocol):
    """What the prefix cache needs of `shared.model.kv_cache.BlockAllocator`."""

    on_evict: Callable[[int], None] | None

    def keep_when_released(self, block: int) -> None: ...


class PrefixCache:
    """The name -> block index over one allocator, and vLLM-style counters in tokens."""

    def __init__(self, allocator: BlockAllocator, block_size: int) -> None:
        self.allocator = allocator
        self.block_size = block_size
        self._block_of: dict[BlockHash, int] = {}
        self._name_of: dict[int, BlockHash] = {}
        self._features: dict[int, np.ndarray] = {}  # block -> its positions' features, fp16
        self.queries = 0  # tokens of the full blocks looked up (each lookup counts)
        self.hits = 0  # of them, found cached
        allocator.on_evict = self._forget

    def __len__(self) -> int:
        return len(self._block_of)

    def lookup(self, names: Sequence[BlockHash]) -> list[int]:
        """The cached blocks of the longest prefix of `names` (not yet acquired)."""
        blocks: list[int] = []
        for name in names:
            block = self._block_of.get(name)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def count(self, queried_tokens: int, hit_tokens: int) -> None:
        self.queries += queried_tokens
        self.hits += hit_tokens

    def insert(self, name: BlockHash, block: int) -> bool:
        """Name a held, full, committed block; False when the name has a block already (the
        block then stays the request's own and is freed with it)."""
        if name in self._block_of or block in self._name_of:
            return False
        self._block_of[name] = block
        self._name_of[block] = name
        self.allocator.keep_when_released(block)
        return True

    def name_of(self, block: int) -> BlockHash | None:
        return self._name_of.get(block)

    def set_features(self, name: BlockHash, rows: np.ndarray) -> None:
        """Keep the features of the named block's positions ([block_size, width]), unless it
        has them already (equal names: equal features)."""
        if len(rows) != self.block_size:
            raise ValueError(f"a block's features are {self.block_size} rows, got {len(rows)}")
        block = self._block_of.get(name)
        if block is not None and block not in self._features:
            self._features[block] = rows

    def features_of(self, block: int) -> np.ndarray | None:
        return self._features.get(block)

    def _forget(self, block: int) -> None:
        del self._block_of[self._name_of.pop(block)]
        self._features.pop(block, None)
