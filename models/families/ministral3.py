"""Ministral 3: Mistral's layers (every one sliding where ``sliding_window`` is set), YaRN
rope, and queries scaled by position (``llama_4_scaling_beta``, over the pretraining
context: ``models/shapes/rope.py``, ``QueryTemperature``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hybridkv.models.config import ModelConfig
from hybridkv.models.families import Family
from hybridkv.models.families.llama import llama_fields
from hybridkv.models.kinds import PolicyChoices, kinds_by, window_everywhere
from hybridkv.models.shapes.rope import QueryTemperature


def parse_ministral3(
    hf: Mapping[str, Any], *, dtype_bytes: int = 2, policies: PolicyChoices | None = None
) -> ModelConfig:
    """Read a Ministral 3 config.json."""
    fields = llama_fields(hf, dtype_bytes=dtype_bytes, policies=policies)
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    beta = params.get("llama_4_scaling_beta")
    rope = next(iter(fields["rope"].values()))
    temperature = None
    if beta:
        every = float(rope.original_max_position_embeddings)
        temperature = QueryTemperature(beta=float(beta), every=every)
    return ModelConfig(**fields, query_temperature=temperature)


FAMILY = Family(
    model_types=("ministral3",),
    layer_kinds=kinds_by(window_everywhere),
    parse=parse_ministral3,
)
