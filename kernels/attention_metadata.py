"""What every tree-attention implementation receives: one packed batch, no padding.

A request in the batch sees two regions of its paged KV cache:

- the **prefix**: `prefix_lens[r]` committed tokens, visible to every query of the request;
- the **tree region**: the next `tree_lens[r]` cache slots. The request's new query tokens are
  the last `query_lens[r]` of them (their KV was written to the cache just before attention).
  Query i sees tree slot j only when bit j of `tree_mask[i]` is set: j is i itself or one of
  its ancestors. A prompt chunk is a chain, so its mask is plain causal.

The verifier's trees are entirely new (tree region == queries). A drafter growing a tree one
layer per forward has earlier layers already cached in the tree region.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch

MASK_WORD_BITS = 64


def num_mask_words(max_tree_len: int) -> int:
    return max(1, (max_tree_len + MASK_WORD_BITS - 1) // MASK_WORD_BITS)


@dataclass(frozen=True)
class FixedLaunch:
    """A tree-attention launch fixed in advance, for a CUDA graph that replays one launch for
    any batch that fits: the Triton kernel's work table (`kernels.triton_tree_attention`) with a
    fixed number of rows, the rows past the batch's work no-ops, and no prefix decomposition."""

    block_m: int  # tile rows (query tokens times the padded GQA group)
    items: torch.Tensor  # [max_items, NUM_WORK_FIELDS] int32, on the device


@dataclass
class AttentionMetadata:
    query_start_loc: torch.Tensor  # [R+1] int32, cumulative query counts
    prefix_lens: torch.Tensor  # [R] int32
    tree_lens: torch.Tensor  # [R] int32, tree-region length including this forward's queries
    block_tables: torch.Tensor  # [R, max_blocks] int32, -1 past the request's blocks
    slot_mapping: torch.Tensor  # [T] int64, cache slot of each query token's KV
    tree_mask: torch.Tensor  # [T, W] int64, ancestor bitmask over the tree region
    # Host copies, so a reference implementation never syncs on device tensors.
    query_start_host: list[int]
    prefix_lens_host: list[int]
    tree_lens_host: list[int]
    # Set by a CUDA-graph forward: the Triton kernel launches this instead of planning the batch
    # (the host lists above then describe the batch captured, not the one replayed).
    fixed_launch: FixedLaunch | None = None

    @property
    def num_requests(self) -> int:
        return len(self.prefix_lens_host)

    @property
    def num_tokens(self) -> int:
        return self.query_start_host[-1]

    def requests_with_queries(self) -> Iterator[tuple[int, int, int, int]]:
        """Per request with new queries in this forward, from the host copies: (r, its first
        query row, one past its last, its prefix length)."""
        qs = self.query_start_host
        for r in range(self.num_requests):
            if qs[r + 1] > qs[r]:
                yield r, qs[r], qs[r + 1], self.prefix_lens_host[r]

    def visible(self, r: int) -> torch.Tensor | None:
        """What request r's queries see of its KV: bool [num queries, prefix + tree region],
        on the metadata's device; None when it has a single new token, which sees everything."""
        q_lo, q_hi = self.query_start_host[r], self.query_start_host[r + 1]
        prefix, tree = self.prefix_lens_host[r], self.tree_lens_host[r]
        if tree <= 1:
            return None
        mask = torch.ones(
            q_hi - q_lo, prefix + tree, dtype=torch.bool, device=self.tree_mask.device
        )
        mask[:, prefix:] = unpack_mask_bits(self.tree_mask[q_lo:q_hi], tree)
        return mask


def unpack_mask_bits(words: torch.Tensor, num_bits: int) -> torch.Tensor:
    """Ancestor bitmask words [N, W] int64 -> boolean mask [N, num_bits]."""
    idx = torch.arange(num_bits, device=words.device)
    selected = words[:, idx // MASK_WORD_BITS]  # [N, num_bits]
    return ((selected >> (idx % MASK_WORD_BITS)) & 1).bool()
