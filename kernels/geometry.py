"""The layout of one layer's paged cache, and its pages as flat rows of page runs.

A layer's cache is ``[num_blocks, 2, num_kv_heads, block_size, head_dim]``, each page
contiguous (head-major: one head's ``block_size`` keys are one run of
``block_size * head_dim`` elements). Pages may sit further apart than their size, when the
cache is a view into a shared pool whose pages are larger (``page_stride`` elements)::

    pool page p   [ K h0 | K h1 | ... | V h0 | V h1 | ... | (other layers' bytes) ]
                  ^ p * page_stride, each cell one run of block_size * head_dim

The gather reads runs as rows of one 2-D view of the storage whose row starts are
``row_stride = gcd(page_stride, run_len)`` apart (rows may overlap; they are only read).

A cache whose values are its keys (multi-head latent attention keeps one latent per
token, read as both) has a K/V axis of stride 0: its pages hold the key runs alone,
and the value runs are the same bytes (``value_offset`` 0).
"""

from __future__ import annotations

import math

import attrs
import torch

from hybridkv.kernels.errors import KernelInputError


@attrs.frozen
class CacheGeometry:
    """Shape and page stride of one layer's cache, as the gather addresses it."""

    num_kv_heads: int
    block_size: int
    head_dim: int
    page_stride: int
    #: Elements from a page's key runs to its value runs: the keys' (0: the values are
    #: the keys).
    value_offset: int = attrs.field(
        default=attrs.Factory(lambda g: g.num_kv_heads * g.run_len, takes_self=True)
    )

    @classmethod
    def of(cls, kv_cache: torch.Tensor) -> CacheGeometry:
        """Read the geometry of ``kv_cache``, checking that each page is contiguous.

        Raises:
            KernelInputError: not 5-D with a K/V axis of 2, or a page is not contiguous
                (the K/V axis may have stride 0: values that are the keys).
        """
        if kv_cache.dim() != 5 or kv_cache.shape[1] != 2:
            raise KernelInputError(
                "kv_cache must be [num_blocks, 2, num_kv_heads, block_size, head_dim], "
                f"got {tuple(kv_cache.shape)}"
            )
        _, _, num_kv_heads, block_size, head_dim = kv_cache.shape
        keys = num_kv_heads * block_size * head_dim
        value_offset = 0 if kv_cache.stride(1) == 0 else keys
        inner = (value_offset, block_size * head_dim, head_dim, 1)
        if kv_cache.stride()[1:] != inner or kv_cache.stride(0) < value_offset + keys:
            raise KernelInputError(
                f"kv_cache strides {kv_cache.stride()} must keep each page contiguous "
                f"(inner strides {inner}, page stride >= {value_offset + keys})"
            )
        return cls(num_kv_heads, block_size, head_dim, kv_cache.stride(0), value_offset)

    @property
    def values_are_keys(self) -> bool:
        """The values are the keys' bytes (a K/V axis of stride 0)."""
        return self.value_offset == 0

    @property
    def page_len(self) -> int:
        """Elements of one page's runs (its keys and values, or its keys alone)."""
        return self.value_offset + self.num_kv_heads * self.run_len

    @property
    def run_len(self) -> int:
        """Elements of one run: one head's keys (or values) in one page."""
        return self.block_size * self.head_dim

    @property
    def row_stride(self) -> int:
        """Elements between consecutive rows of the run view."""
        return math.gcd(self.page_stride, self.run_len)

    def run_rows(self, pages: torch.Tensor) -> torch.Tensor:
        """Rows ``[2, *pages.shape[:-1], num_kv_heads, pages.shape[-1]]`` of the runs.

        Index ``[kv, ..., head, j]`` is the run of ``pages[..., j]`` for key (kv=0) or
        value (kv=1) and ``head``, as a row of ``rows_view``.
        """
        kv = torch.arange(2).view(2, *([1] * pages.dim()), 1)
        heads = torch.arange(self.num_kv_heads)[:, None]
        offset = pages[None, ..., None, :] * self.page_stride
        offset = offset + kv * self.value_offset + heads * self.run_len
        return offset // self.row_stride

    @property
    def has_token_rows(self) -> bool:
        """Whether every token's key or value starts a row of ``token_rows_view``."""
        return self.page_stride % self.head_dim == 0

    def value_token_rows(self, pages: torch.Tensor) -> torch.Tensor:
        """Rows ``[*pages.shape[:-1], num_kv_heads, pages.shape[-1] * block_size]`` of values.

        Index ``[..., head, j * block_size + o]`` is the value of ``head`` at offset ``o`` of
        ``pages[..., j]``, as a row of ``token_rows_view`` (needs ``has_token_rows``).
        """
        heads = torch.arange(self.num_kv_heads)[:, None, None]
        offset = pages[..., None, :, None] * self.page_stride
        offset = offset + self.value_offset + heads * self.run_len
        offset = offset + torch.arange(self.block_size) * self.head_dim
        return (offset // self.head_dim).flatten(-2)

    def token_rows_view(self, kv_cache: torch.Tensor) -> torch.Tensor:
        """``kv_cache``'s storage as ``[num_rows, head_dim]`` rows, one per key or value."""
        span = (kv_cache.shape[0] - 1) * self.page_stride + self.page_len
        return kv_cache.as_strided(
            (span // self.head_dim, self.head_dim), (self.head_dim, 1), kv_cache.storage_offset()
        )

    def rows_view(self, kv_cache: torch.Tensor) -> torch.Tensor:
        """``kv_cache``'s storage as ``[num_rows, run_len]`` rows ``row_stride`` apart."""
        span = (kv_cache.shape[0] - 1) * self.page_stride + self.page_len
        num_rows = (span - self.run_len) // self.row_stride + 1
        return kv_cache.as_strided(
            (num_rows, self.run_len), (self.row_stride, 1), kv_cache.storage_offset()
        )
