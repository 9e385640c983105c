"""DeepSeek V4's attention over three memories: a window of raw tokens, compressed
entries, and the state of the tokens waiting for their entry (``shapes/compressed.py``).

Every head reads one vector a token (``wkv``, normed, its last ``rope_dim`` channels
rotated by adjacent pairs) as both key and value, in the window's pages (a K/V axis of
stride 0). A compressed layer's compressor (``compressor.py``) completes entries as their
last token runs; each is normed, rotated at the position of its first token and written
to the entries' pages (``AttentionSpec.beside``), where a CSA entry keeps its indexer's
key beside it. A query at p then attends, in one softmax with a sink logit per head, its
window ``(p - W, p]`` and the entries ``e < (p + 1) // rate`` (CSA: those of them its
indexer scores best, ``sum_h w_h relu(q_h . k)``). The heads' outputs are rotated back
(``-p``), projected per group of heads (``wo_a``) and mixed (``wo_b``)::

    x ─ wq_a ─ q_norm ─ wq_b ─ rms ─ rope ─────────────────────┐
    x ─ wkv ─ norm ─ rope ─ window pages ────────────── softmax + sinks ─ rope(-p)
    x ─ compressor ─ state pages ─ entries ─ norm ─ rope ─ entry pages ┘     │
                                                             wo_a (grouped) ─ wo_b

Attention runs per request in plain torch over the window's keys and the request's
entries, gathered: the window is at most ``W + query`` keys, the entries ``context /
rate``.
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F
from torch import nn

from hybridkv.kernels import PagedMetadata, write_kv
from hybridkv.kernels.cache_ops import context_keys
from hybridkv.memory.layout import AttentionSpec
from hybridkv.memory.state_pages import StepStates
from hybridkv.models.blocks.attention import LayerInputs
from hybridkv.models.blocks.compressor import Compressor, Indexer
from hybridkv.models.blocks.norms import config_rms_norm
from hybridkv.models.config import ModelConfig
from hybridkv.models.shapes.compressed import CSA, HCA
from hybridkv.models.weights.cuts import TensorCut, param, rows_of, summed_columns


def rope_pairs(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """``x`` ``[..., width]`` with its last channels rotated by adjacent pairs, from the
    half-split tables ``RotaryTable.cos_sin`` makes (``[T, 1, rope_dim]``)."""
    half = cos.shape[-1] // 2
    c, s = cos[..., :half], signed_sin[..., half:]
    head, tail = x[..., : -2 * half], x[..., -2 * half :].reshape(*x.shape[:-1], half, 2)
    even, odd = tail[..., 0], tail[..., 1]
    turned = torch.stack((even * c - odd * s, odd * c + even * s), dim=-1).flatten(-2)
    return torch.cat((head, turned.to(x.dtype)), dim=-1)


class _GroupedLinear(nn.Linear):
    """``wo_a``: each group of heads projected on its own, one block of rows a group
    (its weight ``[groups * rank, heads * head_dim / groups]``, as the checkpoint's)."""

    def __init__(self, per_group: int, out: int, groups: int) -> None:
        super().__init__(per_group, out, bias=False)
        self.groups = groups

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``[T, groups, per_group]`` -> ``[T, groups * rank]``."""
        w = self.weight.view(self.groups, -1, self.in_features)
        return torch.einsum("tgi,gri->tgr", x, w).flatten(1)


class CompressedAttention(nn.Module):
    """A DeepSeek V4 layer's attention, its parts under the checkpoint's names: ``wq_a``,
    ``q_norm``, ``wq_b`` (queries), ``wkv``, ``norm`` (the window's vector), ``wo_a``,
    ``wo_b`` (output), ``attn_sink``, ``compressor`` and ``indexer``."""

    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        shape, spec = config.compressed, config.layers[layer]
        assert shape is not None and isinstance(spec, AttentionSpec), "not a V4 layer"
        hidden, heads, dim = config.hidden_size, config.num_heads, shape.head_dim
        self.wq_a = nn.Linear(hidden, shape.q_lora_rank, bias=False)
        self.q_norm = config_rms_norm(config, shape.q_lora_rank)
        self.wq_b = nn.Linear(shape.q_lora_rank, heads * dim, bias=False)
        self.wkv = nn.Linear(hidden, dim, bias=False)
        self.norm = config_rms_norm(config, dim)
        per_group = heads * dim // shape.o_groups
        self.wo_a = _GroupedLinear(per_group, shape.o_groups * shape.o_lora_rank, shape.o_groups)
        self.wo_b = nn.Linear(shape.o_groups * shape.o_lora_rank, hidden, bias=False)
        self.attn_sink = nn.Parameter(torch.empty(heads))
        kind = str(spec.kind)
        self.compressor = Compressor(config, kind) if kind in (CSA, HCA) else None
        rate = shape.rates.get(kind, 1)
        self.indexer = Indexer(config, rate) if shape.overlap(kind) else None
        self.shape, self.heads, self.scale = shape, heads, config.query_scale
        self.eps = config.rms_norm_eps

    def shard(self, cut: TensorCut) -> None:
        """Keep the rank's heads (whole groups of them): their rows of ``wq_b``, their
        sinks, their groups' rows of ``wo_a`` and those groups' columns of ``wo_b``
        (summed over the group). The window's vector, the compressor and the indexer are
        every head's: whole on every rank, as are their caches."""
        heads, groups = self.heads // cut.size, self.wo_a.groups // cut.size
        dim, rank = self.shape.head_dim, self.wo_a.out_features // self.wo_a.groups
        first = cut.rank * heads
        self.set_submodule("wq_b", rows_of(self.wq_b, slice(first * dim, (first + heads) * dim)))
        self.attn_sink = param(self.attn_sink.detach()[first : first + heads])
        held = slice(cut.rank * groups * rank, (cut.rank + 1) * groups * rank)
        self.wo_a.weight = param(self.wo_a.weight.detach()[held])
        self.wo_a.out_features, self.wo_a.groups = groups * rank, groups
        self.set_submodule("wo_b", summed_columns(cut, self.wo_b, held))
        self.heads = heads

    def forward(self, x: torch.Tensor, inputs: LayerInputs) -> torch.Tensor:
        shape, num_tokens = self.shape, x.shape[0]
        meta, cos, sin = inputs.metadata, inputs.cos, inputs.sin
        assert isinstance(meta, PagedMetadata), "the window is paged"
        q_low = self.q_norm(self.wq_a(x))
        q = self.wq_b(q_low).view(num_tokens, self.heads, shape.head_dim)
        q = F.rms_norm(q.float(), (shape.head_dim,), eps=self.eps).to(q.dtype)  # per head
        q = rope_pairs(q, cos, sin)
        kv = rope_pairs(self.norm(self.wkv(x))[:, None], cos, sin)
        write_kv(inputs.kv_cache, kv, None, meta)
        entries = self._entries(x, inputs) if self.compressor is not None else None
        picked = self._picked(x, q_low, inputs, entries) if entries is not None else None
        out = x.new_empty(num_tokens, self.heads, shape.head_dim)
        firsts = [0, *itertools.accumulate(meta.query_lens)]
        for i in range(meta.num_requests):
            rows = slice(firsts[i], firsts[i + 1])
            mine = None if entries is None else entries[i]
            chosen = None if picked is None else picked[i]
            out[rows] = self._attend(q[rows], inputs.kv_cache, meta, i, mine, chosen)
        out = rope_pairs(out, cos, -sin)  # each head's output rotated back to its own place
        grouped = self.wo_a(out.reshape(num_tokens, self.wo_a.groups, -1))
        projected: torch.Tensor = self.wo_b(grouped)
        return projected

    def _entries(self, x: torch.Tensor, inputs: LayerInputs) -> list[torch.Tensor]:
        """Per request, its entries ``[entries, width]`` after this step: the entries the
        step's tokens complete written to their pages first."""
        compressor, entry_in, positions = self.compressor, inputs.beside, inputs.positions
        assert compressor is not None and entry_in is not None and positions is not None
        state_in, rotary = entry_in.beside, inputs.rotary
        assert state_in is not None and rotary is not None, "a compressor's state and rope"
        states, meta, cache = state_in.metadata, entry_in.metadata, entry_in.kv_cache
        assert isinstance(states, StepStates) and isinstance(meta, PagedMetadata)
        xs = compressor.inputs(x, positions, self.indexer)
        raw = compressor.mix(xs, state_in.kv_cache, states, compressor.entry_width)
        rate, per_page = compressor.rate, cache.shape[3]
        done = ((positions + 1) % rate == 0).nonzero()[:, 0]
        if done.numel():
            value = raw[done]
            dim = self.shape.head_dim
            parts = [compressor.norm(value[:, :dim].to(x.dtype))]
            if self.indexer is not None:
                parts.append(self.indexer.compressor.norm(value[:, dim:].to(x.dtype)))
            start = positions[done] - (rate - 1)
            e_cos, e_sin = rotary.cos_sin(start, x.dtype)
            entry = torch.cat([rope_pairs(p[:, None], e_cos, e_sin)[:, 0] for p in parts], dim=-1)
            index = (positions[done] + 1) // rate - 1
            cache[:, 0, 0][meta.write_blocks[done], index % per_page] = entry
        out = []
        for i in range(meta.num_requests):
            count = meta.context_lens[i] // rate
            e = torch.arange(count)
            table = meta.block_table[i]
            pages = table[(e * rate + rate - 1) // meta.block_size].to(cache.device)
            out.append(cache[:, 0, 0][pages, (e % per_page).to(cache.device)])
        return out

    def _picked(
        self,
        x: torch.Tensor,
        q_low: torch.Tensor,
        inputs: LayerInputs,
        entries: list[torch.Tensor],
    ) -> list[torch.Tensor] | None:
        """CSA: per request, the entries each of its queries reads ``[queries, entries]``
        (its indexer's top k of those complete at it); None for HCA (every complete one)."""
        indexer = self.indexer
        if indexer is None:
            return None
        meta = inputs.metadata
        assert isinstance(meta, PagedMetadata)
        dim, width = self.shape.head_dim, self.shape.index_head_dim
        q = indexer.wq_b(q_low).view(x.shape[0], indexer.heads, width)
        q = rope_pairs(q, inputs.cos, inputs.sin).float()
        weights = indexer.weights_proj(x).float() * indexer.heads**-0.5
        firsts = [0, *itertools.accumulate(meta.query_lens)]
        picked = []
        for i, mine in enumerate(entries):
            rows = slice(firsts[i], firsts[i + 1])
            keys = mine[:, dim:].float()
            scores = torch.relu(torch.einsum("qhd,kd->qhk", q[rows], keys)) * width**-0.5
            index = torch.einsum("qh,qhk->qk", weights[rows], scores)
            visible = self._visible(meta, i, keys.shape[0], x.device)
            index = index.masked_fill(~visible, float("-inf"))
            best = index.topk(min(indexer.top_k, keys.shape[0]), dim=-1).indices
            chosen = torch.zeros_like(visible).scatter_(1, best, True)
            picked.append(chosen & visible)
        return picked

    def _visible(
        self, meta: PagedMetadata, request: int, count: int, device: torch.device
    ) -> torch.Tensor:
        """``[queries, entries]``: the entries complete at each query of ``request``."""
        assert self.compressor is not None
        context, queries = meta.context_lens[request], meta.query_lens[request]
        q_pos = torch.arange(context - queries, context, device=device)[:, None]
        return torch.arange(count, device=device)[None, :] < (q_pos + 1) // self.compressor.rate

    def _attend(
        self,
        q: torch.Tensor,
        cache: torch.Tensor,
        meta: PagedMetadata,
        request: int,
        entries: torch.Tensor | None,
        chosen: torch.Tensor | None,
    ) -> torch.Tensor:
        """``[queries, heads, head_dim]``: one request's queries over its window and its
        entries, one softmax with the heads' sinks."""
        context, queries = meta.context_lens[request], meta.query_lens[request]
        window = self.shape.window
        first = max(0, context - queries - window + 1)  # the first key any query reads
        keys = context_keys(cache, meta, request, first)[:, 0]  # the window's pages only
        q_pos = torch.arange(context - queries, context, device=q.device)[:, None]
        k_pos = torch.arange(first, context, device=q.device)[None, :]
        mask = (k_pos <= q_pos) & (k_pos > q_pos - window)
        if entries is not None and entries.shape[0]:
            if chosen is None:  # HCA: every entry complete at the query
                chosen = self._visible(meta, request, entries.shape[0], q.device)
            mask = torch.cat((mask, chosen), dim=1)
            keys = torch.cat((keys, entries[:, : self.shape.head_dim]), dim=0)
        logits = torch.einsum("qhd,kd->hqk", q, keys).float() * self.scale
        logits = logits.masked_fill(~mask, float("-inf"))
        sinks = self.attn_sink.float()[:, None, None].expand(-1, queries, 1)
        probs = torch.softmax(torch.cat((logits, sinks), dim=-1), dim=-1)[..., :-1]
        return torch.einsum("hqk,kd->qhd", probs.to(keys.dtype), keys)
