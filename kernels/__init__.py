"""Attention kernels. The reference runs anywhere; the Triton kernel plugs into the same signature."""

from kernels.attention_metadata import AttentionMetadata, num_mask_words
from kernels.reference import commit_kv_reference, tree_attention_reference

__all__ = [
    "AttentionMetadata",
    "commit_kv_reference",
    "num_mask_words",
    "tree_attention_reference",
]
