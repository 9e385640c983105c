"""Multi-head latent attention's shape, read from config.json (torch-free;
``hybridkv.models.blocks.latent_attention`` builds it).

Every head's key and value come from one vector a token keeps: the compressed latent
``c`` (``kv_lora_rank``, normed) beside a rope key ``k_pe`` shared by the heads
(``qk_rope_head_dim``). Head h's key is ``[W_uk[h] c ; k_pe]`` and its value ``W_uv[h] c``
(both ``kv_b_proj``), so a query ``[q_nope ; q_pe]`` scores ``(W_uk[h]^T q_nope) . c +
q_pe . k_pe``: attention over the cached vectors themselves, one KV head of
``kv_lora_rank + qk_rope_head_dim`` whose values are its keys, and the head's output
``W_uv[h]`` times the attended latent (the absorbed form).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from hybridkv.models.hf_config import flag_field, int_field


@attrs.frozen(kw_only=True)
class LatentShape:
    """The projections of a latent attention layer (DeepSeek V3's names).

    Attributes:
        q_lora_rank: The queries' low-rank width (``q_a_proj``, ``q_a_layernorm``,
            ``q_b_proj``); 0: one ``q_proj``.
        kv_lora_rank: The latent's width.
        nope_dim: Each head's key channels without rope (``qk_nope_head_dim``).
        rope_dim: The rope key's width (``qk_rope_head_dim``), shared by the heads.
        v_head_dim: Each head's value width.
        rope_interleaved: Rope rotates adjacent channel pairs (``rope_interleave``).
        index_heads: DeepSeek Sparse Attention's indexer heads (``index_n_heads``: DeepSeek
            V3.2); 0: every query attends its whole context.
        index_head_dim: The indexer's key width, one key a token kept beside the latent.
        index_topk: The keys each query attends, the best its indexer scores.
    """

    q_lora_rank: int
    kv_lora_rank: int
    nope_dim: int
    rope_dim: int
    v_head_dim: int
    rope_interleaved: bool = True
    index_heads: int = 0
    index_head_dim: int = 0
    index_topk: int = 0

    @property
    def width(self) -> int:
        """Values a token keeps per layer: the latent and the rope key."""
        return self.kv_lora_rank + self.rope_dim

    @property
    def qk_head_dim(self) -> int:
        """A query head's width before absorption (its scores' scale is this ** -0.5)."""
        return self.nope_dim + self.rope_dim


def latent_shape(cfg: Mapping[str, Any]) -> LatentShape:
    """The latent attention of a DeepSeek V3 config (``q_lora_rank`` null: no low-rank
    queries), and DeepSeek V3.2's indexer where it names one (``index_n_heads``)."""
    return LatentShape(
        q_lora_rank=int(cfg.get("q_lora_rank") or 0),
        kv_lora_rank=int_field(cfg, "kv_lora_rank"),
        nope_dim=int_field(cfg, "qk_nope_head_dim"),
        rope_dim=int_field(cfg, "qk_rope_head_dim"),
        v_head_dim=int_field(cfg, "v_head_dim"),
        rope_interleaved=flag_field(cfg, "rope_interleave", True),
        index_heads=int(cfg.get("index_n_heads") or 0),
        index_head_dim=int(cfg.get("index_head_dim") or 0),
        index_topk=int(cfg.get("index_topk") or 0),
    )


def latent_width(cfg: Mapping[str, Any]) -> int:
    """Values a latent attention layer keeps a token (``Family.latent_width`` of every
    family with latent attention)."""
    return latent_shape(cfg).width
