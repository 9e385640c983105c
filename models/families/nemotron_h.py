"""Nemotron-H: a block per layer of one mixer each, by ``hybrid_override_pattern`` (or
``layers_block_type``): Mamba2 (``M``), attention without rope (``*``), or an MLP of
squared ReLU without a gate (``-``), which keeps nothing per request. Each block is
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
from hybridkv.models.hf_config import renamed_fields
from hybridkv.models.kinds import FULL, MAMBA, MLP, PolicyChoices, kinds_by, named_kinds
from hybridkv.models.shapes.decoder import DecoderShape
from hybridkv.models.shapes.mamba2 import mamba2_shape

#: ``hybrid_override_pattern``'s letters and ``layers_block_type``'s names, by kind.
_LETTERS = {"M": MAMBA, "*": FULL, "-": MLP, "E": "moe"}
_NAMES = {"mamba": MAMBA, "linear_attention": MAMBA, "attention": FULL, "full_attention": FULL}
_NAMES |= {"mlp": MLP, "moe": "moe"}

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
    """Read a Nemotron-H config.json (normalized; its MoE layers refused, by name)."""
    fields = llama_fields(hf, dtype_bytes=dtype_bytes, policies=policies)
    return ModelConfig(
        **fields,
        norm_scale_first=True,
        nope_layers=frozenset(range(len(fields["layers"]))),
        mamba=mamba2_shape(hf),
    )


def _pattern(cfg: Mapping[str, Any], num_layers: int) -> list[str]:
    pattern = cfg.get("hybrid_override_pattern")
    if not isinstance(pattern, str):
        raise ModelConfigError("a Nemotron-H config needs hybrid_override_pattern")
    unknown = sorted(set(pattern) - set(_LETTERS))
    if unknown:
        raise ModelConfigError(f"hybrid_override_pattern has letters {unknown}; known: M * - E")
    return _checked(named_kinds(list(pattern), num_layers, _LETTERS))


def _kinds(cfg: Mapping[str, Any], num_layers: int) -> list[str]:
    return _checked(kinds_by(_pattern, _NAMES)(cfg, num_layers))


def _checked(kinds: list[str]) -> list[str]:
    if "moe" in kinds:
        raise ModelConfigError(
            "Nemotron-H's MoE layers (E, moe: Nemotron 3) do not run here yet; the dense "
            "Nemotron-H models (M, * and - layers) do"
        )
    return kinds


FAMILY = Family(
    model_types=("nemotron_h",),
    layer_kinds=_kinds,
    parse=parse_nemotron_h,
    decoder=DecoderShape(mixer_norm="norm", mlp_norm=None, mlp="none", mixer_name="mixer"),
    renames=BACKBONE_RENAMES,
    part_renames=BACKBONE_PARTS,
    state_shape=mamba2_shape,
    normalize=_normalize,
)
