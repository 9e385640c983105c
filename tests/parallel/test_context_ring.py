"""The byte rule choosing pass-Q over pass-KV for a prefill over cached keys."""

from __future__ import annotations

import pytest
import torch

from hybridkv.parallel.context_ring import prefers_pass_q

#: 8 query heads of 64 over 2 KV heads, float32: K and V of a token are 2 * 2 * 64 * 4 bytes.
QUERY = torch.zeros(1, 8, 64)
KV_TOKEN = 2 * 2 * 64 * 4


def test_a_full_prefill_passes_kv() -> None:
    """Nothing cached: the queries and their partial outputs are all extra bytes."""
    assert not prefers_pass_q(4096, 0, QUERY, KV_TOKEN)


@pytest.mark.parametrize(("new", "cached", "expected"), [(512, 3584, True), (512, 1024, False)])
def test_a_chunk_over_a_long_prefix_passes_queries(new, cached, expected) -> None:
    """Pass Q when the cached K/V (1 KiB a token) outweigh the queries (2 KiB) and the
    float32 partial outputs with their lse (2080 bytes) coming back: P / T above ~4.03."""
    assert prefers_pass_q(new, cached, QUERY, KV_TOKEN) is expected
    per_query = 8 * 64 * 4 + 8 * 65 * 4
    assert prefers_pass_q(1000, 1000 * per_query // KV_TOKEN + 1, QUERY, KV_TOKEN)
    assert not prefers_pass_q(1000, 1000 * per_query // KV_TOKEN, QUERY, KV_TOKEN)
