"""Seed-OSS: Llama's layers with biased q/k/v projections (``attention_bias``, on by
default) and an output projection biased only where ``attention_out_bias`` says."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hybridkv.models.config import ModelConfig
from hybridkv.models.families import Family
from hybridkv.models.families.llama import llama_fields
from hybridkv.models.hf_config import flag_field
from hybridkv.models.kinds import FULL, PolicyChoices, kinds_by


def parse_seed_oss(
    hf: Mapping[str, Any], *, dtype_bytes: int = 2, policies: PolicyChoices | None = None
) -> ModelConfig:
    """Read a Seed-OSS config.json."""
    fields = llama_fields(hf, dtype_bytes=dtype_bytes, policies=policies)
    return ModelConfig(
        **{**fields, "attention_bias": flag_field(hf, "attention_bias", True)},
        attention_out_bias=flag_field(hf, "attention_out_bias", False),
    )


FAMILY = Family(
    model_types=("seed_oss",), layer_kinds=kinds_by(lambda cfg, n: [FULL] * n), parse=parse_seed_oss
)
