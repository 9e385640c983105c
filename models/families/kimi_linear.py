"""Kimi Linear: Kimi Delta Attention layers (``linear_attention``: Gated DeltaNet whose
memory fades per key channel, ``blocks/deltanet.py``) and, every few layers, DeepSeek V3's
multi-head latent attention without rope (``full_attention``), both under the name
``self_attn``; DeepSeek V3's experts (``block_sparse_moe``: one MLP per expert, ``w1`` the
gate, ``w3`` the up, ``w2`` the down projection) after the dense first layers.

The hub's config names the experts and the linear layers otherwise than transformers
reads them (``num_experts``, ``num_expert_group``, ``linear_attn_config`` with its layers
counted from 1 ...): they are renamed first (``_normalize``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hybridkv.models.config import ModelConfig
from hybridkv.models.errors import ModelConfigError
from hybridkv.models.families import Family
from hybridkv.models.families.deepseek_v3 import latent_fields
from hybridkv.models.kinds import DELTANET, FULL, PolicyChoices, kinds_by
from hybridkv.models.shapes.decoder import DecoderShape
from hybridkv.models.shapes.deltanet import kda_shape
from hybridkv.models.shapes.latent import latent_width

#: The hub's names of DeepSeek V3's fields (transformers' ``attribute_map``; Ling's too).
HUB_NAMES = {
    "num_experts": "n_routed_experts",
    "num_experts_per_token": "num_experts_per_tok",
    "num_expert_group": "n_group",
    "num_shared_experts": "n_shared_experts",
    "moe_renormalize": "norm_topk_prob",
    "model_max_length": "max_position_embeddings",
}
#: ``linear_attn_config``'s fields -> the config's.
_LINEAR = {
    "head_dim": "linear_head_dim",
    "num_heads": "linear_num_heads",
    "short_conv_kernel_size": "linear_conv_kernel_dim",
}


def parse_kimi_linear(
    hf: Mapping[str, Any], *, dtype_bytes: int = 2, policies: PolicyChoices | None = None
) -> ModelConfig:
    """Read a Kimi Linear config.json (normalized)."""
    fields = latent_fields(hf, dtype_bytes=dtype_bytes, policies=policies)
    latent_layers = (i for i, spec in enumerate(fields["layers"]) if spec.kind == FULL)
    return ModelConfig(**fields, deltanet=kda_shape(hf), nope_layers=frozenset(latent_layers))


def _pattern(cfg: Mapping[str, Any], num_layers: int) -> list[str]:
    """Without ``layer_types``: every fourth layer from the fifth full attention."""
    return [FULL if i and i % 4 == 0 else DELTANET for i in range(num_layers)]


def _normalize(cfg: Mapping[str, Any]) -> Mapping[str, Any]:
    """The hub's names as transformers reads them; ``linear_attn_config``'s layer lists
    (counted from 1) as ``layer_types``."""
    out = {HUB_NAMES.get(k, k): v for k, v in cfg.items() if k != "linear_attn_config"}
    linear = cfg.get("linear_attn_config") or {}
    if not isinstance(linear, Mapping):
        raise ModelConfigError("config field 'linear_attn_config' must be a mapping")
    for theirs, ours in _LINEAR.items():
        if theirs in linear:
            out.setdefault(ours, linear[theirs])
    full, kda = linear.get("full_attn_layers"), linear.get("kda_layers")
    if out.get("layer_types") is None and full is not None and kda is not None:
        kinds = {**dict.fromkeys(kda, "linear_attention"), **dict.fromkeys(full, "full_attention")}
        out["layer_types"] = [kinds.get(i + 1) for i in range(len(kinds))]
    return out


FAMILY = Family(
    model_types=("kimi_linear",),
    layer_kinds=kinds_by(_pattern, {"full_attention": FULL, "linear_attention": DELTANET}),
    parse=parse_kimi_linear,
    decoder=DecoderShape(mlp="experts", mlp_name="block_sparse_moe", mixer_name="self_attn"),
    part_renames={".w1.": ".gate_proj.", ".w3.": ".up_proj.", ".w2.": ".down_proj."},
    state_shape=kda_shape,
    latent_width=latent_width,
    normalize=_normalize,
)
