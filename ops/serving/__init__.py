"""Serving ops: attention over paged KV caches and the cache write."""
from ops.serving.block_sizes import PagedBlockSizes
from ops.serving.kv_pages import update_kv_pages
from ops.serving.paged_attention import paged_attention
from ops.serving.ragged_paged_attention import ragged_paged_attention

__all__ = ["PagedBlockSizes", "paged_attention", "ragged_paged_attention", "update_kv_pages"]
