"""AFMoE (Arcee's Trinity): sandwich norms, q/k norms per head, an output gate on
attention, rope only in the sliding layers (every ``global_attn_every_n_layers``-th is
full and without rope), a dense MLP in the first ``num_dense_layers`` and experts after
(sigmoid scores, chosen with a learned per-expert bias, renormalised and scaled by
``route_scale``) beside shared experts; embeddings scaled by ``sqrt(hidden_size)`` where
``mup_enabled``."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import attrs

from hybridkv.models.config import ModelConfig
from hybridkv.models.families import Family
from hybridkv.models.families.llama import llama_fields
from hybridkv.models.hf_config import flag_field, float_field, int_field
from hybridkv.models.kinds import FULL, PolicyChoices, kinds_by, pattern_layer_types
from hybridkv.models.shapes.decoder import SANDWICH
from hybridkv.models.shapes.moe import ExpertsShape


def parse_afmoe(
    hf: Mapping[str, Any], *, dtype_bytes: int = 2, policies: PolicyChoices | None = None
) -> ModelConfig:
    """Read an AFMoE config.json."""
    fields = llama_fields(hf, dtype_bytes=dtype_bytes, policies=policies)
    kinds = [spec.kind for spec in fields["layers"]]
    inner = int_field(hf, "moe_intermediate_size")
    mup = flag_field(hf, "mup_enabled", False)
    return ModelConfig(
        **{
            **fields,
            "qk_norm": True,
            "embed_scale": math.sqrt(fields["hidden_size"]) if mup else None,
            "rms_norm_eps": float_field(hf, "rms_norm_eps", 1e-5),
        },
        nope_layers=frozenset(i for i, kind in enumerate(kinds) if kind == FULL),
        attention_output_gate="channel",
        experts=ExpertsShape(
            num_experts=int_field(hf, "num_experts"),
            top_k=int_field(hf, "num_experts_per_tok"),
            inner=inner,
            dense_layers=frozenset(range(int_field(hf, "num_dense_layers", 1))),
            router="sigmoid",
            selection_bias=True,
            route_scale=float_field(hf, "route_scale", 1.0),
            shared_inner=inner * int_field(hf, "num_shared_experts", 0),
        ),
    )


FAMILY = Family(
    model_types=("afmoe",),
    layer_kinds=kinds_by(
        lambda cfg, n: list(pattern_layer_types(n, int_field(cfg, "global_attn_every_n_layers", 4)))
    ),
    parse=parse_afmoe,
    decoder=attrs.evolve(
        SANDWICH,
        mlp="experts",
        mlp_norm="pre_mlp_layernorm",
        post_mlp_norm="post_mlp_layernorm",
    ),
)
