"""Attention kernels: a PyTorch reference for any device; Triton kernels of the same signature."""

from kernels.attention_metadata import AttentionMetadata, num_mask_words
from kernels.reference import commit_kv_reference, tree_attention_reference

__all__ = [
    "AttentionMetadata",
    "commit_kv_reference",
    "num_mask_words",
    "tree_attention_reference",
]
