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

import attrs
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
    sinks: torch.Tensor | None = None,
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
        sinks: ``[num_q_heads]`` float32 learned sink logits (gpt-oss): each head's softmax
            has one more term, ``exp(sink)``, whose value is zero, so a query may give
            its keys less than all of its weight.

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
    if sinks is not None and sinks.shape != (query.shape[1],):
        raise KernelInputError(
            f"sinks {tuple(sinks.shape)} must be one per query head ({query.shape[1]})"
        )
    logits = _Logits(scale, softcap, sinks)
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
        return _attend(query, gathered, kv_cache, regions[0], geometry, logits)
    out = torch.empty_like(query)
    for region in regions:
        q = query[region.token_index]
        out[region.token_index] = _attend(q, gathered, kv_cache, region, geometry, logits)
    return out


@attrs.frozen
class _Logits:
    """How scores become weights: scaled, soft-capped, and with a sink per head."""

    scale: float
    softcap: float | None
    sinks: torch.Tensor | None

    @property
    def plain(self) -> bool:
        """Scaled scores and a plain softmax: what SDPA computes."""
        return self.softcap is None and self.sinks is None

    def weights(self, scores: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """Float32 softmax weights of scaled scores ``[B, Hkv, rows, K]`` masked by
        ``mask``; a KV head's rows are its G query heads', each head's queries in turn."""
        if self.softcap is not None:
            scores = torch.tanh(scores.float() / self.softcap) * self.softcap
        if mask is not None:
            scores = torch.where(mask, scores, float("-inf"))
        if self.sinks is None:
            return torch.softmax(scores, dim=-1, dtype=torch.float32)
        # The sink joins the normaliser: exp(s_i) / (sum_j exp(s_j) + exp(sink)).
        batch, num_kv, rows, key_len = scores.shape
        sink = self.sinks.view(1, num_kv, -1, 1).to(torch.float32)
        per_row = rows // sink.shape[2]  # each query head's rows (1 for decodes)
        sink = sink.repeat_interleave(per_row, dim=2).expand(batch, -1, -1, -1)
        joined = torch.cat((scores.float(), sink), dim=-1)
        return torch.softmax(joined, dim=-1)[..., :key_len]


def _attend(
    query: torch.Tensor,
    gathered: torch.Tensor,
    kv_cache: torch.Tensor,
    region: Region,
    geometry: CacheGeometry,
    logits: _Logits,
) -> torch.Tensor:
    """One region's queries against its gathered keys (and values, or values in place)."""
    if region.value_bags is not None:
        values = geometry.token_rows_view(kv_cache)
        return _attend_decodes(query, gathered, values, region, logits)
    return _attend_region(query, gathered, region, geometry.num_kv_heads, logits)


def _attend_decodes(
    query: torch.Tensor,
    gathered: torch.Tensor,
    values: torch.Tensor,
    region: Region,
    logits: _Logits,
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
    q = query.view(batch, keys.shape[1], -1, head_dim) * logits.scale
    if query.dtype == torch.float32:
        scores = torch.matmul(keys, q.transpose(-1, -2)).transpose(-1, -2)
    else:
        scores = torch.matmul(q, keys.transpose(-1, -2))
    weights = logits.weights(scores, region.mask).to(values.dtype).reshape(-1)
    if bags.keep is not None:
        weights = weights[bags.keep]
    out = F.embedding_bag(bags.rows, values, bags.offsets, mode="sum", per_sample_weights=weights)
    return out.view(batch, num_q_heads, head_dim)


def _attend_region(
    query: torch.Tensor,
    gathered: torch.Tensor,
    region: Region,
    num_kv_heads: int,
    logits: _Logits,
) -> torch.Tensor:
    """Attention of one region's ``[B * num_queries, num_q_heads, head_dim]`` queries."""
    batch, num_queries, key_len = region.num_requests, region.num_queries, region.key_len
    num_q_heads, head_dim = query.shape[1], query.shape[2]
    group = num_q_heads // num_kv_heads
    kv = gathered[region.row_offset : region.row_offset + region.num_rows]
    kv = kv.view(2, batch, num_kv_heads, key_len, head_dim)
    if region.is_causal and logits.plain:
        # A whole prompt: top-left causal is exact; GQA unfolded so SDPA can skip blocks.
        o = F.scaled_dot_product_attention(
            query.transpose(0, 1)[None],
            kv[0],
            kv[1],
            is_causal=True,
            scale=logits.scale,
            enable_gqa=group > 1,
        )
        return o[0].transpose(0, 1)
    # [B*Q, Hq, D] -> [B, Hkv, G*Q, D]; a pure view when Q == 1 (decodes).
    q = query.view(batch, num_queries, num_kv_heads, group, head_dim)
    q = q.permute(0, 2, 3, 1, 4).reshape(batch, num_kv_heads, group * num_queries, head_dim)
    if logits.plain:
        o = F.scaled_dot_product_attention(
            q, kv[0], kv[1], attn_mask=region.mask, scale=logits.scale
        )
    else:
        mask = region.mask
        if region.is_causal:
            mask = torch.ones(num_queries, key_len, dtype=torch.bool, device=q.device).tril()
            mask = mask.repeat(group, 1)
        scores = torch.matmul(q, kv[0].transpose(-1, -2)).float() * logits.scale
        o = torch.matmul(logits.weights(scores, mask).to(kv.dtype), kv[1])
    o = o.view(batch, num_kv_heads, group, num_queries, head_dim).permute(0, 3, 1, 2, 4)
    return o.reshape(batch * num_queries, num_q_heads, head_dim)
