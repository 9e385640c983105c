"""Llama: pre-norm layers, a SiLU MLP, full attention in every layer, one rope table.

Its fields are what the Llama-shaped families read alike (``llama_fields``): Mistral,
Qwen2, Qwen3, SmolLM3, Seed-OSS, OLMo 3 and EXAONE 4 change a field or a few of them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hybridkv.memory.layout import AttentionSpec, LayerSpec
from hybridkv.models.config import ModelConfig, activation_of
from hybridkv.models.errors import ModelConfigError
from hybridkv.models.families import Family
from hybridkv.models.families.common import common_fields
from hybridkv.models.hf_config import flag_field
from hybridkv.models.kinds import CHUNKED, FULL, SLIDING, PolicyChoices, kinds_by
from hybridkv.models.shapes.rope import rope_by_kind


def llama_fields(
    hf: Mapping[str, Any], *, dtype_bytes: int, policies: PolicyChoices | None
) -> dict[str, Any]:
    """Plain RMSNorm weights, ``head_dim ** -0.5`` scaling, rope per attention kind (one
    table for all unless the config nests them by kind), no soft-caps (``dtype_bytes``
    and ``policies`` shape the layer specs: ``common_fields``)."""
    fields = common_fields(hf, dtype_bytes=dtype_bytes, policies=policies)
    return {
        **fields,
        "norm_offset": 0.0,
        "activation": activation_of(str(hf.get("hidden_act", "silu"))),
        "qk_norm": False,
        "embed_scale": None,
        "query_scale": _first_attention(fields["layers"]).head_dim ** -0.5,
        "attn_softcap": None,
        "final_softcap": None,
        "rope": rope_by_kind(hf, (FULL, SLIDING, CHUNKED), default_theta=10_000.0),
        "mlp_bias": flag_field(hf, "mlp_bias", False),
    }


def parse_llama(
    hf: Mapping[str, Any], *, dtype_bytes: int = 2, policies: PolicyChoices | None = None
) -> ModelConfig:
    """Read a Llama config.json."""
    return ModelConfig(**llama_fields(hf, dtype_bytes=dtype_bytes, policies=policies))


FAMILY = Family(
    model_types=("llama",),
    layer_kinds=kinds_by(lambda cfg, n: [FULL] * n),
    parse=parse_llama,
)


def _first_attention(layers: list[LayerSpec]) -> AttentionSpec:
    """The first attention layer's spec (state layers come first in some hybrids)."""
    found = next((s for s in layers if isinstance(s, AttentionSpec)), None)
    if found is None:
        raise ModelConfigError("the config names no attention layer")
    return found
