"""Serving ops: attention over paged KV caches and the cache write."""
from ops.serving.block_sizes import PagedBlockSizes
from ops.serving.paged_attention import paged_attention

__all__ = ["PagedBlockSizes", "paged_attention"]
