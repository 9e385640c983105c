"""GatherWorkspace: buffers reused across steps, grown with headroom."""

from __future__ import annotations

import pytest
import torch

from hybridkv.kernels import (
    GatherWorkspace,
    KernelInputError,
    PagedMetadata,
    paged_attention,
    write_kv,
)


def test_buffer_is_reused_when_it_fits() -> None:
    """A second request no larger than the first gets the same memory."""
    ws = GatherWorkspace()
    first = ws.get(100, torch.float32, torch.device("cpu"))
    second = ws.get(90, torch.float32, torch.device("cpu"))
    assert second.data_ptr() == first.data_ptr()
    assert second.numel() == 90


def test_buffer_grows_with_headroom() -> None:
    """A larger request reallocates with room for growth."""
    ws = GatherWorkspace(headroom=1.5)
    ws.get(10, torch.float32, torch.device("cpu"))
    ws.get(100, torch.float32, torch.device("cpu"))
    assert ws.nbytes == 150 * 4


def test_dtypes_get_separate_buffers() -> None:
    """float32 and bfloat16 layers do not share one buffer."""
    ws = GatherWorkspace(headroom=1.0)
    ws.get(8, torch.float32, torch.device("cpu"))
    ws.get(8, torch.bfloat16, torch.device("cpu"))
    assert ws.nbytes == 8 * 4 + 8 * 2
    ws.clear()
    assert ws.nbytes == 0


def test_buffer_made_in_inference_mode_is_usable_outside() -> None:
    """A step outside inference_mode after one inside it still gets a writable buffer."""
    ws = GatherWorkspace()
    with torch.inference_mode():
        ws.get(8, torch.float32, torch.device("cpu"))
    ws.get(8, torch.float32, torch.device("cpu")).fill_(1.0)


def test_headroom_below_one_is_rejected() -> None:
    """A workspace never allocates less than asked for."""
    with pytest.raises(KernelInputError, match="headroom"):
        GatherWorkspace(headroom=0.5)


def test_shared_workspace_gives_the_same_outputs_across_steps() -> None:
    """Steps of different shapes sharing a workspace attend as with private buffers."""
    torch.manual_seed(0)
    ws = GatherWorkspace()
    cache = torch.randn(12, 2, 2, 4, 8)
    for q_lens, ctx_lens, tables in [
        ([1, 5], [9, 5], [[1, 2, 3], [4, 5]]),
        ([1, 1], [10, 6], [[1, 2, 3], [4, 5]]),
        ([3], [22], [[6, 7, 8, 9, 10, 11]]),
    ]:
        shared = PagedMetadata.build(q_lens, ctx_lens, tables, 4, workspace=ws)
        private = PagedMetadata.build(q_lens, ctx_lens, tables, 4)
        kv = torch.randn(2, sum(q_lens), 2, 8)
        write_kv(cache, kv[0], kv[1], shared)
        query = torch.randn(sum(q_lens), 4, 8)
        torch.testing.assert_close(
            paged_attention(query, cache, shared, scale=0.3, sliding_window=7),
            paged_attention(query, cache, private, scale=0.3, sliding_window=7),
            atol=0,
            rtol=0,
        )
