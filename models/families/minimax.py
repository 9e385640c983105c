"""MiniMax (MiniMax-Text-01): lightning attention (``linear_attention``: a decayed linear
attention memory per head, ``blocks/lightning.py``) beside softmax attention with rope
(``full_attention``), by ``layer_types``; experts in every layer (softmax top-k,
renormalised). Each layer keeps its normalised input as the residual, scaled by the
alpha factor of its kind, and its branch by the beta factor (``from_norm``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hybridkv.models.config import ModelConfig
from hybridkv.models.families import Family
from hybridkv.models.families.lfm2 import W123_PARTS
from hybridkv.models.families.llama import llama_fields
from hybridkv.models.hf_config import float_field, int_field
from hybridkv.models.kinds import FULL, LIGHTNING, PolicyChoices, kinds_by
from hybridkv.models.shapes.decoder import DecoderShape
from hybridkv.models.shapes.lightning import lightning_shape
from hybridkv.models.shapes.moe import ExpertsShape


def parse_minimax(
    hf: Mapping[str, Any], *, dtype_bytes: int = 2, policies: PolicyChoices | None = None
) -> ModelConfig:
    """Read a MiniMax config.json."""
    fields = llama_fields(hf, dtype_bytes=dtype_bytes, policies=policies)
    return ModelConfig(
        **fields,
        lightning=lightning_shape(hf),
        residual_scales={
            kind: (
                float_field(hf, f"{name}_alpha_factor", 1.0),
                float_field(hf, f"{name}_beta_factor", 1.0),
            )
            for kind, name in ((LIGHTNING, "linear_attn"), (FULL, "full_attn"), ("mlp", "mlp"))
        },
        experts=ExpertsShape(
            num_experts=int_field(hf, "num_local_experts"),
            top_k=int_field(hf, "num_experts_per_tok", 2),
            inner=fields["intermediate_size"],
        ),
    )


def _pattern(cfg: Mapping[str, Any], num_layers: int) -> list[str]:
    """transformers' default: lightning in every second layer, from the second."""
    return [FULL if (i + 1) % 2 else LIGHTNING for i in range(num_layers)]


FAMILY = Family(
    model_types=("minimax",),
    layer_kinds=kinds_by(_pattern, {"full_attention": FULL, "linear_attention": LIGHTNING}),
    parse=parse_minimax,
    decoder=DecoderShape(residual="from_norm", mlp="experts", mlp_name="block_sparse_moe"),
    part_renames=W123_PARTS,
    state_shape=lightning_shape,
)
