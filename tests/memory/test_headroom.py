"""A pool's free pages as the longest prompt they hold (a router's load signal)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from hybridkv.memory.headroom import token_headroom
from hybridkv.memory.manager import KVCacheManager
from hybridkv.policies import FullAttention, MambaLike, SlidingWindow

BS = 8
KV = KVCacheManager([FullAttention(), SlidingWindow(window=16), MambaLike()], 200, BS)


def test_the_worked_example_of_the_module() -> None:
    kv = KVCacheManager([FullAttention(), SlidingWindow(window=16)], 64, BS)
    assert token_headroom(kv, 40, limit=10_000) == 296
    assert token_headroom(kv, 40, limit=100) == 100  # capped
    assert token_headroom(kv, 1, limit=100) == 0  # not even one token's pages


@given(st.integers(0, 200), st.integers(1, 4000))
def test_it_is_the_longest_prompt_whose_pages_fit(free: int, limit: int) -> None:
    tokens = token_headroom(KV, free, limit)
    assert 0 <= tokens <= limit
    if tokens:
        assert KV.num_blocks_needed(tokens) <= free
    if tokens < limit:
        assert KV.num_blocks_needed(tokens + 1) > free
