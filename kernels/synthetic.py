"""Synthetic packed batches for kernel tests and benchmarks: trees, paged caches, metadata.

A request is described by its committed prefix length, the parents of every node of its tree
region (topological order, -1 attaches a node to the prefix end) and how many of the last nodes
are this forward's queries. Blocks are handed out in a shuffled order so a block table is never
the identity and kernels that ignore it fail.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from kernels.attention_metadata import MASK_WORD_BITS, AttentionMetadata, num_mask_words


@dataclass(frozen=True)
class RequestSpec:
    prefix_len: int
    parents: tuple[int, ...]  # the whole tree region
    query_len: int | None = None  # None: every node is a query (the verifier's case)

    @property
    def tree_len(self) -> int:
        return len(self.parents)

    @property
    def num_queries(self) -> int:
        return self.tree_len if self.query_len is None else self.query_len


def chain(n: int) -> tuple[int, ...]:
    return tuple(range(-1, n - 1))


def star(n: int) -> tuple[int, ...]:
    return (-1,) + (0,) * (n - 1) if n else ()


def random_tree(n: int, rng: random.Random, roots: int = 1) -> tuple[int, ...]:
    """A random tree (a forest when roots > 1): node i's parent is uniform over earlier nodes."""
    return tuple(-1 if i < roots else rng.randrange(i) for i in range(n))


def ancestor_masks(parents: tuple[int, ...]) -> list[int]:
    """Bit j of mask i is set when node j is node i or one of its ancestors."""
    masks: list[int] = []
    for i, p in enumerate(parents):
        masks.append((masks[p] if p >= 0 else 0) | (1 << i))
    return masks


def mask_words(masks: list[int], num_words: int) -> torch.Tensor:
    """Python-int bitmasks -> [N, num_words] int64 words (two's complement for bit 63)."""
    low = (1 << MASK_WORD_BITS) - 1
    rows = []
    for m in masks:
        words = [(m >> (MASK_WORD_BITS * w)) & low for w in range(num_words)]
        rows.append([w - (1 << MASK_WORD_BITS) if w >> (MASK_WORD_BITS - 1) else w for w in words])
    return torch.tensor(rows, dtype=torch.int64).reshape(len(masks), num_words)


@dataclass
class PagedBatch:
    q: torch.Tensor  # [T, Hq, D]
    k_cache: torch.Tensor  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor  # [num_blocks, block_size, Hkv, D]
    meta: AttentionMetadata


def _block_tables(
    specs: list[RequestSpec], block_size: int, rng: random.Random, spare_blocks: int
) -> tuple[list[list[int]], int]:
    need = [-(-(s.prefix_len + s.tree_len) // block_size) for s in specs]
    num_blocks = sum(need) + spare_blocks
    pool = list(range(num_blocks))
    rng.shuffle(pool)
    tables, taken = [], 0
    for n in need:
        tables.append(pool[taken : taken + n])
        taken += n
    return tables, num_blocks


def build_metadata(
    specs: list[RequestSpec], tables: list[list[int]], block_size: int, device: torch.device
) -> AttentionMetadata:
    query_start, masks, slots = [0], [], []
    for spec, table in zip(specs, tables, strict=True):
        n = spec.num_queries
        masks.extend(ancestor_masks(spec.parents)[spec.tree_len - n :])
        end = spec.prefix_len + spec.tree_len
        slots.extend(
            table[j // block_size] * block_size + j % block_size for j in range(end - n, end)
        )
        query_start.append(query_start[-1] + n)
    width = max(1, max(len(t) for t in tables))
    table_t = torch.full((len(specs), width), -1, dtype=torch.int32)
    for r, table in enumerate(tables):
        table_t[r, : len(table)] = torch.tensor(table, dtype=torch.int32)
    words = mask_words(masks, num_mask_words(max(s.tree_len for s in specs)))
    prefix_lens = [s.prefix_len for s in specs]
    tree_lens = [s.tree_len for s in specs]
    return AttentionMetadata(
        query_start_loc=torch.tensor(query_start, dtype=torch.int32, device=device),
        prefix_lens=torch.tensor(prefix_lens, dtype=torch.int32, device=device),
        tree_lens=torch.tensor(tree_lens, dtype=torch.int32, device=device),
        block_tables=table_t.to(device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        tree_mask=words.to(device),
        query_start_host=query_start,
        prefix_lens_host=prefix_lens,
        tree_lens_host=tree_lens,
    )


def make_paged_batch(
    specs: list[RequestSpec],
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    seed: int = 0,
    spare_blocks: int = 3,
) -> PagedBatch:
    """Random q and paged K/V for `specs`, with metadata as the model runner would build it."""
    device = torch.device(device)
    rng = random.Random(seed)
    tables, num_blocks = _block_tables(specs, block_size, rng, spare_blocks)
    meta = build_metadata(specs, tables, block_size, device)
    gen = torch.Generator(device=device).manual_seed(seed)
    cache_shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(cache_shape, generator=gen, device=device).to(dtype)
    v_cache = torch.randn(cache_shape, generator=gen, device=device).to(dtype)
    q = torch.randn(meta.num_tokens, num_heads, head_dim, generator=gen, device=device).to(dtype)
    return PagedBatch(q, k_cache, v_cache, meta)
