"""Paged self-attention, and what a layer reads besides its hidden states (LayerInputs).

Module and parameter names follow Hugging Face checkpoints (``q_proj``, ``o_proj``, ...),
so a safetensors file loads with ``load_state_dict`` and no renaming table. Every block
works on a flat batch of tokens, ``[num_tokens, ...]``, from many requests.
"""

from __future__ import annotations

from typing import Any, Protocol

import attrs
import torch
import torch.nn.functional as F
from torch import nn

from hybridkv.kernels import PagedMetadata, paged_attention, write_kv
from hybridkv.memory.layout import AttentionSpec
from hybridkv.memory.state_pages import StepStates
from hybridkv.models.blocks.norms import config_rms_norm, rms_norm
from hybridkv.models.blocks.rope import RotaryTable, apply_rope
from hybridkv.models.config import ModelConfig
from hybridkv.models.weights.cuts import TensorCut, held_run, param, rows_of, summed_columns
from hybridkv.models.weights.fused_linear import cat_linears, split_joined


class ShardedAttention(Protocol):
    """Attention whose keys are spread over ranks (``parallel/context_attention.py``): it
    stores the new K/V its rank keeps and attends the queries to every rank's keys."""

    def attend(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        *,
        scale: float,
        sliding_window: int | None,
        softcap: float | None,
    ) -> torch.Tensor: ...


@attrs.frozen
class LayerInputs:
    """What one attention layer reads besides the hidden states, for one step.

    Attributes:
        cos: Rotary cosines for the layer's rope spec, ``[num_tokens, 1, head_dim]``.
        sin: Rotary sines, same shape, those of each head's first half negated (the
            tables ``RotaryTable.cos_sin`` makes for ``apply_rope``).
        kv_cache: The layer's pages, ``[num_blocks, 2, num_kv_heads, block_size, head_dim]``
            (a state layer's: ``[num_blocks, state_values]`` float32).
        metadata: Slot mapping and block tables of the layer's KV group, or, under context
            parallelism, the step's sharded attention of that group; for a state layer,
            the state pages each request reads and writes.
        query_scale: ``[num_tokens, 1, 1]``: each token's query multiplier (the model's
            ``query_temperature``), or None.
        per_layer: ``[num_tokens, width]``: each token's input to this layer (Gemma 4's
            per-layer inputs), or None.
        embeddings: ``[num_tokens, hidden]``: the tokens' embeddings, where the layer
            reads them beside the hidden states (Zamba2's shared blocks), or None.
        beside: The cache and metadata of the memory beside the attention's (Falcon-H1's
            Mamba2, ``AttentionSpec.beside``), as its reader reads them (with the one
            beside it in turn), or None.
        rotary: The rope table of the layer's kind, for positions other than the
            tokens' own (DeepSeek V4's compressed entries), or None.
        positions: ``[num_tokens]``: each token's position in its request, or None.
        token_ids: ``[num_tokens]``: the tokens, where the layers may read them (DeepSeek
            V4's experts chosen by token id), or None.
    """

    cos: torch.Tensor
    sin: torch.Tensor
    kv_cache: torch.Tensor
    metadata: PagedMetadata | ShardedAttention | StepStates | None
    query_scale: torch.Tensor | None = None
    per_layer: torch.Tensor | None = None
    beside: LayerInputs | None = None
    embeddings: torch.Tensor | None = None
    rotary: RotaryTable | None = None
    positions: torch.Tensor | None = None
    token_ids: torch.Tensor | None = None


class PagedAttention(nn.Module):
    """Self-attention whose keys and values live in a paged KV cache.

    Writes the new tokens' K/V into their slots first, then attends over the pages of each
    request (its block table), so prefills, chunks and decodes mix in one call.

    A query at position p attends exactly the keys its layer's memory policy keeps live,
    ``live_spans(p)`` and p itself. A policy whose keys form one window ending at the query
    (full attention, sliding windows) takes the kernel's window fast path; any other policy
    hands the kernel its ``live_spans`` to build the mask from.
    """

    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        spec = config.layers[layer]
        assert isinstance(spec, AttentionSpec), f"layer {layer} is not an attention layer"
        bias = config.attention_bias
        q_width = config.num_heads * spec.head_dim
        kv_width = spec.num_kv_heads * spec.head_dim
        # Values may be narrower than keys (MiMo-V2-Flash); they are cached zero-padded.
        self.v_head_dim = config.v_head_dim or spec.head_dim
        v_width = spec.num_kv_heads * self.v_head_dim
        out_width = config.num_heads * self.v_head_dim
        # A layer reading another's cache (Gemma 4's KV-shared layers) computes queries
        # only; one whose values are its keys (``values_from_keys``) has no v_proj.
        self.reads_cache = spec.reads is not None
        self.values_from_keys = spec.kind in config.values_from_keys
        width = config.attention_input_width or config.hidden_size
        self.q_proj = nn.Linear(width, q_width, bias=bias)
        if not self.reads_cache:
            self.k_proj = nn.Linear(width, kv_width, bias=bias)
            if not self.values_from_keys:
                self.v_proj = nn.Linear(width, v_width, bias=bias)
        self.o_proj = nn.Linear(out_width, config.hidden_size, bias=config.attention_out_bias)
        self.gate_proj: nn.Module | None = None
        self.gate_per_head = config.attention_output_gate == "head"
        if config.attention_output_gate != "none":
            gates = config.num_heads if self.gate_per_head else out_width
            self.gate_proj = nn.Linear(config.hidden_size, gates, bias=False)
        self.qkv_proj: nn.Module | None = None
        # The joined projection's output: q and k heads side by side, then v.
        self._qk_v_widths = (q_width + kv_width, 0 if self.values_from_keys else v_width)
        self.value_scale = config.value_scale
        self.value_norm_eps = config.rms_norm_eps if config.value_norm else None
        # Over each head (one weight of head_dim) or over the whole projection (OLMo).
        self.rope_interleaved = config.rope_interleaved
        self.qk_norm = config.qk_norm
        self.per_head_norm = config.qk_norm_width == "head"
        if config.qk_norm:
            self.q_norm = config_rms_norm(config, spec.head_dim if self.per_head_norm else q_width)
            if not self.reads_cache:
                width = spec.head_dim if self.per_head_norm else kv_width
                self.k_norm = config_rms_norm(config, width)
        self._qk_scales: tuple[torch.Tensor, torch.Tensor | None, torch.Tensor] | None = None
        self.rope_l2_eps = config.rms_norm_eps if config.rope_qk_l2_norm else None
        self.num_heads = config.num_heads
        self.num_kv_heads = spec.num_kv_heads
        # The key heads this layer computes (none where it reads another's cache).
        self._new_kv_heads = 0 if self.reads_cache else spec.num_kv_heads
        self.head_dim = spec.head_dim
        self.scale = config.query_scale
        self.softcap = config.attn_softcap
        # gpt-oss: a learned logit per head joining each softmax (``kernels/attention.py``).
        self.sinks: nn.Parameter | None = None
        if spec.kind in config.attention_sinks:
            self.sinks = nn.Parameter(torch.empty(config.num_heads))
        window = spec.policy.attention_window()
        self.sliding_window = None if window is None else window.size
        self.live_spans = spec.policy.live_spans if window is None else None

    def _qk_scale(self) -> torch.Tensor:
        """``[num_heads + new KV heads, head_dim]``: the q norm's scale for each query
        head, then the k norm's for each key head it computes (kept while the two are
        unchanged)."""
        q_scale = self.q_norm.scale()
        k_scale = None if self.reads_cache else self.k_norm.scale()
        kept = self._qk_scales
        if kept is None or kept[0] is not q_scale or kept[1] is not k_scale:
            parts = [q_scale.detach().expand(self.num_heads, -1)]
            if k_scale is not None:
                parts.append(k_scale.detach().expand(self._new_kv_heads, -1))
            kept = (q_scale, k_scale, torch.cat(parts))
            self._qk_scales = kept
        return kept[2]

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
        """A checkpoint's joined ``qkv_proj`` (Phi-3) read as q, k and v, a ``q_proj`` that
        holds the output gate too (Qwen3-Next) as q and ``gate_proj``; interleaved rope
        (Cohere) read as the half-split one."""
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        parts = [("q_proj", q), ("k_proj", kv), ("v_proj", self.num_kv_heads * self.v_head_dim)]
        split_joined(state_dict, prefix, "qkv_proj", parts)
        joined = state_dict.get(f"{prefix}q_proj.weight")
        if self.gate_proj is not None and joined is not None and joined.shape[0] == 2 * q:
            # Qwen3-Next's q_proj: each head's query rows, then its gate's.
            heads = joined.view(self.num_heads, 2, self.head_dim, -1)
            state_dict[f"{prefix}q_proj.weight"] = heads[:, 0].reshape(q, -1)
            state_dict[f"{prefix}gate_proj.weight"] = heads[:, 1].reshape(q, -1)
        if f"{prefix}attention_sink_bias" in state_dict:  # MiMo-V2-Flash's name of the sinks
            state_dict[f"{prefix}sinks"] = state_dict.pop(f"{prefix}attention_sink_bias")
        if self.rope_interleaved:
            _evens_first(state_dict, prefix, self.head_dim)
        super()._load_from_state_dict(state_dict, prefix, *args)

    def shard(self, cut: TensorCut) -> None:
        """Keep the rank's query heads (their rows of ``q_proj``, of the output gate and
        their sinks), its KV heads (an even run, or, with fewer than ranks, the one its
        query heads read), and its columns of ``o_proj``, summed over the group."""
        dim, v_dim, num_heads = self.head_dim, self.v_head_dim, self.num_heads // cut.size
        first_kv, num_kv = held_run(self.num_kv_heads, cut.size, cut.rank)
        q = slice(cut.rank * num_heads * dim, (cut.rank + 1) * num_heads * dim)
        out = slice(cut.rank * num_heads * v_dim, (cut.rank + 1) * num_heads * v_dim)
        kv = slice(first_kv * dim, (first_kv + num_kv) * dim)
        self.set_submodule("q_proj", rows_of(self.q_proj, q))
        if not self.reads_cache:
            self.set_submodule("k_proj", rows_of(self.k_proj, kv))
        if not (self.reads_cache or self.values_from_keys):
            v = slice(first_kv * v_dim, (first_kv + num_kv) * v_dim)
            self.set_submodule("v_proj", rows_of(self.v_proj, v))
        self.set_submodule("o_proj", summed_columns(cut, self.o_proj, out))
        if self.gate_proj is not None:  # one gate per output channel, or per head
            heads = slice(cut.rank * num_heads, (cut.rank + 1) * num_heads)
            self.gate_proj = rows_of(self.gate_proj, heads if self.gate_per_head else out)
        if self.sinks is not None:
            self.sinks = param(
                self.sinks.detach()[cut.rank * num_heads : (cut.rank + 1) * num_heads]
            )
        self.num_heads, self.num_kv_heads = num_heads, num_kv
        self._new_kv_heads = 0 if self.reads_cache else num_kv
        v_width = 0 if self.values_from_keys else num_kv * v_dim
        self._qk_v_widths = ((num_heads + self._new_kv_heads) * dim, v_width)

    def fuse(self) -> bool:
        """Join q, k and v (those the layer has) into one product
        (``models/weights/fused_linear.py``); False where their storage differs and they
        stay apart, or where there are only queries."""
        if self.reads_cache:
            return False
        names = ["q_proj", "k_proj"] + ([] if self.values_from_keys else ["v_proj"])
        joined = cat_linears([getattr(self, name) for name in names])
        if joined is None:
            return False
        for name in names:
            delattr(self, name)
        self.qkv_proj = joined
        return True

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``x``'s queries and the keys it computes side by side, and its values (None
        where the layer computes none), before any norm or rope."""
        if self.qkv_proj is not None:
            qk, v = self.qkv_proj(x).split(self._qk_v_widths, dim=-1)
            return qk, v
        if self.reads_cache:
            return self.q_proj(x), None
        qk = torch.cat((self.q_proj(x), self.k_proj(x)), dim=-1)
        return qk, None if self.values_from_keys else self.v_proj(x)

    def forward(self, x: torch.Tensor, inputs: LayerInputs) -> torch.Tensor:
        num_tokens, heads, q_width = x.shape[0], self.num_heads, self.num_heads * self.head_dim
        qk, v = self.project(x)
        if self.values_from_keys:  # the key projection's output, before its norm and rope
            v = qk[:, q_width:]
        if self.qk_norm and not self.per_head_norm:
            q, k = torch.split(qk, [q_width, qk.shape[-1] - q_width], dim=-1)
            qk = torch.cat((self.q_norm(q), self.k_norm(k)), dim=-1)
        # q and k heads side by side: one norm and one rotation for both (apart they were
        # some 20 ops a layer, a decode step's ops: benchmarks/decode/bandwidth.py).
        qk = qk.view(num_tokens, heads + self._new_kv_heads, self.head_dim)
        if self.qk_norm and self.per_head_norm:
            qk = rms_norm(
                qk, self._qk_scale(), self.q_norm.eps, scale_first=self.q_norm.scale_first
            )
        if inputs.cos.numel():  # NoPE layers get empty tables
            qk = apply_rope(qk, inputs.cos, inputs.sin)
            if self.rope_l2_eps is not None:
                normed = F.rms_norm(qk.float(), (self.head_dim,), eps=self.rope_l2_eps)
                qk = normed.to(qk.dtype)
        q, k = torch.split(qk, [heads, self._new_kv_heads], dim=1)
        if inputs.query_scale is not None:
            q = q * inputs.query_scale.to(q.dtype)
        meta = inputs.metadata
        if v is not None:
            v = self._values(v.reshape(num_tokens, self._new_kv_heads, self.v_head_dim))
        if not isinstance(meta, PagedMetadata):
            assert meta is not None, "an attention layer without a cache"
            assert not isinstance(meta, StepStates), "an attention layer in a state group"
            assert v is not None, "context parallelism refuses layers reading another's cache"
            # Context parallelism refuses policies without one window (live_spans).
            out = meta.attend(
                q, k, v, inputs.kv_cache, scale=self.scale,
                sliding_window=self.sliding_window, softcap=self.softcap,
            )  # fmt: skip
            return self._project(out, x)
        if v is not None:  # a layer reading another's cache finds this step's K/V there
            write_kv(inputs.kv_cache, k, v, meta)
        out = paged_attention(
            q,
            inputs.kv_cache,
            meta,
            scale=self.scale,
            sliding_window=self.sliding_window,
            live_spans=self.live_spans,
            softcap=self.softcap,
            sinks=self.sinks,
        )
        return self._project(out, x)

    def _values(self, v: torch.Tensor) -> torch.Tensor:
        """``[num_tokens, kv_heads, v_head_dim]`` values as the cache keeps them: normed,
        scaled, and padded to the key's width where the model says so."""
        if self.value_norm_eps is not None:
            v = F.rms_norm(v.float(), (v.shape[-1],), eps=self.value_norm_eps).to(v.dtype)
        if self.value_scale != 1.0:
            v = v * self.value_scale
        if self.v_head_dim < self.head_dim:  # cached at the key's width
            v = F.pad(v, (0, self.head_dim - self.v_head_dim))
        return v

    def _project(self, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """The heads' outputs ``[num_tokens, heads, head_dim]`` through the output gate
        (where the layer has one) and ``o_proj``."""
        out = out[..., : self.v_head_dim]
        if self.gate_proj is not None and self.gate_per_head:
            out = out * torch.sigmoid(self.gate_proj(x)).unsqueeze(-1)
        out = out.reshape(out.shape[0], self.num_heads * self.v_head_dim)
        if self.gate_proj is not None and not self.gate_per_head:
            out = out * torch.sigmoid(self.gate_proj(x))
        projected: torch.Tensor = self.o_proj(out)
        return projected


def _evens_first(state_dict: dict[str, Any], prefix: str, head_dim: int) -> None:
    """Rope on adjacent channel pairs (0, 1), (2, 3) ... is rope on the two halves of a
    head whose channels come evens first: q and k rows reordered alike (weights and
    biases) leave every q.k unchanged, and the half-split rope applies."""
    order = torch.cat((torch.arange(0, head_dim, 2), torch.arange(1, head_dim, 2)))
    for name in ("q_proj", "k_proj"):
        for kind in ("weight", "bias"):
            key = f"{prefix}{name}.{kind}"
            if key in state_dict:
                rows = state_dict[key].unflatten(0, (-1, head_dim))
                state_dict[key] = rows[:, order].flatten(0, 1)
