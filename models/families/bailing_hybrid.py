"""Ling 3.0 (``bailing_hybrid``): Kimi Delta Attention layers and, every
``layer_group_size``-th layer, DeepSeek V3's latent attention with rope and a sigmoid gate
on each head's output (``g_proj``), under the checkpoint's ``attention`` (its output
projection ``dense``); the delta attention's decay and output gate from one projection each
(``f_proj``, ``g_proj``), the decay bounded (``kda_safe_gate``: ``kda_lower_bound`` times a
sigmoid); DeepSeek V3's experts after the dense first layers. The config names its fields
as Kimi Linear's hub config does (``num_experts``, ...), the delta attention's heads by
the model's (``num_attention_heads`` of ``head_dim``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from hybridkv.models.config import ModelConfig
from hybridkv.models.errors import ModelConfigError
from hybridkv.models.families import Family
from hybridkv.models.families.deepseek_v3 import latent_fields
from hybridkv.models.families.kimi_linear import HUB_NAMES
from hybridkv.models.hf_config import flag_field, float_field, int_field
from hybridkv.models.kinds import DELTANET, FULL, PolicyChoices, kinds_by
from hybridkv.models.shapes.decoder import DecoderShape
from hybridkv.models.shapes.deltanet import DeltaNetShape, kda_shape
from hybridkv.models.shapes.latent import latent_width
from hybridkv.models.shapes.mtp import MtpShape


def parse_bailing_hybrid(
    hf: Mapping[str, Any], *, dtype_bytes: int = 2, policies: PolicyChoices | None = None
) -> ModelConfig:
    """Read a Ling 3.0 config.json (normalized).

    Raises:
        ModelConfigError: experts whose SwiGLU is clipped (a limit other than 0).
    """
    for name in ("expert_swiglu_limit_list", "share_expert_swiglu_limit_list"):
        if any(hf.get(name) or ()):
            raise ModelConfigError(
                f"config field {name!r} clips the experts' SwiGLU, which is not read here "
                "(0 in every layer: no clipping)"
            )
    fields = latent_fields(hf, dtype_bytes=dtype_bytes, policies=policies)
    return ModelConfig(**fields, deltanet=_delta_shape(hf), attention_output_gate="head")


def _delta_shape(cfg: Mapping[str, Any]) -> DeltaNetShape:
    bound = (
        float_field(cfg, "kda_lower_bound", -5.0)
        if flag_field(cfg, "kda_safe_gate", True)
        else None
    )
    return attrs.evolve(kda_shape(cfg), gate_rank=0, decay_bound=bound)


def _pattern(cfg: Mapping[str, Any], num_layers: int) -> list[str]:
    """Every ``layer_group_size``-th layer (6) full attention, the rest delta attention."""
    every = int_field(cfg, "layer_group_size", 6)
    return [FULL if (i + 1) % every == 0 else DELTANET for i in range(num_layers)]


def _normalize(cfg: Mapping[str, Any]) -> Mapping[str, Any]:
    """The hub's names as transformers reads them; the delta attention's heads, width and
    taps from the model's where the config does not name them apart."""
    out = {HUB_NAMES.get(k, k): v for k, v in cfg.items()}
    out.setdefault("linear_num_heads", cfg.get("num_attention_heads"))
    out.setdefault("linear_head_dim", cfg.get("head_dim"))
    out.setdefault("linear_conv_kernel_dim", cfg.get("short_conv_kernel_size", 4))
    return out


FAMILY = Family(
    model_types=("bailing_hybrid",),
    layer_kinds=kinds_by(_pattern, {"full_attention": FULL, "linear_attention": DELTANET}),
    parse=parse_bailing_hybrid,
    decoder=DecoderShape(mlp="experts", mixer_name="self_attn"),
    renames={"model.word_embeddings.weight": "model.embed_tokens.weight"},
    part_renames={".attention.dense.": ".self_attn.o_proj.", ".attention.": ".self_attn."},
    state_shape=_delta_shape,
    latent_width=latent_width,
    normalize=_normalize,
    mtp=MtpShape(layout="after", kind=FULL),  # latent attention and experts
)
