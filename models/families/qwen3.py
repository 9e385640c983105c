"""Qwen3: Qwen2's layers without its q/k/v biases (``attention_bias``, off in the released
models), each q and k head normalised (RMSNorm over the head) before rope."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hybridkv.models.config import ModelConfig
from hybridkv.models.families import Family
from hybridkv.models.families.llama import llama_fields
from hybridkv.models.families.qwen2 import qwen_kinds
from hybridkv.models.kinds import PolicyChoices, kinds_by


def parse_qwen3(
    hf: Mapping[str, Any], *, dtype_bytes: int = 2, policies: PolicyChoices | None = None
) -> ModelConfig:
    """Read a Qwen3 config.json."""
    fields = llama_fields(hf, dtype_bytes=dtype_bytes, policies=policies)
    return ModelConfig(**{**fields, "qk_norm": True})


FAMILY = Family(model_types=("qwen3",), layer_kinds=kinds_by(qwen_kinds), parse=parse_qwen3)
