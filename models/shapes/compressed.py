"""DeepSeek V4's attention shape, read from config.json (torch-free;
``hybridkv.models.blocks.compressed_attention`` builds it).

Every layer attends a window of its last ``sliding_window`` tokens, each one vector
(``head_dim``) read as both key and value by every head (one KV head). A compressed layer
attends, beside that window, entries each made from ``rate`` tokens: a softmax-weighted
sum of the tokens' projections per channel (``compressor``), normalised and rotated at
the position of its first token. Compressed sparse attention (CSA, rate 4) makes each
entry from its own ``rate`` tokens and the ``rate`` before them (two series per token,
``overlap``) and lets an indexer over entries of its own pick the ``index_topk`` each
query reads; heavily compressed attention (HCA, rate 128) reads every entry::

    window     tokens (p - W, p]            one vector a token, W = sliding_window
    entries    e < (p + 1) // rate          one vector a rate of tokens (CSA: top k)

The tokens of an entry not yet complete wait as a state: per channel a running maximum,
sum and weighted sum of the softmax (``state_values``), so a prefix hit resumes from it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from hybridkv.models.errors import ModelConfigError
from hybridkv.models.hf_config import int_field
from hybridkv.models.shapes.rope import RopeSpec

#: The layer types of DeepSeek V4 that keep compressed entries beside their window.
CSA = "compressed_sparse_attention"
HCA = "heavily_compressed_attention"
#: The kinds of a compressed layer's two further memories: its entries, and the state of
#: the tokens waiting for theirs.
ENTRIES = "compressed_entries"
COMPRESSOR = "compressor"


@attrs.frozen(kw_only=True)
class CompressedShape:
    """The projections of DeepSeek V4's attention layers (its config's names).

    Attributes:
        head_dim: Each head's width, and the cached vector's (window and entries).
        rope_dim: The rotated channels, the last of each head (adjacent pairs).
        q_lora_rank: The queries' low-rank width (``q_a_proj``, ``q_b_proj``).
        o_groups: Groups of heads, each projected on its own (``o_a_proj``).
        o_lora_rank: Each group's width after ``o_a_proj``.
        window: The tokens of the window, the query's own included.
        rates: Per compressed layer type, the tokens an entry is made from.
        index_heads: The CSA indexer's heads.
        index_head_dim: The CSA indexer's key width (an entry of its own, same tokens).
        index_topk: The entries a CSA query reads, the best its indexer scores.
    """

    head_dim: int
    rope_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    window: int
    rates: Mapping[str, int] = attrs.field(hash=False)
    index_heads: int
    index_head_dim: int
    index_topk: int

    def overlap(self, kind: str) -> bool:
        """Whether an entry of ``kind`` is made from its tokens and the ``rate`` before
        (two series a token, the indexer beside it: CSA)."""
        return kind == CSA

    def entry_width(self, kind: str) -> int:
        """Values one entry of ``kind`` keeps: the attention's, and CSA's indexer's."""
        return self.head_dim + (self.index_head_dim if self.overlap(kind) else 0)

    def state_values(self, kind: str) -> int:
        """float32 values of the state of a layer of ``kind``: per running entry (two
        under overlap) and channel, a running maximum, sum and weighted sum."""
        running = 2 if self.overlap(kind) else 1
        return running * 3 * self.entry_width(kind)


def compressed_shape(cfg: Mapping[str, Any]) -> CompressedShape:
    """The attention of a DeepSeek V4 config.

    Raises:
        ModelConfigError: a bad field, or heads the output groups do not divide.
    """
    head_dim, heads = int_field(cfg, "head_dim"), int_field(cfg, "num_attention_heads")
    groups = int_field(cfg, "o_groups")
    if heads % groups:
        raise ModelConfigError(
            f"num_attention_heads={heads} is not a multiple of o_groups={groups}"
        )
    rates = dict(cfg.get("compress_rates") or {CSA: 4, HCA: 128})
    for kind in (CSA, HCA):
        if not isinstance(rates.get(kind), int) or rates[kind] < 1:
            raise ModelConfigError(f"compress_rates[{kind!r}] must be a positive integer")
    factor = cfg.get("partial_rotary_factor")
    rope_dim = int(head_dim * float(factor)) if factor else 64
    return CompressedShape(
        head_dim=head_dim,
        rope_dim=rope_dim,
        q_lora_rank=int_field(cfg, "q_lora_rank"),
        o_groups=groups,
        o_lora_rank=int_field(cfg, "o_lora_rank"),
        window=int_field(cfg, "sliding_window"),
        rates=rates,
        index_heads=int_field(cfg, "index_n_heads"),
        index_head_dim=int_field(cfg, "index_head_dim"),
        index_topk=int_field(cfg, "index_topk"),
    )


def nested_ropes(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """The config's ``rope_parameters`` as transformers nests them: ``main`` (the sliding
    layers': plain rope at ``rope_theta``) and ``compress`` (the compressed layers': at
    ``compress_rope_theta``, any scaling the config names, YaRN's cos and sin unscaled as
    the reference leaves them)."""
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if "main" in rope and "compress" in rope:
        return {"main": rope["main"], "compress": rope["compress"]}
    scaling = {k: v for k, v in rope.items() if k not in ("main", "compress")}
    compress = {**scaling, "rope_theta": cfg.get("compress_rope_theta", 160_000.0)}
    compress.setdefault("rope_type", "default")
    if compress["rope_type"] == "yarn":
        compress.setdefault("attention_factor", 1.0)
    main = {"rope_type": "default", "rope_theta": cfg.get("rope_theta", 10_000.0)}
    return {"main": main, "compress": compress}


def rope_specs(cfg: Mapping[str, Any]) -> tuple[RopeSpec, RopeSpec]:
    """The ``main`` and ``compress`` rope specs of a normalized config, each over the
    rope's own width (``rope_dim``: the tables are built that wide)."""
    rope, width = nested_ropes(cfg), int(cfg.get("max_position_embeddings") or 1 << 20)
    main, compress = (
        attrs.evolve(
            RopeSpec.from_hf(rope[k], theta=10_000.0, max_positions=width),
            partial_rotary_factor=1.0,
        )
        for k in ("main", "compress")
    )
    return main, compress
