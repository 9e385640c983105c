"""Exact merge of attention computed over disjoint shards of the keys.

Attention of one query over keys ``K = K_1 ∪ ... ∪ K_S`` (disjoint) is a weighted mean of
the attention over each shard, weighted by the shard's share of the softmax mass::

    lse_s  = log sum_{k in K_s} exp(score(q, k))          -inf for a shard with no key
    out    = sum_s exp(lse_s - lse) * out_s,   lse = log sum_s exp(lse_s)

Subtracting ``m = max_s lse_s`` first keeps every ``exp`` at most 1 (no overflow). A shard
with no key the query may read (a rank holding none of a short request's tokens, a window
that ends before a shard starts) has ``lse_s = -inf`` and weight 0, whatever its output
holds; a query that reads no key at all gets output 0 and lse ``-inf``, never NaN.
"""

from __future__ import annotations

import torch

from hybridkv.kernels.errors import KernelInputError


def merge_partials(outputs: torch.Tensor, lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge ``S`` partial attention results of the same queries into one.

    Args:
        outputs: ``[S, num_tokens, num_heads, head_dim]``, each shard's normalised output.
        lses: ``[S, num_tokens, num_heads]``, each shard's log-sum-exp of the scores
            (``-inf`` where the shard holds no key for that query).

    Returns:
        ``([num_tokens, num_heads, head_dim]`` in the outputs' dtype, ``[num_tokens,
        num_heads]`` float32 lse of all shards together).

    Raises:
        KernelInputError: the shapes do not agree.
    """
    if outputs.dim() != 4 or tuple(lses.shape) != tuple(outputs.shape[:3]):
        raise KernelInputError(
            f"outputs {tuple(outputs.shape)} must be [shards, tokens, heads, head_dim] and "
            f"lses {tuple(lses.shape)} [shards, tokens, heads]"
        )
    lses = lses.float()
    peak = lses.amax(dim=0)
    # Queries no shard attends: any finite peak gives every weight exp(-inf) = 0.
    safe_peak = torch.where(torch.isneginf(peak), torch.zeros_like(peak), peak)
    weights = torch.exp(lses - safe_peak)
    total = weights.sum(dim=0)
    norm = torch.where(total > 0, total, torch.ones_like(total))
    # A shard of weight 0 may hold anything (an empty shard's zeros, padding): mask it out.
    parts = torch.where(weights[..., None] > 0, outputs.float(), 0.0)
    merged = (parts * weights[..., None]).sum(dim=0) / norm[..., None]
    lse = safe_peak + torch.log(total)
    lse = torch.where(total > 0, lse, torch.full_like(lse, float("-inf")))
    return merged.to(outputs.dtype), lse
