"""Phi-3 (and Phi-4-mini): Llama's layers with q/k/v and gate/up joined in the checkpoint
(``qkv_proj``, ``gate_up_proj``, read as the parts), rope on a share of each head
(``partial_rotary_factor``), every layer sliding where ``sliding_window`` is set, and
LongRoPE (``rope_type`` ``longrope``: Phi-3 128k, Phi-4-mini; ``models/shapes/rope.py``)."""

from __future__ import annotations

from hybridkv.models.families import Family
from hybridkv.models.families.llama import parse_llama
from hybridkv.models.kinds import kinds_by, window_everywhere

FAMILY = Family(
    model_types=("phi3",),
    layer_kinds=kinds_by(window_everywhere),
    parse=parse_llama,
)
