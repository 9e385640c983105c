"""Mistral: Llama's layers, every one sliding (``sliding_window``) when the config sets a
window, else all full. Mixtral (the same with experts) is sized, not run."""

from __future__ import annotations

from hybridkv.models.families import Family
from hybridkv.models.families.llama import parse_llama
from hybridkv.models.kinds import kinds_by, window_everywhere

FAMILY = Family(
    model_types=("mistral",),
    sized_types=("mixtral",),
    layer_kinds=kinds_by(window_everywhere),
    parse=parse_llama,
)
