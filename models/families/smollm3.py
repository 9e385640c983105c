"""SmolLM3: Llama's layers, every ``no_rope_layer_interval``-th one without rope (NoPE;
``no_rope_layers``: 1 rotates, 0 does not); sliding only where ``layer_types`` (or
``use_sliding_window``, on the NoPE layers) says."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hybridkv.models.config import ModelConfig
from hybridkv.models.errors import ModelConfigError
from hybridkv.models.families import Family
from hybridkv.models.families.llama import llama_fields
from hybridkv.models.hf_config import int_field
from hybridkv.models.kinds import FULL, SLIDING, PolicyChoices, kinds_by


def rotates(cfg: Mapping[str, Any], num_layers: int) -> list[bool]:
    """Per layer, whether it rotates q and k (``no_rope_layers``, else every
    ``no_rope_layer_interval``-th layer does not)."""
    flags = cfg.get("no_rope_layers")
    if flags is None:
        every = int_field(cfg, "no_rope_layer_interval", 4)
        return [(i + 1) % every != 0 for i in range(num_layers)]
    if len(flags) != num_layers or any(f not in (0, 1) for f in flags):
        raise ModelConfigError(
            f"config field 'no_rope_layers' must hold {num_layers} entries of 0 or 1, got {flags!r}"
        )
    return [bool(f) for f in flags]


def parse_smollm3(
    hf: Mapping[str, Any], *, dtype_bytes: int = 2, policies: PolicyChoices | None = None
) -> ModelConfig:
    """Read a SmolLM3 config.json."""
    fields = llama_fields(hf, dtype_bytes=dtype_bytes, policies=policies)
    flags = rotates(hf, len(fields["layers"]))
    return ModelConfig(
        **fields, nope_layers=frozenset(i for i, rope in enumerate(flags) if not rope)
    )


def _kinds(cfg: Mapping[str, Any], num_layers: int) -> list[str]:
    slides = bool(cfg.get("use_sliding_window") and cfg.get("sliding_window"))
    return [SLIDING if slides and not r else FULL for r in rotates(cfg, num_layers)]


FAMILY = Family(model_types=("smollm3",), layer_kinds=kinds_by(_kinds), parse=parse_smollm3)
