"""Multi-head latent attention (DeepSeek V3, Kimi K2) over a paged cache of latents.

A layer caches one vector a token, ``[c ; k_pe]`` (``models/shapes/latent.py``), in pages
read as both key and value (a K/V axis of stride 0: ``kernels/geometry.py``). A decode's
queries are absorbed into the latent space, ``[W_uk[h]^T q_nope ; q_pe]``, so every head
attends the cached vectors on the paged kernel as one KV head, and ``W_uv[h]`` takes the
attended latent (its first ``kv_lora_rank`` channels) to the head's value space. A
prefill (or a chunk of one) reads its context's latents back and expands them to each
head's keys and values (``kv_b_proj``), attending at the heads' own width (192 against
576 a head in DeepSeek V3), as vLLM does; a policy whose keys are not one window
(``live_spans``) attends absorbed throughout. Where DeepSeek V3.2's indexer
(``sparse_indexer.py``) leaves keys out, a prefill's expanded attention is masked to each
query's choice and a decode reads its chosen latents alone, gathered, absorbed::

    x ─ q_a_proj ─ q_a_layernorm ─ q_b_proj ─ [q_nope | q_pe] ── W_uk^T ─┐
    x ─ kv_a_proj_with_mqa ─ [c ─ kv_a_layernorm | k_pe] ── rope ─ cache ─┤
                                                     paged attention ─────┴─ W_uv ─ o_proj

Under tensor parallelism each rank keeps its heads' rows of ``q_b_proj`` and
``kv_b_proj`` and columns of ``o_proj``; the latent projection and the cache are whole
on every rank.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from hybridkv.kernels import PagedMetadata, paged_attention, write_kv
from hybridkv.kernels.cache_ops import context_keys
from hybridkv.memory.layout import AttentionSpec
from hybridkv.models.blocks.attention import LayerInputs
from hybridkv.models.blocks.norms import config_rms_norm
from hybridkv.models.blocks.rope import apply_rope
from hybridkv.models.blocks.sparse_indexer import SparseIndexer
from hybridkv.models.config import ModelConfig
from hybridkv.models.errors import ModelConfigError
from hybridkv.models.weights.cuts import TensorCut, param, rows_of, summed_columns


class _UpProjection(nn.Linear):
    """``kv_b_proj``: its weight is read as two matrices per head (``W_uk``, ``W_uv``),
    never run as a linear layer, so ``--weights int8/int4`` (which replace plain
    ``nn.Linear`` only) leave it in the model's dtype."""


class LatentAttention(nn.Module):
    """Self-attention whose keys and values come from one cached latent per token."""

    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        spec, shape = config.layers[layer], config.latent
        assert isinstance(spec, AttentionSpec) and spec.latent, f"layer {layer} keeps no latent"
        assert shape is not None, "a latent layer without its shape"
        if spec.head_dim != shape.width:
            raise ModelConfigError(
                f"layer {layer} caches {spec.head_dim} values a token, its latent is {shape.width}"
            )
        self.shape, self.num_heads = shape, config.num_heads
        hidden, bias, heads = config.hidden_size, config.attention_bias, config.num_heads
        q_width = heads * shape.qk_head_dim
        if shape.q_lora_rank:
            self.q_a_proj = nn.Linear(hidden, shape.q_lora_rank, bias=bias)
            self.q_a_layernorm = config_rms_norm(config, shape.q_lora_rank)
            self.q_b_proj = nn.Linear(shape.q_lora_rank, q_width, bias=False)
        else:
            self.q_proj = nn.Linear(hidden, q_width, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, shape.width, bias=bias)
        self.kv_a_layernorm = config_rms_norm(config, shape.kv_lora_rank)
        up = heads * (shape.nope_dim + shape.v_head_dim)
        self.kv_b_proj = _UpProjection(shape.kv_lora_rank, up, bias=False)
        self.o_proj = nn.Linear(heads * shape.v_head_dim, hidden, bias=bias)
        # Ling's: each head's output times the sigmoid of a projection of the input.
        self.g_proj: nn.Module | None = None
        if config.attention_output_gate == "head":
            self.g_proj = nn.Linear(hidden, heads, bias=False)
        # DeepSeek V3.2: an indexer picks the keys each query attends, its own keys kept
        # beside the latent (``spec.beside``).
        self.indexer: SparseIndexer | None = None
        if shape.index_topk:
            if not shape.q_lora_rank:
                raise ModelConfigError("an indexer reads the low-rank query: q_lora_rank is null")
            self.indexer = SparseIndexer(hidden, shape)
        self.scale = config.query_scale
        window = spec.policy.attention_window()
        self.sliding_window = None if window is None else window.size
        self.live_spans = spec.policy.live_spans if window is None else None

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
        """Rope on adjacent channel pairs read as rope on the two halves: the rope rows of
        every query head and of the rope key reordered evens first (their dot products
        unchanged, ``attention._evens_first``)."""
        shape = self.shape
        if shape.rope_interleaved:
            rope = torch.cat(
                (torch.arange(0, shape.rope_dim, 2), torch.arange(1, shape.rope_dim, 2))
            )
            query = "q_b_proj" if shape.q_lora_rank else "q_proj"
            _rope_last(state_dict, f"{prefix}{query}.", shape.nope_dim, rope)
            _rope_last(state_dict, f"{prefix}kv_a_proj_with_mqa.", shape.kv_lora_rank, rope)
        super()._load_from_state_dict(state_dict, prefix, *args)

    def shard(self, cut: TensorCut) -> None:
        """Keep the rank's heads: their rows of the query's last projection, of
        ``kv_b_proj`` and of the output gate, their columns of ``o_proj`` (summed over the
        group)."""
        shape, heads = self.shape, self.num_heads // cut.size
        first = cut.rank * heads

        def rows(width: int) -> slice:
            return slice(first * width, (first + heads) * width)

        query = "q_b_proj" if shape.q_lora_rank else "q_proj"
        self.set_submodule(query, rows_of(getattr(self, query), rows(shape.qk_head_dim)))
        up = self.kv_b_proj.weight.detach()[rows(shape.nope_dim + shape.v_head_dim)]
        self.kv_b_proj.weight = param(up)
        self.kv_b_proj.out_features = up.shape[0]
        self.set_submodule("o_proj", summed_columns(cut, self.o_proj, rows(shape.v_head_dim)))
        if self.g_proj is not None:
            self.g_proj = rows_of(self.g_proj, rows(1))
        self.num_heads = heads

    def _queries(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The heads' queries, and the low-rank ones they come from (None without)."""
        if self.shape.q_lora_rank:
            low: torch.Tensor = self.q_a_layernorm(self.q_a_proj(x))
            return self.q_b_proj(low), low
        direct: torch.Tensor = self.q_proj(x)
        return direct, None

    def forward(self, x: torch.Tensor, inputs: LayerInputs) -> torch.Tensor:
        shape, heads, num_tokens = self.shape, self.num_heads, x.shape[0]
        meta, cache = inputs.metadata, inputs.kv_cache
        assert isinstance(meta, PagedMetadata), "latent attention reads a paged cache"
        q, q_low = self._queries(x)
        q = q.view(num_tokens, heads, -1)
        q_nope, q_pe = torch.split(q, [shape.nope_dim, shape.rope_dim], dim=-1)
        latent = self.kv_a_proj_with_mqa(x)
        c, k_pe = torch.split(latent, [shape.kv_lora_rank, shape.rope_dim], dim=-1)
        # The heads' rope queries and the one rope key rotated in one call (Kimi Linear's
        # latent layers are NoPE: empty tables, the "rope" channels left as they are).
        pe = torch.cat((q_pe, k_pe[:, None]), dim=1)
        if inputs.cos.numel():
            pe = apply_rope(pe, inputs.cos, inputs.sin)
        q_pe = pe[:, :heads]
        cached = torch.cat((self.kv_a_layernorm(c), pe[:, heads]), dim=-1)
        write_kv(cache, cached[:, None], None, meta)
        lens = meta.query_lens
        chosen = self._chosen(x, q_low, inputs)
        # Prefills, and every request whose indexer leaves keys out, attend expanded.
        prefills = [i for i, n in enumerate(lens) if n > 1] if self.live_spans is None else []
        expanded = sorted({*prefills, *chosen})
        if not expanded:
            values = self._absorbed(q_nope, q_pe, cache, meta)
        else:
            values = x.new_empty(num_tokens, heads, shape.v_head_dim)
            absorbed = [i for i in range(len(lens)) if i not in expanded]
            if absorbed:
                alone, tokens = meta.subset(absorbed)
                values[tokens] = self._absorbed(q_nope[tokens], q_pe[tokens], cache, alone)
            firsts = [0, *itertools.accumulate(lens)]
            for i in expanded:
                rows = slice(firsts[i], firsts[i + 1])
                latents = context_keys(cache, meta, i)[:, 0]
                if lens[i] == 1 and i in chosen:  # a decode reads its top k alone
                    picked = latents[chosen[i][0].nonzero()[:, 0]]
                    values[rows] = self._absorbed_over(q_nope[rows], q_pe[rows], picked)
                    continue
                values[rows] = self._expanded(q_nope[rows], q_pe[rows], latents, chosen.get(i))
        if self.g_proj is not None:
            values = values * torch.sigmoid(self.g_proj(x).float()).to(values.dtype)[..., None]
        projected: torch.Tensor = self.o_proj(values.reshape(num_tokens, -1))
        return projected

    def _chosen(
        self, x: torch.Tensor, q_low: torch.Tensor | None, inputs: LayerInputs
    ) -> dict[int, torch.Tensor]:
        """Per request whose indexer leaves keys out (a context longer than its top k),
        the keys each of its queries attends ``[queries, context]``; the step's index keys
        written into their pages first. Empty without an indexer."""
        if self.indexer is None:
            return {}
        beside = inputs.beside
        assert beside is not None and q_low is not None, "an indexer without its keys' cache"
        meta = beside.metadata
        assert isinstance(meta, PagedMetadata), "an indexer's keys are paged"
        write_kv(beside.kv_cache, self.indexer.keys(x, inputs.cos, inputs.sin)[:, None], None, meta)
        q, weights = self.indexer.queries(x, q_low, inputs.cos, inputs.sin)
        firsts = [0, *itertools.accumulate(meta.query_lens)]
        chosen = {}
        for i in range(meta.num_requests):
            if meta.context_lens[i] <= self.indexer.top_k:
                continue
            rows = slice(firsts[i], firsts[i + 1])
            keys = context_keys(beside.kv_cache, meta, i)[:, 0]
            chosen[i] = self.indexer.selected(q[rows], weights[rows], keys)
        return chosen

    def _up(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``W_uk`` ``[heads, nope_dim, kv_lora_rank]`` and ``W_uv`` ``[heads, v_head_dim,
        kv_lora_rank]``: the rows of ``kv_b_proj``."""
        shape = self.shape
        up = self.kv_b_proj.weight.view(self.num_heads, shape.nope_dim + shape.v_head_dim, -1)
        w_uk, w_uv = torch.split(up, [shape.nope_dim, shape.v_head_dim], dim=1)
        return w_uk, w_uv

    def _absorbed(
        self, q_nope: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor, meta: PagedMetadata
    ) -> torch.Tensor:
        """``[tokens, heads, v_head_dim]``: the queries taken into the latent space attend
        the cached latents on the paged kernel (decodes: a latent read once a step for
        every head, where expanding it would read ``kv_b_proj`` over the whole context)."""
        w_uk, w_uv = self._up()
        absorbed = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)
        out = paged_attention(
            torch.cat((absorbed, q_pe), dim=-1),
            cache,
            meta,
            scale=self.scale,
            sliding_window=self.sliding_window,
            live_spans=self.live_spans,
        )
        attended = out[..., : self.shape.kv_lora_rank].transpose(0, 1)
        return torch.bmm(attended, w_uv.transpose(1, 2)).transpose(0, 1)

    def _absorbed_over(
        self, q_nope: torch.Tensor, q_pe: torch.Tensor, latents: torch.Tensor
    ) -> torch.Tensor:
        """``[1, heads, v_head_dim]``: one decode's query, absorbed, against the latents it
        reads ``[keys, width]`` (the indexer's top k, gathered: a step's cost is the top
        k's, not the context's)."""
        w_uk, w_uv = self._up()
        absorbed = torch.einsum("hn,hnl->hl", q_nope[0], w_uk)
        query = torch.cat((absorbed, q_pe[0]), dim=-1)
        weights = torch.softmax((query @ latents.T).float() * self.scale, dim=-1)
        attended = weights.to(latents.dtype) @ latents[:, : self.shape.kv_lora_rank]
        return torch.einsum("hl,hvl->hv", attended, w_uv)[None]

    def _expanded(
        self,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        latents: torch.Tensor,
        chosen: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``[queries, heads, v_head_dim]``: one request's queries (its last positions)
        against its context's latents ``[context, width]`` expanded to every head's keys
        and values (a prompt's attention at the heads' own width), each query reading
        only its ``chosen`` keys where an indexer chose them."""
        shape, heads = self.shape, self.num_heads
        num_queries, context = q_nope.shape[0], latents.shape[0]
        c, k_pe = torch.split(latents, [shape.kv_lora_rank, shape.rope_dim], dim=-1)
        kv = F.linear(c, self.kv_b_proj.weight).view(context, heads, -1)
        k_nope, v = torch.split(kv, [shape.nope_dim, shape.v_head_dim], dim=-1)
        keys = torch.cat((k_nope, k_pe[:, None].expand(-1, heads, -1)), dim=-1)
        query = torch.cat((q_nope, q_pe), dim=-1)
        mask = None
        if num_queries != context or self.sliding_window is not None or chosen is not None:
            q_pos = torch.arange(context - num_queries, context, device=latents.device)[:, None]
            k_pos = torch.arange(context, device=latents.device)[None, :]
            mask = k_pos <= q_pos
            if self.sliding_window is not None:
                mask &= k_pos > q_pos - self.sliding_window
            if chosen is not None:
                mask &= chosen
        out = F.scaled_dot_product_attention(
            query.transpose(0, 1),
            keys.transpose(0, 1),
            v.transpose(0, 1),
            attn_mask=mask,
            is_causal=mask is None,
            scale=self.scale,
        )
        return out.transpose(0, 1)


def _rope_last(state_dict: dict[str, Any], prefix: str, lead: int, rope: torch.Tensor) -> None:
    """Each run of ``lead + len(rope)`` rows of ``prefix``'s weight (and bias): its first
    ``lead`` rows kept, the rest in the order ``rope``."""
    order = torch.cat((torch.arange(lead), lead + rope))
    for kind in ("weight", "bias"):
        key = f"{prefix}{kind}"
        if key in state_dict:
            rows = state_dict[key].unflatten(0, (-1, len(order)))
            state_dict[key] = rows[:, order].flatten(0, 1)
