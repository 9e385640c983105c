"""Jamba: one attention layer (without rope) in ``attn_layer_period`` (at
``attn_layer_offset``), Mamba1
in the others (its time step, B and C RMS-normalised), pre-norm (``pre_ff_layernorm``
before the MLP), experts (softmax top-k, not renormalised) in one layer of
``expert_layer_period`` (at ``expert_layer_offset``), a dense MLP in the others."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hybridkv.models.config import ModelConfig
from hybridkv.models.families import Family
from hybridkv.models.families.llama import llama_fields
from hybridkv.models.hf_config import int_field
from hybridkv.models.kinds import FULL, MAMBA1, PolicyChoices
from hybridkv.models.shapes.decoder import DecoderShape
from hybridkv.models.shapes.mamba1 import mamba1_shape
from hybridkv.models.shapes.moe import ExpertsShape


def parse_jamba(
    hf: Mapping[str, Any], *, dtype_bytes: int = 2, policies: PolicyChoices | None = None
) -> ModelConfig:
    """Read a Jamba config.json."""
    fields = llama_fields(hf, dtype_bytes=dtype_bytes, policies=policies)
    num_layers = len(fields["layers"])
    period = int_field(hf, "expert_layer_period", 2)
    offset = int(hf.get("expert_layer_offset", 1))
    experts = int_field(hf, "num_experts", 16)
    return ModelConfig(
        **fields,
        nope_layers=frozenset(range(num_layers)),  # Jamba's attention has no rope
        mamba1=mamba1_shape(hf),
        experts=None
        if experts == 1
        else ExpertsShape(
            num_experts=experts,
            top_k=int_field(hf, "num_experts_per_tok", 2),
            inner=int_field(hf, "intermediate_size"),
            renormalize=False,
            dense_layers=frozenset(i for i in range(num_layers) if i % period != offset),
            stacks="plain",
        ),
    )


def _kinds(cfg: Mapping[str, Any], num_layers: int) -> list[str]:
    period = int_field(cfg, "attn_layer_period", 8)
    offset = int(cfg.get("attn_layer_offset", 4))
    return [FULL if i % period == offset else MAMBA1 for i in range(num_layers)]


FAMILY = Family(
    model_types=("jamba",),
    layer_kinds=_kinds,
    parse=parse_jamba,
    decoder=DecoderShape(mlp_norm="pre_ff_layernorm", mlp_name="feed_forward", mlp="experts"),
    renames={"model.final_layernorm.weight": "model.norm.weight"},
    state_shape=mamba1_shape,
)
