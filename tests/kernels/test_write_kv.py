"""write_kv: new keys and values land in their pages, nothing else changes; a request's
keys read back whole (context_keys), and a step's metadata split by request (subset)."""

from __future__ import annotations

import pytest
import torch

from hybridkv.kernels import KernelInputError, PagedMetadata, write_kv
from hybridkv.kernels.cache_ops import context_keys


def test_keys_and_values_land_at_their_slots() -> None:
    """Each token's key and value are stored at (page, offset) of its slot, per head."""
    meta = PagedMetadata.build([3, 1], [3, 6], [[2], [4, 1]], 4)
    cache = torch.zeros(5, 2, 2, 4, 8)
    key = torch.randn(4, 2, 8)
    value = torch.randn(4, 2, 8)
    write_kv(cache, key, value, meta)
    for token, slot in enumerate(meta.slot_mapping.tolist()):
        page, offset = divmod(slot, 4)
        torch.testing.assert_close(cache[page, 0, :, offset], key[token])
        torch.testing.assert_close(cache[page, 1, :, offset], value[token])


def test_a_latent_cache_keeps_one_vector_a_token_and_reads_it_back_in_order() -> None:
    """Keys alone into a cache whose values are its keys (stride-0 K/V axis), in pages of
    a wider pool; each request's context read back in position order."""
    pool = torch.zeros(6, 2 * 4 * 8)
    cache = pool[:, : 4 * 8].view(6, 1, 1, 4, 8).expand(-1, 2, -1, -1, -1)
    meta = PagedMetadata.build([6, 1], [6, 3], [[5, 2], [3]], 4)
    key = torch.randn(7, 1, 8)
    write_kv(cache, key, None, meta)
    torch.testing.assert_close(context_keys(cache, meta, 0), key[:6])
    later = PagedMetadata.build([1], [4], [[3]], 4)
    write_kv(cache, torch.ones(1, 1, 8), None, later)
    torch.testing.assert_close(context_keys(cache, later, 0)[2], key[6])
    assert int(pool[:, 4 * 8 :].count_nonzero()) == 0  # the rest of each pool page


def test_a_subset_of_requests_has_their_tokens_and_tables() -> None:
    """The decodes of a mixed step split off: their lengths, tables, slots and the
    indices of their tokens in the step, the same object for a second ask."""
    meta = PagedMetadata.build([3, 1, 2, 1], [3, 6, 9, 2], [[1], [2, 3], [4, 5, 6], [7]], 4)
    alone, tokens = meta.subset([1, 3])
    assert alone.query_lens == (1, 1) and alone.context_lens == (6, 2)
    assert tokens.tolist() == [3, 6]
    assert alone.slot_mapping.tolist() == meta.slot_mapping[tokens].tolist()
    assert meta.subset([1, 3])[0] is alone


def test_other_slots_are_untouched() -> None:
    """Only the batch's slots change; the null block stays as it was."""
    meta = PagedMetadata.build([1], [2], [[3]], 4)
    cache = torch.full((4, 2, 1, 4, 8), float("nan"))
    write_kv(cache, torch.ones(1, 1, 8), torch.ones(1, 1, 8), meta)
    assert int(torch.isnan(cache).sum()) == cache.numel() - 2 * 8


def test_key_shape_must_match_the_cache() -> None:
    """key/value must be [num_tokens, num_kv_heads, head_dim] of the cache."""
    meta = PagedMetadata.build([2], [2], [[1]], 4)
    cache = torch.zeros(2, 2, 2, 4, 8)
    with pytest.raises(KernelInputError, match="num_tokens"):
        write_kv(cache, torch.zeros(2, 1, 8), torch.zeros(2, 1, 8), meta)


def test_page_beyond_the_cache_is_rejected() -> None:
    """A table naming a page the cache lacks raises before writing."""
    meta = PagedMetadata.build([1], [1], [[9]], 4)
    with pytest.raises(KernelInputError, match="page 9"):
        write_kv(torch.zeros(4, 2, 1, 4, 8), torch.zeros(1, 1, 8), torch.zeros(1, 1, 8), meta)


def test_block_size_must_match_the_metadata() -> None:
    """The cache's block size is the metadata's."""
    meta = PagedMetadata.build([1], [1], [[1]], 8)
    with pytest.raises(KernelInputError, match="block size"):
        write_kv(torch.zeros(4, 2, 1, 4, 8), torch.zeros(1, 1, 8), torch.zeros(1, 1, 8), meta)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_writes_on_the_device_land_where_they_land_on_the_cpu(
    check_device: torch.device, dtype: torch.dtype
) -> None:
    """The same step's writes on the device give the CPU's cache, bit for bit."""
    meta_cpu = PagedMetadata.build([5, 1, 1], [9, 4, 17], [[3, 1, 6], [2], [7, 4, 8, 5, 9]], 4)
    meta_dev = PagedMetadata.build(
        [5, 1, 1], [9, 4, 17], [[3, 1, 6], [2], [7, 4, 8, 5, 9]], 4, device=check_device
    )
    cache = torch.randn(10, 2, 2, 4, 8).to(dtype)
    key, value = torch.randn(7, 2, 8).to(dtype), torch.randn(7, 2, 8).to(dtype)
    on_device = cache.to(check_device)
    write_kv(cache, key, value, meta_cpu)
    write_kv(on_device, key.to(check_device), value.to(check_device), meta_dev)
    assert torch.equal(on_device.cpu(), cache)
