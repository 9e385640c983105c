"""Writing one layer's new keys and values into its paged cache.

Cache layout of one layer (head-major pages, so a page's keys for one head are contiguous)::

    kv_cache[page, 0 | 1, kv_head, offset, :]      0 = key, 1 = value
    shape    [num_blocks, 2, num_kv_heads, block_size, head_dim]   (pages may be strided)

Token ``t`` of the batch goes to ``page = slot_mapping[t] // block_size`` and
``offset = slot_mapping[t] % block_size``; both are precomputed in ``PagedMetadata``.
"""

from __future__ import annotations

import torch

from hybridkv.kernels.errors import KernelInputError
from hybridkv.kernels.geometry import CacheGeometry
from hybridkv.kernels.metadata import PagedMetadata


def check_cache(kv_cache: torch.Tensor, meta: PagedMetadata) -> CacheGeometry:
    """The geometry of ``kv_cache``, checked against the metadata's block size and tables.

    Raises:
        KernelInputError: the cache layout, block size or page count does not fit.
    """
    geometry = CacheGeometry.of(kv_cache)
    if geometry.block_size != meta.block_size:
        raise KernelInputError(
            f"kv_cache block size {geometry.block_size} != metadata block_size {meta.block_size}"
        )
    if meta.max_block_id >= kv_cache.shape[0]:
        raise KernelInputError(
            f"block tables name page {meta.max_block_id}, cache has {kv_cache.shape[0]} pages"
        )
    return geometry


def write_kv(
    kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, meta: PagedMetadata
) -> None:
    """Store the batch's new keys and values in ``kv_cache`` in place.

    Args:
        kv_cache: ``[num_blocks, 2, num_kv_heads, block_size, head_dim]``.
        key: ``[num_tokens, num_kv_heads, head_dim]``, tokens in request order.
        value: same shape as ``key``.
        meta: this step's metadata of the cache's KV group.

    Raises:
        KernelInputError: shapes, dtypes or block tables do not fit the cache.
    """
    geometry = check_cache(kv_cache, meta)
    expected = (meta.num_tokens, geometry.num_kv_heads, geometry.head_dim)
    if tuple(key.shape) != expected or tuple(value.shape) != expected:
        raise KernelInputError(
            f"key {tuple(key.shape)} and value {tuple(value.shape)} must both be "
            f"[num_tokens, num_kv_heads, head_dim] = {expected}"
        )
    if key.dtype != kv_cache.dtype or value.dtype != kv_cache.dtype:
        raise KernelInputError(
            f"key {key.dtype} / value {value.dtype} must match kv_cache dtype {kv_cache.dtype}"
        )
    # Advanced indices around slices: the indexed view is [num_tokens, 2, num_kv_heads,
    # head_dim], keys and values in one write.
    kv_cache[meta.write_blocks, :, :, meta.write_offsets] = torch.stack((key, value), dim=1)
