"""paged_attention against plain softmax attention over contiguous K/V per request."""

from __future__ import annotations

import math
from collections.abc import Iterator

import attrs
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridkv.kernels import (
    KernelInputError,
    PagedMetadata,
    gather_regions,
    paged_attention,
    write_kv,
)
from hybridkv.kernels.geometry import CacheGeometry

F32 = {"atol": 1e-5, "rtol": 1e-5}
BF16 = {"atol": 2e-2, "rtol": 2e-2}


@pytest.fixture(autouse=True, scope="module", params=["values_in_place", "values_gathered"])
def _decode_values(request: pytest.FixtureRequest) -> Iterator[None]:
    """Every test runs with decodes reading values in place, then gathering them."""
    saved = gather_regions.VALUE_BAGS_MIN_ELEMENTS
    gather_regions.VALUE_BAGS_MIN_ELEMENTS = 0 if request.param == "values_in_place" else 1 << 62
    yield
    gather_regions.VALUE_BAGS_MIN_ELEMENTS = saved


@attrs.frozen
class Case:
    """One step: per request (query_len, context_len), and the head geometry."""

    requests: tuple[tuple[int, int], ...]
    block_size: int = 4
    num_kv_heads: int = 2
    num_q_heads: int = 4
    head_dim: int = 16
    window: int | None = None
    softcap: float | None = None
    sinks: bool = False  # a learned sink logit per query head (gpt-oss)
    dtype: torch.dtype = torch.float32
    seed: int = 0
    page_padding: int = 0  # extra elements per page: the cache is a view into a wider pool
    values_are_keys: bool = False  # one vector a token read as key and value (MLA's latent)


def run_case(case: Case, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Paged output and reference output of one case; unread cache rows hold NaN."""
    gen = torch.Generator().manual_seed(case.seed)
    bs, hkv, d = case.block_size, case.num_kv_heads, case.head_dim
    needed = [-(-ctx // bs) for _, ctx in case.requests]
    num_blocks = sum(needed) + 3
    pages = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    kv_runs = 1 if case.values_are_keys else 2
    page_elems = kv_runs * hkv * bs * d
    pool = torch.full((num_blocks, page_elems + case.page_padding), math.nan, dtype=case.dtype)
    cache = pool[:, :page_elems].view(num_blocks, kv_runs, hkv, bs, d).expand(-1, 2, -1, -1, -1)
    tables, keys, values, queries, new_k, new_v = [], [], [], [], [], []
    for (q_len, ctx), n in zip(case.requests, needed, strict=True):
        table, pages = pages[:n], pages[n:]
        k = torch.randn(ctx, hkv, d, generator=gen).to(case.dtype)
        v = k if case.values_are_keys else torch.randn(ctx, hkv, d, generator=gen).to(case.dtype)
        key_start = 0 if case.window is None else max(0, ctx - q_len - case.window + 1)
        for pos in range(key_start, ctx - q_len):  # the cached prefix, written earlier
            cache[table[pos // bs], :kv_runs, :, pos % bs] = torch.stack([k[pos], v[pos]])[:kv_runs]
        # Blocks wholly before the window were released: the table holds the null block.
        tables.append([0 if (j + 1) * bs <= key_start else p for j, p in enumerate(table)])
        keys.append(k)
        values.append(v)
        new_k.append(k[ctx - q_len :])
        new_v.append(v[ctx - q_len :])
        queries.append(torch.randn(q_len, case.num_q_heads, d, generator=gen).to(case.dtype))
    q_lens = [q for q, _ in case.requests]
    ctx_lens = [c for _, c in case.requests]
    meta = PagedMetadata.build(q_lens, ctx_lens, tables, bs, device=device)
    cache = cache.to(device)
    new_values = None if case.values_are_keys else torch.cat(new_v).to(device)
    write_kv(cache, torch.cat(new_k).to(device), new_values, meta)
    scale = d**-0.5
    sinks = torch.randn(case.num_q_heads, generator=gen) * 2 if case.sinks else None
    out = paged_attention(
        torch.cat(queries).to(device),
        cache,
        meta,
        scale=scale,
        sliding_window=case.window,
        softcap=case.softcap,
        sinks=None if sinks is None else sinks.to(device),
    )
    ref = [
        reference(q, k, v, scale, case.window, case.softcap, sinks)
        for q, k, v in zip(queries, keys, values, strict=True)
    ]
    return out.cpu(), torch.cat(ref).to(case.dtype)


def reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    window: int | None,
    softcap: float | None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Float64 softmax attention of the last len(q) positions of one request (with a
    sink, a column of the softmax whose value is zero)."""
    q_len, num_q_heads, _ = q.shape
    ctx, num_kv_heads, _ = k.shape
    group = num_q_heads // num_kv_heads
    k64 = k.double().repeat_interleave(group, dim=1)
    v64 = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k64) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    q_pos = torch.arange(ctx - q_len, ctx)[:, None]
    k_pos = torch.arange(ctx)[None, :]
    allowed = k_pos <= q_pos
    if window is not None:
        allowed &= k_pos > q_pos - window
    scores = scores.masked_fill(~allowed, -math.inf)
    if sinks is None:
        return torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), v64)
    sink = sinks.double()[:, None, None].expand(-1, q_len, 1)
    weights = torch.softmax(torch.cat((scores, sink), dim=-1), dim=-1)[..., :-1]
    return torch.einsum("hqk,khd->qhd", weights, v64)


def check(case: Case) -> None:
    out, ref = run_case(case)
    tol = F32 if case.dtype == torch.float32 else BF16
    torch.testing.assert_close(out, ref, **tol)


def test_decode_batch_of_unequal_contexts() -> None:
    """A batch of decodes with different context lengths matches the reference."""
    check(Case(requests=((1, 9), (1, 1), (1, 16), (1, 23))))


def test_prefill_from_scratch() -> None:
    """A whole prompt in one step is causal attention over its own tokens."""
    check(Case(requests=((11, 11),)))


def test_chunked_prefill_after_cached_prefix() -> None:
    """A prefill chunk attends the cached prefix and causally within itself."""
    check(Case(requests=((5, 18),)))


def test_mixed_batch_in_arbitrary_order() -> None:
    """Prefills, chunks and decodes interleaved in one batch each match the reference."""
    check(Case(requests=((1, 7), (6, 6), (1, 30), (4, 13), (1, 2))))


@pytest.mark.parametrize(("num_q_heads", "num_kv_heads"), [(3, 3), (8, 2), (8, 1)])
def test_grouped_query_heads(num_q_heads: int, num_kv_heads: int) -> None:
    """Query heads share KV heads in consecutive groups, as repeat_interleave would."""
    check(Case(requests=((1, 9), (5, 12)), num_q_heads=num_q_heads, num_kv_heads=num_kv_heads))


@pytest.mark.parametrize("window", [1, 3, 4, 7, 64])
def test_sliding_window_with_released_blocks(window: int) -> None:
    """Windows shorter than, equal to and longer than a block skip NaN-filled null blocks."""
    check(Case(requests=((1, 21), (6, 19), (1, 3), (9, 9)), window=window))


def test_softcap() -> None:
    """Soft-capped scores go through tanh before the softmax."""
    check(Case(requests=((1, 9), (4, 10), (6, 6)), softcap=0.5))


def test_softcap_with_sliding_window() -> None:
    """Softcap and a window together (Gemma 2 local layers) match the reference."""
    check(Case(requests=((1, 13), (5, 14)), softcap=2.0, window=5))


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sinks_take_a_share_of_each_heads_weight(window, dtype) -> None:
    """A sink per query head (gpt-oss) joins each softmax's normaliser: decodes,
    chunks and whole prompts, grouped query heads, with and without a window."""
    requests = ((1, 13), (5, 14), (1, 3), (9, 9))
    check(Case(requests=requests, sinks=True, window=window, num_q_heads=8, dtype=dtype))


def test_sinks_of_the_wrong_shape_are_refused() -> None:
    meta = PagedMetadata.build([1], [1], [[1]], 4)
    cache = torch.zeros(2, 2, 1, 4, 8)
    with pytest.raises(KernelInputError, match="one per query head"):
        paged_attention(torch.zeros(1, 2, 8), cache, meta, scale=1.0, sinks=torch.zeros(3))


def test_bfloat16_mixed_batch() -> None:
    """bfloat16 caches give the reference within bfloat16 precision."""
    check(Case(requests=((1, 17), (7, 12), (1, 5)), dtype=torch.bfloat16, window=6))


@pytest.mark.parametrize("page_padding", [64, 24])
def test_cache_viewed_into_a_pool_of_wider_pages(page_padding: int) -> None:
    """Pages further apart than their size (a shared pool) are read correctly, NaN gaps unread."""
    check(Case(requests=((1, 9), (5, 14), (7, 7)), window=6, page_padding=page_padding))


@pytest.mark.parametrize("window", [None, 6])
def test_values_that_are_the_keys(window: int | None) -> None:
    """A cache of one vector a token, read as its key and its value (a K/V axis of
    stride 0: multi-head latent attention's latent), in a pool of wider pages: prefills,
    chunks and decodes, 16 query heads on the one KV head."""
    requests = ((1, 9), (5, 14), (7, 7), (1, 22))
    case = Case(
        requests, num_q_heads=16, num_kv_heads=1, values_are_keys=True, page_padding=40,
        window=window,
    )  # fmt: skip
    check(case)


def test_values_for_a_cache_whose_values_are_its_keys_are_refused() -> None:
    meta = PagedMetadata.build([1], [1], [[1]], 4)
    latent = torch.zeros(2, 1, 1, 4, 8).expand(-1, 2, -1, -1, -1)
    with pytest.raises(KernelInputError, match="values given"):
        write_kv(latent, torch.zeros(1, 1, 8), torch.zeros(1, 1, 8), meta)
    with pytest.raises(KernelInputError, match="values missing"):
        write_kv(torch.zeros(2, 2, 1, 4, 8), torch.zeros(1, 1, 8), None, meta)


def test_cache_with_non_contiguous_pages_is_rejected() -> None:
    """A cache whose pages are not contiguous cannot be gathered by runs."""
    meta = PagedMetadata.build([1], [3], [[1]], 4)
    cache = torch.zeros(2, 2, 1, 8, 4).transpose(3, 4)
    with pytest.raises(KernelInputError, match="contiguous"):
        paged_attention(torch.zeros(1, 1, 8), cache, meta, scale=1.0)


def test_query_sliced_from_a_fused_projection() -> None:
    """A non-contiguous query (a slice of a fused QKV output) gives the contiguous result."""
    torch.manual_seed(0)
    meta = PagedMetadata.build([1, 4, 1], [6, 4, 9], [[1, 2], [3], [4, 5, 6]], 4)
    cache = torch.randn(7, 2, 2, 4, 8)
    qkv = torch.randn(6, (4 + 2 * 2) * 8)
    query = qkv[:, : 4 * 8].view(6, 4, 8)
    assert not query.is_contiguous()
    torch.testing.assert_close(
        paged_attention(query, cache, meta, scale=0.3),
        paged_attention(query.contiguous(), cache, meta, scale=0.3),
        atol=0,
        rtol=0,
    )


def test_null_block_in_attended_range_is_rejected() -> None:
    """A table naming the null block inside the attended range raises instead of reading it."""
    meta = PagedMetadata.build([1], [9], [[0, 1, 2]], 4)
    cache = torch.zeros(3, 2, 1, 4, 8)
    with pytest.raises(KernelInputError, match="null block"):
        paged_attention(torch.zeros(1, 1, 8), cache, meta, scale=1.0)


def test_query_heads_not_multiple_of_kv_heads_is_rejected() -> None:
    """num_q_heads must be a multiple of num_kv_heads."""
    meta = PagedMetadata.build([1], [3], [[1]], 4)
    with pytest.raises(KernelInputError, match="multiple"):
        paged_attention(torch.zeros(1, 3, 8), torch.zeros(2, 2, 2, 4, 8), meta, scale=1.0)


def test_plan_is_built_once_per_step() -> None:
    """Layers of one group reuse the step's gather plan."""
    meta = PagedMetadata.build([1, 3], [5, 3], [[1, 2], [3]], 4)
    geometry = CacheGeometry.of(torch.zeros(4, 2, 2, 4, 8))
    first = meta.plan(geometry, num_queries_per_kv=2, sliding_window=None)
    again = meta.plan(geometry, num_queries_per_kv=2, sliding_window=None)
    assert first is again


@pytest.mark.parametrize(("window", "is_causal"), [(None, True), (6, True), (5, False)])
def test_whole_prompt_uses_sdpa_causal_unless_the_window_cuts_it(
    window: int | None, is_causal: bool
) -> None:
    """A prompt run whole maps onto SDPA's is_causal when no window reaches back past 0."""
    meta = PagedMetadata.build([6, 3], [6, 9], [[1, 2], [3, 4, 5]], 4)
    geometry = CacheGeometry.of(torch.zeros(6, 2, 1, 4, 8))
    plan = meta.plan(geometry, num_queries_per_kv=2, sliding_window=window)
    assert [r.is_causal for r in plan.regions] == [is_causal, False]


def test_decodes_of_very_different_lengths_get_separate_calls() -> None:
    """A long decode does not pad a batch of short ones to its length."""
    meta = PagedMetadata.build([1, 1, 1], [4, 400, 3], [[1], list(range(1, 101)), [2]], 4)
    geometry = CacheGeometry.of(torch.zeros(101, 2, 1, 4, 8))
    plan = meta.plan(geometry, num_queries_per_kv=1, sliding_window=None)
    assert sorted(r.key_len for r in plan.regions) == [4, 400]


@settings(max_examples=30, deadline=None)
@given(
    requests=st.lists(
        st.tuples(st.integers(1, 9), st.integers(0, 20)).map(lambda t: (t[0], t[0] + t[1])),
        min_size=1,
        max_size=5,
    ),
    block_size=st.sampled_from([1, 2, 4, 16]),
    window=st.none() | st.integers(1, 12),
    seed=st.integers(0, 2**16),
)
def test_random_batches(
    requests: list[tuple[int, int]], block_size: int, window: int | None, seed: int
) -> None:
    """Random mixed batches, block sizes and windows match the reference."""
    check(Case(requests=tuple(requests), block_size=block_size, window=window, seed=seed))


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("window", "softcap"), [(None, None), (24, None), (24, 30.0)])
def test_mixed_batch_on_the_device(
    check_device: torch.device, dtype: torch.dtype, window: int | None, softcap: float | None
) -> None:
    """A mixed batch (decodes, a prefill chunk after a prefix, a whole prompt) with full
    attention, a window, a window and a softcap gives the reference on the device."""
    case = Case(
        requests=((1, 70), (33, 40), (1, 5), (17, 17)), window=window, softcap=softcap, dtype=dtype
    )
    out, ref = run_case(case, device=str(check_device))
    assert out.device.type == check_device.type
    tol = F32 if dtype == torch.float32 else BF16
    # The device's SDPA reduces in another order than the reference: a little more room.
    torch.testing.assert_close(out.cpu(), ref.cpu(), atol=tol["atol"] * 4, rtol=tol["rtol"] * 4)
