"""GatherPlan: decodes read their values in place through embedding_bag rows."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from hybridkv.kernels import PagedMetadata, gather_regions
from hybridkv.kernels.gather_plan import GatherPlan
from hybridkv.kernels.geometry import CacheGeometry


@pytest.fixture
def _in_place() -> Iterator[None]:
    saved = gather_regions.VALUE_BAGS_MIN_ELEMENTS
    gather_regions.VALUE_BAGS_MIN_ELEMENTS = 0
    yield
    gather_regions.VALUE_BAGS_MIN_ELEMENTS = saved


def _plan(page_stride: int) -> GatherPlan:
    """Two decodes of 2 pages (block 4): contexts 6 and 5, head_dim 2, G = 2."""
    meta = PagedMetadata.build([1, 1], [6, 5], [[3, 1], [2, 4]], 4)
    geometry = CacheGeometry(num_kv_heads=1, block_size=4, head_dim=2, page_stride=page_stride)
    return meta.plan(geometry, num_queries_per_kv=2, sliding_window=None)


@pytest.mark.usefixtures("_in_place")
def test_decode_bags_name_only_visible_value_rows() -> None:
    """Each (request, query head) bag lists the token rows of its visible values in order."""
    (region,) = _plan(page_stride=16).regions
    bags = region.value_bags
    assert bags is not None
    # Value of page p at offset o is token row (p * 16 + 8 + o * 2) // 2 = 8p + 4 + o.
    r0 = [8 * 3 + 4 + o for o in range(4)] + [8 * 1 + 4 + o for o in range(2)]
    r1 = [8 * 2 + 4 + o for o in range(4)] + [8 * 4 + 4]
    assert bags.rows.tolist() == r0 + r0 + r1 + r1
    assert bags.offsets.tolist() == [0, 6, 12, 17]
    assert bags.keep is not None and bags.keep.numel() == 22


def test_small_decodes_gather_values() -> None:
    """Decodes whose values are fewer than VALUE_BAGS_MIN_ELEMENTS gather them for SDPA."""
    (region,) = _plan(page_stride=16).regions
    assert region.value_bags is None
    assert region.num_rows == 2 * 2 * 1 * 8


@pytest.mark.usefixtures("_in_place")
def test_pages_not_aligned_to_head_dim_gather_values() -> None:
    """A page stride that is no multiple of head_dim falls back to gathering values."""
    (region,) = _plan(page_stride=17).regions
    assert region.value_bags is None
    assert region.num_rows == 2 * 2 * 1 * 8


def test_token_rows_view_shares_the_cache_storage() -> None:
    """Token rows are views of the cache: row r is elements [r * head_dim, (r + 1) * head_dim)."""
    cache = torch.arange(3 * 16, dtype=torch.float32).view(3, 2, 1, 4, 2)
    rows = CacheGeometry.of(cache).token_rows_view(cache)
    assert rows.data_ptr() == cache.data_ptr()
    assert rows[13].tolist() == [26.0, 27.0]
