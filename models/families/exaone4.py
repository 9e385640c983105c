"""EXAONE 4: OLMo's post-norm layers with each q and k head normalised, 3 sliding layers
to 1 full; where the model slides, its full layers do not rotate (NoPE)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hybridkv.models.config import ModelConfig
from hybridkv.models.errors import ModelConfigError
from hybridkv.models.families import Family
from hybridkv.models.families.llama import llama_fields
from hybridkv.models.kinds import FULL, SLIDING, PolicyChoices, kinds_by, pattern_layer_types
from hybridkv.models.shapes.decoder import POST_NORM


def parse_exaone4(
    hf: Mapping[str, Any], *, dtype_bytes: int = 2, policies: PolicyChoices | None = None
) -> ModelConfig:
    """Read an EXAONE 4 config.json."""
    fields = llama_fields(hf, dtype_bytes=dtype_bytes, policies=policies)
    kinds = [spec.kind for spec in fields["layers"]]
    nope = frozenset(i for i, kind in enumerate(kinds) if kind == FULL and SLIDING in kinds)
    return ModelConfig(**{**fields, "qk_norm": True}, nope_layers=nope)


def _pattern(cfg: Mapping[str, Any], num_layers: int) -> list[str]:
    """``sliding_window_pattern``: every p-th layer full (an int), or a string of ``L``
    (local, sliding) and ``G`` (global) repeated over the layers; all full without a
    window."""
    pattern = cfg.get("sliding_window_pattern", 4)
    if not cfg.get("sliding_window") or not pattern:
        return [FULL] * num_layers
    if isinstance(pattern, str) and pattern and set(pattern) <= {"L", "G"}:
        return [SLIDING if pattern[i % len(pattern)] == "L" else FULL for i in range(num_layers)]
    if isinstance(pattern, int) and not isinstance(pattern, bool) and pattern > 0:
        return list(pattern_layer_types(num_layers, pattern))
    raise ModelConfigError(
        f"config field 'sliding_window_pattern' must be a positive integer or a string of "
        f"L and G, got {pattern!r}"
    )


FAMILY = Family(
    model_types=("exaone4",), layer_kinds=kinds_by(_pattern), parse=parse_exaone4, decoder=POST_NORM
)
