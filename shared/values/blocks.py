"""Names of full KV blocks: a hash chained over every block before it (`docs/prefix-caching.md`).

Equal names mean equal tokens at equal positions, so equal KV. The model's prefix cache and the
scheduler's copy of it (`shared.scheduling.prefix_index`) name blocks with this one function."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

BlockHash = bytes


def block_hashes(
    tokens: Sequence[int],
    block_size: int,
    *,
    salt: bytes = b"",
    first: int = 0,
    parent: BlockHash | None = None,
) -> list[BlockHash]:
    """Names of the full blocks of `tokens` from block `first` on; `parent` is block
    `first - 1`'s name (None for the first block)."""
    ids = np.asarray(tokens, dtype=np.int64)
    names: list[BlockHash] = []
    previous = parent if parent is not None else hashlib.blake2b(salt, digest_size=16).digest()
    for b in range(first, len(ids) // block_size):
        digest = hashlib.blake2b(previous, digest_size=16)
        digest.update(ids[b * block_size : (b + 1) * block_size].tobytes())
        previous = digest.digest()
        names.append(previous)
    return names
