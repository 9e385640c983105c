"""Attention over paged KV caches for mixed batches, on torch SDPA.

Each layer gathers the keys and values the step reads with one ``index_select`` of page
runs (precomputed in the step's ``GatherPlan``) into a workspace buffer, then attends one
region at a time: decodes batched by length, each prefill on its own. Prefills run SDPA (a
prompt run whole with its ``is_causal``, everything else an explicit boolean mask).

Decodes gather only their keys: scores and softmax are explicit, and ``P @ V`` is one
``embedding_bag(mode="sum", per_sample_weights=P)`` over the cache's value rows in place,
so values are read once and never copied. On a CPU this is what brings paged decode
attention near SDPA over contiguous K/V (``benchmarks/decode/attention.py``).

Masking invariant (True = attend). Query at position ``p`` sees key ``k`` iff
``p - W < k <= p``: causal aligned to the END of the context, not SDPA's top-left
``is_causal``. A prefill chunk of 3 tokens after a cached prefix of 4, W = 4::

    key pos     0 1 2 3 4 5 6        keys before key_start = 1 are not even gathered
    query 4     . x x x x . .
    query 5     . . x x x x .
    query 6     . . . x x x x

Keys that are not one window come as ``live_spans`` instead of W, and the mask is built
from the spans (``span_mask``); the rest of the path is the same.

GQA. The G = num_q_heads // num_kv_heads query heads sharing a KV head are folded into the
query rows, so SDPA sees ``num_kv_heads`` heads and reads each key once per KV head:
query ``[B, num_kv_heads, G * num_queries, head_dim]`` against keys
``[B, num_kv_heads, key_len, head_dim]``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hybridkv.kernels.cache_ops import check_cache
from hybridkv.kernels.errors import KernelInputError
from hybridkv.kernels.gather_plan import Region
from hybridkv.kernels.geometry import CacheGeometry
from hybridkv.kernels.metadata import PagedMetadata
from hybridkv.kernels.span_mask import LiveSpans


def paged_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: PagedMetadata,
    *,
    scale: float,
    sliding_window: int | None = None,
    live_spans: LiveSpans | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Attend every query token to its request's cached keys and values.

    Args:
        query: ``[num_tokens, num_q_heads, head_dim]``, tokens in request order.
        kv_cache: ``[num_blocks, 2, num_kv_heads, block_size, head_dim]``, already holding
            this step's keys and values (``write_kv`` runs first).
        meta: this step's metadata of the cache's KV group.
        scale: multiplier of the query-key dot products.
        sliding_window: W, the keys a query sees counting itself (Hugging Face semantics).
        live_spans: For keys that are not one window: position p -> the sorted spans of
            earlier positions the query at p reads (it reads itself too); pages no query
            reads may be the null block. Exclusive with ``sliding_window``.
        softcap: c in ``c * tanh(scores / c)`` before the softmax (Gemma 2).

    Returns:
        ``[num_tokens, num_q_heads, head_dim]`` in the query's dtype.

    Raises:
        KernelInputError: shapes or dtypes disagree, a table reads the null block, or a
            span lies outside ``[0, p)``.
    """
    geometry = check_cache(kv_cache, meta)
    num_kv_heads, head_dim = geometry.num_kv_heads, geometry.head_dim
    if query.dim() != 3 or query.shape[0] != meta.num_tokens or query.shape[2] != head_dim:
        raise KernelInputError(
            f"query {tuple(query.shape)} must be [num_tokens={meta.num_tokens}, "
            f"num_q_heads, head_dim={head_dim}]"
        )
    if query.shape[1] % num_kv_heads:
        raise KernelInputError(
            f"num_q_heads {query.shape[1]} is not a multiple of num_kv_heads {num_kv_heads}"
        )
    if query.dtype != kv_cache.dtype:
        raise KernelInputError(f"query {query.dtype} != kv_cache {kv_cache.dtype}")
    if softcap is not None and softcap <= 0:
        raise KernelInputError(f"softcap must be > 0, got {softcap}")
    group = query.shape[1] // num_kv_heads
    plan = meta.plan(
        geometry, num_queries_per_kv=group, sliding_window=sliding_window, live_spans=live_spans
    )
    gathered = plan.buffer(kv_cache.dtype)
    runs = gathered.view(-1, geometry.run_len)
    torch.index_select(geometry.rows_view(kv_cache), 0, plan.runs, out=runs)
    if plan.zero_rows is not None:
        gathered.index_fill_(0, plan.zero_rows, 0)
    regions = plan.regions
    index = regions[0].token_index
    if len(regions) == 1 and isinstance(index, slice) and index == slice(0, meta.num_tokens):
        # Every token in one region, in order (a decode batch, one prompt): no copy.
        return _attend(query, gathered, kv_cache, regions[0], geometry, scale, softcap)
    out = torch.empty_like(query)
    for region in regions:
        q = query[region.token_index]
        out[region.token_index] = _attend(q, gathered, kv_cache, region, geometry, scale, softcap)
    return out


def _attend(
    query: torch.Tensor,
    gathered: torch.Tensor,
    kv_cache: torch.Tensor,
    region: Region,
    geometry: CacheGeometry,
    scale: float,
    softcap: float | None,
) -> torch.Tensor:
    """One region's queries against its gathered keys (and values, or values in place)."""
    if region.value_bags is not None:
        values = geometry.token_rows_view(kv_cache)
        return _attend_decodes(query, gathered, values, region, scale, softcap)
    return _attend_region(query, gathered, region, geometry.num_kv_heads, scale, softcap)


def _attend_decodes(
    query: torch.Tensor,
    gathered: torch.Tensor,
    values: torch.Tensor,
    region: Region,
    scale: float,
    softcap: float | None,
) -> torch.Tensor:
    """Decodes of one region: gathered keys, values read in place by ``embedding_bag``.

    In float32, CPU BLAS runs ``keys @ queries`` (a matrix times G columns) about twice as
    fast as the transposed product; in bfloat16 the transposed product is the faster one.
    """
    bags = region.value_bags
    assert bags is not None
    batch, key_len = region.num_requests, region.key_len
    num_q_heads, head_dim = query.shape[1], query.shape[2]
    keys = gathered[region.row_offset : region.row_offset + region.num_rows]
    keys = keys.view(batch, -1, key_len, head_dim)
    q = query.view(batch, keys.shape[1], -1, head_dim) * scale
    if query.dtype == torch.float32:
        scores = torch.matmul(keys, q.transpose(-1, -2)).transpose(-1, -2)
    else:
        scores = torch.matmul(q, keys.transpose(-1, -2))
    if softcap is not None:
        scores = torch.tanh(scores.float() / softcap) * softcap
    if region.mask is not None:
        scores = torch.where(region.mask, scores, float("-inf"))
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(values.dtype).reshape(-1)
    if bags.keep is not None:
        weights = weights[bags.keep]
    out = F.embedding_bag(bags.rows, values, bags.offsets, mode="sum", per_sample_weights=weights)
    return out.view(batch, num_q_heads, head_dim)


def _attend_region(
    query: torch.Tensor,
    gathered: torch.Tensor,
    region: Region,
    num_kv_heads: int,
    scale: float,
    softcap: float | None,
) -> torch.Tensor:
    """Attention of one region's ``[B * num_queries, num_q_heads, head_dim]`` queries."""
    batch, num_queries, key_len = region.num_requests, region.num_queries, region.key_len
    num_q_heads, head_dim = query.shape[1], query.shape[2]
    group = num_q_heads // num_kv_heads
    kv = gathered[region.row_offset : region.row_offset + region.num_rows]
    kv = kv.view(2, batch, num_kv_heads, key_len, head_dim)
    if region.is_causal and softcap is None:
        # A whole prompt: top-left causal is exact; GQA unfolded so SDPA can skip blocks.
        o = F.scaled_dot_product_attention(
            query.transpose(0, 1)[None],
            kv[0],
            kv[1],
            is_causal=True,
            scale=scale,
            enable_gqa=group > 1,
        )
        return o[0].transpose(0, 1)
    # [B*Q, Hq, D] -> [B, Hkv, G*Q, D]; a pure view when Q == 1 (decodes).
    q = query.view(batch, num_queries, num_kv_heads, group, head_dim)
    q = q.permute(0, 2, 3, 1, 4).reshape(batch, num_kv_heads, group * num_queries, head_dim)
    if softcap is None:
        o = F.scaled_dot_product_attention(q, kv[0], kv[1], attn_mask=region.mask, scale=scale)
    else:
        mask = region.mask
        if region.is_causal:
            mask = torch.ones(num_queries, key_len, dtype=torch.bool, device=q.device).tril()
            mask = mask.repeat(group, 1)
        o = _softcapped_attention(q, kv[0], kv[1], mask, scale, softcap)
    o = o.view(batch, num_kv_heads, group, num_queries, head_dim).permute(0, 3, 1, 2, 4)
    return o.reshape(batch * num_queries, num_q_heads, head_dim)


def _softcapped_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    scale: float,
    softcap: float,
) -> torch.Tensor:
    """Explicit softmax attention with ``scores = c * tanh(scores / c)``, scores in float32."""
    scores = torch.matmul(q, k.transpose(-1, -2)).float() * scale
    scores = torch.tanh(scores / softcap) * softcap
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores, dim=-1).to(v.dtype), v)
