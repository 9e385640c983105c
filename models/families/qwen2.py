"""Qwen2 (and Qwen2.5): Llama's layers, with biases on the q/k/v projections (none on the
output projection).

It slides only where the config turns it on (``use_sliding_window``): the layers from
``max_window_layers`` on, with ``sliding_window``; transformers writes that out as
``layer_types``, which is read first.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hybridkv.models.config import ModelConfig
from hybridkv.models.families import Family
from hybridkv.models.families.llama import llama_fields
from hybridkv.models.hf_config import int_field
from hybridkv.models.kinds import FULL, SLIDING, PolicyChoices, kinds_by


def parse_qwen2(
    hf: Mapping[str, Any], *, dtype_bytes: int = 2, policies: PolicyChoices | None = None
) -> ModelConfig:
    """Read a Qwen2 config.json."""
    fields = llama_fields(hf, dtype_bytes=dtype_bytes, policies=policies)
    return ModelConfig(**{**fields, "attention_bias": True}, attention_out_bias=False)


def qwen_kinds(cfg: Mapping[str, Any], num_layers: int) -> list[str]:
    """Sliding from ``max_window_layers`` on where ``use_sliding_window``, else full."""
    if not (cfg.get("use_sliding_window") and cfg.get("sliding_window")):
        return [FULL] * num_layers
    first = int_field(cfg, "max_window_layers", num_layers)
    return [SLIDING if i >= first else FULL for i in range(num_layers)]


FAMILY = Family(model_types=("qwen2",), layer_kinds=kinds_by(qwen_kinds), parse=parse_qwen2)
