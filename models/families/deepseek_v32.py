"""DeepSeek V3.2: DeepSeek V3's layers (``deepseek_v3.py``) with DeepSeek Sparse Attention,
a lightning indexer in each that picks the ``index_topk`` keys every query attends
(``blocks/sparse_indexer.py``) and keeps a key of its own a token (``index_head_dim``),
a second memory of the layer in pages of its own (``AttentionSpec.beside``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hybridkv.models.config import ModelConfig
from hybridkv.models.families import Family
from hybridkv.models.families.deepseek_v3 import latent_fields
from hybridkv.models.kinds import FULL, PolicyChoices, kinds_by
from hybridkv.models.shapes.decoder import DecoderShape
from hybridkv.models.shapes.latent import latent_shape


def parse_deepseek_v32(
    hf: Mapping[str, Any], *, dtype_bytes: int = 2, policies: PolicyChoices | None = None
) -> ModelConfig:
    """Read a DeepSeek V3.2 config.json."""
    return ModelConfig(**latent_fields(hf, dtype_bytes=dtype_bytes, policies=policies))


def _latent_width(cfg: Mapping[str, Any]) -> int:
    return latent_shape(cfg).width


FAMILY = Family(
    model_types=("deepseek_v32",),
    layer_kinds=kinds_by(lambda cfg, n: [FULL] * n, {"indexed_attention": FULL}),
    parse=parse_deepseek_v32,
    decoder=DecoderShape(mlp="experts"),
    latent_width=_latent_width,
)
