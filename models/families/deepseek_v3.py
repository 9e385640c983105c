"""DeepSeek V3 and Kimi K2, sized by ``hybridkv plan`` (they do not run here yet): every
layer is multi-head latent attention, which keeps one vector per token and layer, the
compressed latent (``kv_lora_rank``) beside the rope key (``qk_rope_head_dim``), from
which the keys and values of all its heads come."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hybridkv.models.families import Family
from hybridkv.models.hf_config import int_field
from hybridkv.models.kinds import FULL


def _kinds(cfg: Mapping[str, Any], num_layers: int) -> list[str]:
    return [FULL] * num_layers


def _latent_width(cfg: Mapping[str, Any]) -> int:
    return int_field(cfg, "kv_lora_rank") + int_field(cfg, "qk_rope_head_dim")


FAMILY = Family(
    model_types=(),
    layer_kinds=_kinds,
    sized_types=("deepseek_v3", "kimi_k2"),
    latent_width=_latent_width,
)
