"""Writing one layer's new keys and values into its paged cache, and reading a request's
keys back whole.

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
    kv_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor | None, meta: PagedMetadata
) -> None:
    """Store the batch's new keys and values in ``kv_cache`` in place.

    Args:
        kv_cache: ``[num_blocks, 2, num_kv_heads, block_size, head_dim]``.
        key: ``[num_tokens, num_kv_heads, head_dim]``, tokens in request order.
        value: same shape as ``key``; None where the cache's values are its keys (a K/V
            axis of stride 0: multi-head latent attention's one latent per token).
        meta: this step's metadata of the cache's KV group.

    Raises:
        KernelInputError: shapes, dtypes or block tables do not fit the cache, or values
            come for a cache whose values are its keys (or none for one that keeps them).
    """
    geometry = check_cache(kv_cache, meta)
    if (value is None) != geometry.values_are_keys:
        raise KernelInputError(
            "a cache whose values are its keys (K/V stride 0) takes keys alone, and any "
            f"other takes both: values {'missing' if value is None else 'given'}"
        )
    expected = (meta.num_tokens, geometry.num_kv_heads, geometry.head_dim)
    parts = [key] if value is None else [key, value]
    if any(tuple(part.shape) != expected for part in parts):
        raise KernelInputError(
            f"key {tuple(key.shape)} and value {None if value is None else tuple(value.shape)}"
            f" must be [num_tokens, num_kv_heads, head_dim] = {expected}"
        )
    if any(part.dtype != kv_cache.dtype for part in parts):
        raise KernelInputError(
            f"key {key.dtype} / value {None if value is None else value.dtype} must match "
            f"kv_cache dtype {kv_cache.dtype}"
        )
    if value is None:
        kv_cache[:, 0][meta.write_blocks, :, meta.write_offsets] = key
        return
    # Advanced indices around slices: the indexed view is [num_tokens, 2, num_kv_heads,
    # head_dim], keys and values in one write.
    kv_cache[meta.write_blocks, :, :, meta.write_offsets] = torch.stack((key, value), dim=1)


def context_keys(
    kv_cache: torch.Tensor, meta: PagedMetadata, request: int, first: int = 0
) -> torch.Tensor:
    """``[context_len - first, num_kv_heads, head_dim]``: the keys of request ``request``'s
    context from position ``first`` on, in position order, read from the pages holding
    them alone (a page its table names as the null block reads as that block's zeros).

    Raises:
        KernelInputError: the cache does not fit the metadata.
    """
    geometry = check_cache(kv_cache, meta)
    bs, context = meta.block_size, meta.context_lens[request]
    lo = first // bs
    pages = meta.block_table[request, lo : -(-context // bs)].to(kv_cache.device)
    keys = kv_cache[:, 0].index_select(0, pages).transpose(1, 2)
    keys = keys.reshape(-1, geometry.num_kv_heads, geometry.head_dim)
    return keys[first - lo * bs : context - lo * bs]
