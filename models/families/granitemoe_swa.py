"""Granite MoE SWA: Granite SWA's attention and scalings (``granite_swa.py``), experts in
every layer (stacked in the checkpoint as we keep them) beside a shared MLP where
``shared_intermediate_size`` is not 0."""

from __future__ import annotations

from hybridkv.models.families import Family
from hybridkv.models.families.granite_swa import granite_swa_kinds, parse_granite_swa
from hybridkv.models.kinds import kinds_by
from hybridkv.models.shapes.decoder import DecoderShape

FAMILY = Family(
    model_types=("granitemoe_swa",),
    layer_kinds=kinds_by(granite_swa_kinds),
    parse=parse_granite_swa,
    decoder=DecoderShape(mlp="shared_and_experts"),
)
