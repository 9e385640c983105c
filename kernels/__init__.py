"""Paged KV writes and paged attention on torch SDPA.

This package imports nothing else of hybridkv: only torch and attrs.

    meta = PagedMetadata.build(query_lens, context_lens, block_tables, block_size, device)
    write_kv(kv_cache, key, value, meta)                 # every layer of the group
    out = paged_attention(query, kv_cache, meta, scale=head_dim**-0.5)
"""

from __future__ import annotations

from hybridkv.kernels.attention import paged_attention
from hybridkv.kernels.cache_ops import write_kv
from hybridkv.kernels.errors import KernelInputError
from hybridkv.kernels.metadata import PagedMetadata

__all__ = ["KernelInputError", "PagedMetadata", "paged_attention", "write_kv"]
