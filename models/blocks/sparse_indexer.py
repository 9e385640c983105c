"""DeepSeek Sparse Attention's lightning indexer (DeepSeek V3.2): which earlier tokens each
query of a latent attention layer attends.

The indexer keeps one small key a token and layer (``index_head_dim``), a memory of its own
beside the latent (``AttentionSpec.beside``: its own pages, read as keys alone). A query
scores every key of its context with a few heads of its own, ``sum_h w_h relu(q_h . k)``
(``w`` a projection of the input, the heads' weights), and attends only the ``index_topk``
best of the keys up to itself: all of them while it has no more. Rope turns the first
``qk_rope_head_dim`` channels of the indexer's queries and keys, by halves (not by
adjacent pairs as the latent's rope does).

Ties: where several keys score the same (``relu`` gives 0 to every key no index head
finds), which of them the top k takes is the order's, torch's ``topk`` as transformers'
and DeepSeek's reference take it; the scores of a trained model rarely tie, and the
tests draw enough index heads that a tie is unlikely.
"""

from __future__ import annotations

import torch
from torch import nn

from hybridkv.models.blocks.rope import apply_rope
from hybridkv.models.shapes.latent import LatentShape


class SparseIndexer(nn.Module):
    """The indexer's projections (DeepSeek V3.2's names: ``wq_b`` from the query's low-rank
    input, ``wk`` and its LayerNorm ``k_norm``, ``weights_proj``)."""

    def __init__(self, hidden: int, shape: LatentShape) -> None:
        super().__init__()
        heads, width = shape.index_heads, shape.index_head_dim
        self.wq_b = nn.Linear(shape.q_lora_rank, heads * width, bias=False)
        self.wk = nn.Linear(hidden, width, bias=False)
        self.k_norm = nn.LayerNorm(width, eps=1e-6)
        self.weights_proj = nn.Linear(hidden, heads, bias=False)
        self.heads, self.width, self.top_k = heads, width, shape.index_topk

    def keys(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """``[T, index_head_dim]``: each token's index key, rotated."""
        return apply_rope(self.k_norm(self.wk(x))[:, None], cos, sin)[:, 0]

    def queries(
        self, x: torch.Tensor, q_low: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``[T, heads, index_head_dim]`` rotated index queries and ``[T, heads]`` their
        weights (``heads ** -0.5`` and the keys' ``width ** -0.5`` folded in)."""
        q = apply_rope(self.wq_b(q_low).view(-1, self.heads, self.width), cos, sin)
        weights = self.weights_proj(x).float() * (self.heads**-0.5 * self.width**-0.5)
        return q, weights

    def selected(self, q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        """For one request's last ``len(q)`` positions over its ``len(keys)`` context (more
        keys than the top k: with fewer, each query attends its whole causal context), a
        boolean ``[queries, context]`` of the keys each query attends: causal, and in its
        top k (all of them for a query with no more before it)."""
        num_queries, context = q.shape[0], keys.shape[0]
        scores = torch.relu(torch.einsum("qhd,kd->qhk", q.float(), keys.float()))
        index = torch.einsum("qh,qhk->qk", weights, scores)
        q_pos = torch.arange(context - num_queries, context, device=q.device)[:, None]
        causal = torch.arange(context, device=q.device)[None, :] <= q_pos
        index = index.masked_fill(~causal, float("-inf"))
        best = index.topk(self.top_k, dim=-1).indices
        chosen = torch.zeros_like(causal).scatter_(1, best, True)
        return chosen & causal
