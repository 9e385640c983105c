"""MiMo-V2-Flash: sliding layers (window 128 plus the query) with twice the KV heads of
the full ones and a learned sink per head, the first and every sixth layer full; keys of
``head_dim`` (192) and values of ``v_head_dim`` (128, cached at the keys' width, scaled by
``attention_value_scale``), rope on a third of each head with a base per kind; a dense MLP
in the first layer (``mlp_layer_types``), experts after (DeepSeek V3's router: sigmoid
scores chosen with a learned bias within the best groups, renormalised, scaled)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hybridkv.models.config import ModelConfig
from hybridkv.models.errors import ModelConfigError
from hybridkv.models.families import Family
from hybridkv.models.families.llama import llama_fields
from hybridkv.models.hf_config import float_field, int_field
from hybridkv.models.kinds import FULL, SLIDING, PolicyChoices, kinds_by
from hybridkv.models.shapes.decoder import DecoderShape
from hybridkv.models.shapes.moe import ExpertsShape, grouped_sigmoid_router
from hybridkv.models.shapes.mtp import MtpShape

#: The rope of a config that names none (transformers' default: the released model's).
_ROPE = {
    FULL: {"rope_type": "default", "rope_theta": 5_000_000.0, "partial_rotary_factor": 0.334},
    SLIDING: {"rope_type": "default", "rope_theta": 10_000.0, "partial_rotary_factor": 0.334},
}


def parse_mimo_v2_flash(
    hf: Mapping[str, Any], *, dtype_bytes: int = 2, policies: PolicyChoices | None = None
) -> ModelConfig:
    """Read a MiMo-V2-Flash config.json."""
    if not hf.get("rope_parameters"):
        hf = {**hf, "rope_parameters": _ROPE}
    fields = llama_fields(hf, dtype_bytes=dtype_bytes, policies=policies)
    num_layers = len(fields["layers"])
    dense = _mlp_kinds(hf, num_layers)
    return ModelConfig(
        **{**fields, "rms_norm_eps": float_field(hf, "rms_norm_eps", 1e-5)},
        attention_out_bias=False,
        attention_sinks=frozenset({SLIDING}),
        v_head_dim=int_field(hf, "v_head_dim"),
        value_scale=float(hf.get("attention_value_scale") or 1.0),
        experts=ExpertsShape(
            **grouped_sigmoid_router(hf),
            dense_layers=frozenset(i for i, kind in enumerate(dense) if kind == "dense"),
        ),
    )


def _mlp_kinds(cfg: Mapping[str, Any], num_layers: int) -> list[str]:
    """``mlp_layer_types`` (``dense`` or ``sparse``), by default the first layer dense."""
    kinds = cfg.get("mlp_layer_types") or ["dense"] + ["sparse"] * (num_layers - 1)
    if len(kinds) != num_layers or set(kinds) - {"dense", "sparse"}:
        raise ModelConfigError(
            f"config field 'mlp_layer_types' must hold {num_layers} of dense or sparse"
        )
    return list(kinds)


def _kinds(cfg: Mapping[str, Any], num_layers: int) -> list[str]:
    """Without ``layer_types``: the first and every sixth layer full, the rest sliding."""
    return [FULL if i == 0 or (i + 1) % 6 == 0 else SLIDING for i in range(num_layers)]


def _kv_shape(cfg: Mapping[str, Any], kind: str) -> tuple[int, int]:
    """The sliding layers have twice the full layers' ``num_key_value_heads``."""
    heads = int_field(cfg, "num_key_value_heads")
    return (2 * heads if kind == SLIDING else heads), int_field(cfg, "head_dim")


def _normalize(cfg: Mapping[str, Any]) -> Mapping[str, Any]:
    """The hub's ``sliding_window_size`` (previous tokens) as ``sliding_window`` (those and
    the query), as transformers reads it."""
    if cfg.get("sliding_window_size") is None:
        return cfg
    rest = {k: v for k, v in cfg.items() if k != "sliding_window_size"}
    return {**rest, "sliding_window": int_field(cfg, "sliding_window_size") + 1}


FAMILY = Family(
    model_types=("mimo_v2_flash",),
    layer_kinds=kinds_by(_kinds),
    parse=parse_mimo_v2_flash,
    decoder=DecoderShape(mlp="experts"),
    kv_shape=_kv_shape,
    normalize=_normalize,
    # One MTP layer: sliding attention and a dense MLP (its config does not count it).
    mtp=MtpShape(
        layout="nested",
        count_fields=(),
        default_count=1,
        kind=SLIDING,
        dense=True,
        block_renames={"pre_mlp_layernorm.": "post_attention_layernorm."},
    ),
)
