"""Nemotron-H: a block per layer of one mixer each, by ``hybrid_override_pattern`` (or
``layers_block_type``): Mamba2 (``M``), attention without rope (``*``), an MLP of squared
ReLU without a gate (``-``) or experts (``E``, Nemotron 3), which keep nothing per
request. The experts are squared-ReLU MLPs without a gate over a latent width
(``moe_latent_size``), chosen by DeepSeek V3's router (sigmoid scores with a learned bias,
within the best ``topk_group`` of ``n_group`` groups, scaled by
``routed_scaling_factor``), beside a shared expert. Each block is
``out = x + mixer(norm(x))`` (``mlp="none"``, the mixer named ``mixer`` whatever its kind);
the checkpoint's ``backbone.`` names are read as ours, the norms scale in float32."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hybridkv.models.config import ModelConfig
from hybridkv.models.errors import ModelConfigError
from hybridkv.models.families import Family
from hybridkv.models.families.llama import llama_fields
from hybridkv.models.families.mamba import BACKBONE_PARTS, BACKBONE_RENAMES
from hybridkv.models.hf_config import flag_field, int_field, renamed_fields
from hybridkv.models.kinds import FULL, MAMBA, MLP, MOE, PolicyChoices, kinds_by, named_kinds
from hybridkv.models.shapes.decoder import DecoderShape
from hybridkv.models.shapes.mamba2 import mamba2_shape
from hybridkv.models.shapes.moe import ExpertsShape, grouped_sigmoid_router

#: ``hybrid_override_pattern``'s letters and ``layers_block_type``'s names, by kind.
_LETTERS = {"M": MAMBA, "*": FULL, "-": MLP, "E": MOE}
_NAMES = {"mamba": MAMBA, "linear_attention": MAMBA, "attention": FULL, "full_attention": FULL}
_NAMES |= {"mlp": MLP, "moe": MOE}

#: Its config fields by the names ``mamba2_shape`` reads.
_FIELDS = {
    "mamba_num_heads": "mamba_n_heads",
    "mamba_head_dim": "mamba_d_head",
    "ssm_state_size": "mamba_d_state",
    "n_groups": "mamba_n_groups",
    "conv_kernel": "mamba_d_conv",
    "chunk_size": "mamba_chunk_size",
    "use_conv_bias": "mamba_conv_bias",
    "use_bias": "mamba_proj_bias",
    "layer_norm_epsilon": "rms_norm_eps",
    "mlp_hidden_act": "hidden_act",
}


def _normalize(hf: Mapping[str, Any]) -> Mapping[str, Any]:
    cfg = renamed_fields(hf, _FIELDS)
    heads, width = hf.get("mamba_num_heads"), hf.get("mamba_head_dim")
    if isinstance(heads, int) and isinstance(width, int):
        cfg["mamba_intermediate_size"] = heads * width  # not expand x hidden
    if hf.get("layers_block_type") is not None:
        cfg["layer_types"] = hf["layers_block_type"]
        cfg["num_hidden_layers"] = len(hf["layers_block_type"])
    elif isinstance(hf.get("hybrid_override_pattern"), str):
        cfg["num_hidden_layers"] = len(hf["hybrid_override_pattern"])
    return cfg


def parse_nemotron_h(
    hf: Mapping[str, Any], *, dtype_bytes: int = 2, policies: PolicyChoices | None = None
) -> ModelConfig:
    """Read a Nemotron-H config.json (normalized)."""
    fields = llama_fields(hf, dtype_bytes=dtype_bytes, policies=policies)
    layers = fields["layers"]
    has_experts = any(spec.kind == MOE for spec in layers)
    return ModelConfig(
        **fields,
        norm_scale_first=True,
        nope_layers=frozenset(range(len(layers))),
        mamba=mamba2_shape(hf),
        experts=_experts(hf) if has_experts else None,
    )


def _experts(hf: Mapping[str, Any]) -> ExpertsShape:
    if flag_field(hf, "mlp_bias", False):
        raise ModelConfigError(
            "Nemotron-H experts with mlp_bias: the latent projections' biases are not read "
            "here (no released Nemotron 3 has them)"
        )
    return ExpertsShape(
        **grouped_sigmoid_router(hf),
        activation="relu2",
        shared_inner=int_field(hf, "moe_shared_expert_intermediate_size", 0),
        latent=int(hf.get("moe_latent_size") or 0),
        stacks="plain",
    )


def _pattern(cfg: Mapping[str, Any], num_layers: int) -> list[str]:
    pattern = cfg.get("hybrid_override_pattern")
    if not isinstance(pattern, str):
        raise ModelConfigError("a Nemotron-H config needs hybrid_override_pattern")
    unknown = sorted(set(pattern) - set(_LETTERS))
    if unknown:
        raise ModelConfigError(f"hybrid_override_pattern has letters {unknown}; known: M * - E")
    return named_kinds(list(pattern), num_layers, _LETTERS)


FAMILY = Family(
    model_types=("nemotron_h",),
    layer_kinds=kinds_by(_pattern, _NAMES),
    parse=parse_nemotron_h,
    decoder=DecoderShape(mixer_norm="norm", mlp_norm=None, mlp="none", mixer_name="mixer"),
    renames=BACKBONE_RENAMES,
    part_renames=BACKBONE_PARTS,
    state_shape=mamba2_shape,
    normalize=_normalize,
)
