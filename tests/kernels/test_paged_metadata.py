"""PagedMetadata.build: slot mapping and input validation."""

from __future__ import annotations

import pytest
import torch

from hybridkv.kernels import KernelInputError, PagedMetadata


def test_slot_mapping_follows_positions_through_block_tables() -> None:
    """Token at position p lands in block_table[p // bs] at offset p % bs."""
    meta = PagedMetadata.build([4, 1, 1], [9, 13, 4], [[3, 1, 7], [2, 5, 6, 8], [4]], 4)
    # r0 positions 5..8 -> page 1 offsets 1..3, page 7 offset 0; r1 position 12 -> page 8;
    # r2 position 3 -> page 4 offset 3.
    expected = [1 * 4 + 1, 1 * 4 + 2, 1 * 4 + 3, 7 * 4 + 0, 8 * 4 + 0, 4 * 4 + 3]
    assert meta.slot_mapping.tolist() == expected
    assert meta.num_tokens == 6
    assert meta.num_requests == 3


def test_null_entries_before_the_window_are_accepted() -> None:
    """Released (null) blocks before the new tokens do not stop the build."""
    meta = PagedMetadata.build([1], [10], [[0, 0, 5]], 4)
    assert meta.slot_mapping.tolist() == [5 * 4 + 1]


def test_writing_into_the_null_block_is_rejected() -> None:
    """A new token whose page is the null block raises."""
    with pytest.raises(KernelInputError, match="null block"):
        PagedMetadata.build([2], [5], [[3, 0]], 4)


def test_short_block_table_is_rejected() -> None:
    """A table must cover every position of the context."""
    with pytest.raises(KernelInputError, match="needs 3 blocks"):
        PagedMetadata.build([1], [9], [[1, 2]], 4)


@pytest.mark.parametrize(("query_len", "context_len"), [(0, 3), (4, 3)])
def test_query_len_outside_one_to_context_is_rejected(query_len: int, context_len: int) -> None:
    """query_len must lie in [1, context_len]."""
    with pytest.raises(KernelInputError, match="query_len"):
        PagedMetadata.build([query_len], [context_len], [[1]], 4)


def test_mismatched_request_counts_are_rejected() -> None:
    """One query_len, context_len and table per request."""
    with pytest.raises(KernelInputError, match="one of each"):
        PagedMetadata.build([1, 1], [3], [[1]], 4)


def test_empty_batch_is_rejected() -> None:
    """A step has at least one request."""
    with pytest.raises(KernelInputError, match="at least one"):
        PagedMetadata.build([], [], [], 4)


def test_index_tensors_live_on_the_requested_device() -> None:
    """The slot mapping is placed on the device named at build time."""
    meta = PagedMetadata.build([1], [1], [[1]], 4, device="cpu")
    assert meta.slot_mapping.device == torch.device("cpu")
    assert meta.slot_mapping.dtype == torch.long
