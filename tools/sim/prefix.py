"""Prefix caching in the simulator: prompts from Mooncake-style `hash_ids`, and the trace's own
hit rate.

A Mooncake trace names each 512-token block of a prompt by an id; equal ids mean equal blocks
after an equal prefix (the ids are remapped prefix hashes). The simulator turns each id into 512
pseudo-random token ids drawn from the id (the same id, the same tokens), so the verifier's
chained block names (`shared/model/prefix_cache.py`, 16 tokens a block) find exactly the
sharing the trace describes, at the verifier's own granularity.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from functools import lru_cache

import numpy as np

MOONCAKE_BLOCK = 512  # tokens per hash id in the Mooncake traces
FIRST_TOKEN = 4  # below: the simulator's placeholder tokens


@lru_cache(maxsize=1 << 16)
def _block_tokens(hash_id: int, vocab_size: int, block: int) -> tuple[int, ...]:
    rng = np.random.default_rng(hash_id)
    return tuple(rng.integers(FIRST_TOKEN, vocab_size, block).tolist())


def hashed_prompt(
    hash_ids: Sequence[int], length: int, vocab_size: int, block: int = MOONCAKE_BLOCK
) -> tuple[int, ...]:
    """`length` prompt tokens whose `block`-token blocks are drawn from `hash_ids` (the last
    block partial); ValueError when the ids cannot cover the length."""
    if len(hash_ids) * block < length or (length and len(hash_ids) > -(-length // block)):
        raise ValueError(
            f"{len(hash_ids)} hash_ids of {block} tokens do not make a prompt of {length} tokens"
        )
    tokens: list[int] = []
    for hash_id in hash_ids:
        tokens += _block_tokens(hash_id, vocab_size, block)
    return tuple(tokens[:length])


def trace_hit_rate(
    requests: Iterable[tuple[int, Sequence[int]]], block: int = MOONCAKE_BLOCK
) -> tuple[int, int]:
    """The trace's own count, in arrival order with a cache that forgets nothing: (prompt
    tokens, of them in the longest prefix of blocks some earlier request had), for
    `(input_length, hash_ids)` pairs. The prompt's last token is never counted (it is always
    computed: its logits give the first output token)."""
    seen: set[int] = set()
    total = hits = 0
    for length, ids in requests:
        hit = 0
        for hash_id in ids:
            if hash_id not in seen:
                break
            hit += 1
        total += length
        hits += min(hit * block, length - 1)
        seen.update(ids)
    return total, hits
