"""paged_attention's generic path (keys from live spans) against brute-force attention.

Tables hold the null block wherever no query of the step reads a page (as the allocator
leaves them for a sink + window policy), and every unread cache row holds NaN, so a page
read or a mask missed shows in the output.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence

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

Spans = Callable[[int], Sequence[tuple[int, int]]]
F32 = {"atol": 1e-5, "rtol": 1e-5}


@pytest.fixture(autouse=True, scope="module", params=["values_in_place", "values_gathered"])
def _decode_values(request: pytest.FixtureRequest) -> Iterator[None]:
    """Every test runs with decodes reading values in place, then gathering them."""
    saved = gather_regions.VALUE_BAGS_MIN_ELEMENTS
    gather_regions.VALUE_BAGS_MIN_ELEMENTS = 0 if request.param == "values_in_place" else 1 << 62
    yield
    gather_regions.VALUE_BAGS_MIN_ELEMENTS = saved


def sink_window(sinks: int, window: int) -> Spans:
    """StreamingLLM: the first ``sinks`` positions and the ``window - 1`` before p."""

    def spans(p: int) -> tuple[tuple[int, int], ...]:
        start = max(0, p - window + 1)
        if start <= sinks:
            return ((0, p),) if p else ()
        return ((0, sinks), (start, p))

    return spans


def chunked(chunk: int) -> Spans:
    """Llama 4's local layers: the positions of p's chunk before it."""

    def spans(p: int) -> tuple[tuple[int, int], ...]:
        start = p // chunk * chunk
        return ((start, p),) if start < p else ()

    return spans


SINK_WINDOW = sink_window(4, 8)


@attrs.frozen
class Case:
    """One step: per request (query_len, context_len), heads, and the spans it attends."""

    requests: tuple[tuple[int, int], ...]
    spans: Spans = SINK_WINDOW
    block_size: int = 4
    num_kv_heads: int = 2
    num_q_heads: int = 4
    head_dim: int = 16
    softcap: float | None = None
    seed: int = 0


def attended(spans: Spans, p: int) -> set[int]:
    """Positions the query at p reads: its spans and itself."""
    return {k for start, end in spans(p) for k in range(start, end)} | {p}


def run_case(
    case: Case, device: str = "cpu", dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """Paged output (back on the CPU) and float64 reference of one case; the cache and
    queries in ``dtype``, the reference from the same values rounded to it."""
    gen = torch.Generator().manual_seed(case.seed)
    bs, hkv, d = case.block_size, case.num_kv_heads, case.head_dim
    needed = [-(-ctx // bs) for _, ctx in case.requests]
    num_blocks = sum(needed) + 2
    pages = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    cache = torch.full((num_blocks, 2, hkv, bs, d), math.nan)
    tables, queries, new_k, new_v, refs = [], [], [], [], []
    for (q_len, ctx), n in zip(case.requests, needed, strict=True):
        table, pages = pages[:n], pages[n:]
        k = torch.randn(ctx, hkv, d, generator=gen).to(dtype).float()
        v = torch.randn(ctx, hkv, d, generator=gen).to(dtype).float()
        q = torch.randn(q_len, case.num_q_heads, d, generator=gen).to(dtype).float()
        read = set().union(*(attended(case.spans, p) for p in range(ctx - q_len, ctx)))
        # A page that no query reads and no new token is written into was released.
        kept = {p // bs for p in read} | {p // bs for p in range(ctx - q_len, ctx)}
        tables.append([page if j in kept else 0 for j, page in enumerate(table)])
        for pos in range(ctx - q_len):
            if pos // bs in kept:
                cache[table[pos // bs], :, :, pos % bs] = torch.stack([k[pos], v[pos]])
        queries.append(q)
        new_k.append(k[ctx - q_len :])
        new_v.append(v[ctx - q_len :])
        refs.append(reference(q, k, v, case, ctx))
    meta = PagedMetadata.build(
        [q for q, _ in case.requests], [c for _, c in case.requests], tables, bs, device=device
    )
    cache = cache.to(device, dtype)
    write_kv(cache, torch.cat(new_k).to(device, dtype), torch.cat(new_v).to(device, dtype), meta)
    out = paged_attention(
        torch.cat(queries).to(device, dtype),
        cache,
        meta,
        scale=d**-0.5,
        live_spans=case.spans,
        softcap=case.softcap,
    )
    return out.cpu(), torch.cat(refs).float()


def reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, case: Case, ctx: int
) -> torch.Tensor:
    """Float64 softmax attention of the last len(q) positions, keys as the spans say."""
    q_len, num_q_heads, d = q.shape
    group = num_q_heads // k.shape[1]
    k64 = k.double().repeat_interleave(group, dim=1)
    v64 = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), k64) * d**-0.5
    if case.softcap is not None:
        scores = case.softcap * torch.tanh(scores / case.softcap)
    allowed = torch.zeros(q_len, ctx, dtype=torch.bool)
    for i, p in enumerate(range(ctx - q_len, ctx)):
        allowed[i, sorted(attended(case.spans, p))] = True
    scores = scores.masked_fill(~allowed, -math.inf)
    return torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), v64)


def check(case: Case) -> None:
    out, ref = run_case(case)
    torch.testing.assert_close(out, ref, **F32)


def test_decodes_past_the_window_skip_released_middle_pages() -> None:
    """Decodes of sinks + window read the sink page and the window, not the null middle."""
    check(Case(requests=((1, 30), (1, 9), (1, 17), (1, 3))))


def test_prefill_chunk_after_a_cached_prefix() -> None:
    """A chunk whose queries need different keys gets one mask row per query."""
    check(Case(requests=((7, 29),)))


def test_whole_prompt_longer_than_the_window() -> None:
    """A prompt run whole attends sinks and window per query, from position 0."""
    check(Case(requests=((21, 21),)))


def test_mixed_batch_in_arbitrary_order() -> None:
    """Prefills, chunks and decodes mixed in one step each match the reference."""
    check(Case(requests=((1, 40), (5, 5), (1, 6), (9, 26), (1, 13))))


@pytest.mark.parametrize(("num_q_heads", "num_kv_heads"), [(4, 1), (6, 2), (3, 3)])
def test_grouped_query_heads(num_q_heads: int, num_kv_heads: int) -> None:
    """GQA and MHA fold their query heads as the window path does."""
    check(Case(requests=((1, 22), (6, 19)), num_q_heads=num_q_heads, num_kv_heads=num_kv_heads))


def test_softcap() -> None:
    """Soft-capped scores are masked by the spans too."""
    check(Case(requests=((1, 25), (8, 20), (4, 4)), softcap=2.0))


def test_chunked_local_spans() -> None:
    """Chunked attention (keys of the query's chunk) goes through the same path."""
    check(Case(requests=((1, 23), (9, 19), (1, 5)), spans=chunked(6)))


def test_window_spans_equal_the_window_fast_path() -> None:
    """Spans of a sliding window give what sliding_window gives."""
    window = 6

    def spans(p: int) -> tuple[tuple[int, int], ...]:
        start = max(0, p - window + 1)
        return ((start, p),) if start < p else ()

    gen = torch.Generator().manual_seed(3)
    cache = torch.randn(12, 2, 2, 4, 8, generator=gen)
    meta = PagedMetadata.build([1, 5], [18, 11], [[0, 0, 1, 2, 3], [4, 5, 6]], 4)
    query = torch.randn(6, 4, 8, generator=gen)
    fast = paged_attention(query, cache, meta, scale=0.3, sliding_window=window)
    generic = paged_attention(query, cache, meta, scale=0.3, live_spans=spans)
    torch.testing.assert_close(generic, fast, **F32)


def test_null_block_holding_a_read_key_is_rejected() -> None:
    """A table naming the null block where a query reads a key raises instead of reading it."""
    meta = PagedMetadata.build([1], [30], [[0, 1, 2, 3, 4, 5, 6, 7]], 4)
    with pytest.raises(KernelInputError, match="null block"):
        paged_attention(
            torch.zeros(1, 2, 8), torch.zeros(8, 2, 1, 4, 8), meta, scale=1.0,
            live_spans=sink_window(4, 8),
        )  # fmt: skip


@pytest.mark.parametrize(
    "bad", [((3, 2),), ((0, 9),), ((4, 6), (2, 3)), ((-1, 2),), ((0, 4), (3, 5))]
)
def test_malformed_spans_are_rejected(bad: tuple[tuple[int, int], ...]) -> None:
    """Spans outside [0, p), reversed, unsorted or overlapping are refused, naming p."""
    meta = PagedMetadata.build([1], [9], [[1, 2, 3]], 4)
    with pytest.raises(KernelInputError, match=r"live_spans\(8\)"):
        paged_attention(
            torch.zeros(1, 1, 8), torch.zeros(4, 2, 1, 4, 8), meta, scale=1.0,
            live_spans=lambda p: bad,
        )  # fmt: skip


def test_window_and_spans_together_are_rejected() -> None:
    """A layer names its keys one way: a window or spans."""
    meta = PagedMetadata.build([1], [3], [[1]], 4)
    with pytest.raises(KernelInputError, match="not both"):
        paged_attention(
            torch.zeros(1, 1, 8), torch.zeros(2, 2, 1, 4, 8), meta, scale=1.0,
            sliding_window=2, live_spans=chunked(2),
        )  # fmt: skip


def test_plan_is_shared_by_layers_passing_the_same_spans() -> None:
    """Layers of one group with one spans callable reuse the step's plan."""
    meta = PagedMetadata.build([1, 3], [9, 3], [[1, 2, 3], [4]], 4)
    geometry = CacheGeometry.of(torch.zeros(5, 2, 2, 4, 8))
    spans = sink_window(2, 3)
    first = meta.plan(geometry, num_queries_per_kv=2, sliding_window=None, live_spans=spans)
    again = meta.plan(geometry, num_queries_per_kv=2, sliding_window=None, live_spans=spans)
    assert first is again


@settings(max_examples=40, deadline=None)
@given(
    requests=st.lists(
        st.tuples(st.integers(1, 9), st.integers(0, 30)).map(lambda t: (t[0], t[0] + t[1])),
        min_size=1,
        max_size=5,
    ),
    block_size=st.sampled_from([1, 2, 4, 16]),
    sinks=st.integers(1, 6),
    window=st.integers(1, 12),
    seed=st.integers(0, 2**16),
)
def test_random_sink_window_batches(
    requests: list[tuple[int, int]], block_size: int, sinks: int, window: int, seed: int
) -> None:
    """Random mixed batches, block sizes, sinks and windows match the reference."""
    case = Case(
        requests=tuple(requests),
        spans=sink_window(sinks, window),
        block_size=block_size,
        seed=seed,
    )
    check(case)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("policy", ["sink_window", "chunked"])
def test_mixed_batch_on_the_device(
    check_device: torch.device, dtype: torch.dtype, policy: str
) -> None:
    """The mixed batch gives the reference on the device, for StreamingLLM's sinks and a
    window, and for Llama 4's chunks (the policies whose keys are not one window)."""
    spans = SINK_WINDOW if policy == "sink_window" else chunked(8)
    case = Case(requests=((1, 40), (5, 5), (1, 6), (9, 26), (1, 13)), spans=spans)
    out, ref = run_case(case, device=str(check_device), dtype=dtype)
    tol = 4e-5 if dtype == torch.float32 else 8e-2
    torch.testing.assert_close(out.cpu().float(), ref.cpu().float(), atol=tol, rtol=tol)
