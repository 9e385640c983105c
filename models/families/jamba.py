"""Jamba: one attention layer in ``attn_layer_period`` (at ``attn_layer_offset``), Mamba1
in the others. Sized by ``hybridkv plan``; not run here (no Mamba1 mixer yet)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hybridkv.models.families import Family
from hybridkv.models.hf_config import int_field
from hybridkv.models.kinds import FULL, MAMBA


def _kinds(cfg: Mapping[str, Any], num_layers: int) -> list[str]:
    period = int_field(cfg, "attn_layer_period", 8)
    offset = int_field(cfg, "attn_layer_offset", 4)
    return [FULL if i % period == offset else MAMBA for i in range(num_layers)]


def _state_bytes(cfg: Mapping[str, Any], dtype_bytes: int) -> int:
    """Mamba1's state: its conv window and SSM state, ``mamba_expand * hidden`` channels
    each, in the model dtype."""
    d_inner = int_field(cfg, "mamba_expand", 2) * int_field(cfg, "hidden_size")
    width = int_field(cfg, "mamba_d_conv", 4) + int_field(cfg, "mamba_d_state", 16)
    return d_inner * width * dtype_bytes


FAMILY = Family(
    model_types=(), sized_types=("jamba",), layer_kinds=_kinds, state_bytes=_state_bytes
)
