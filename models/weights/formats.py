"""The names of the weight formats, apart from their code (no torch), so that a command
line can offer them without importing the model stack (``hybridkv --help`` stays fast).
``hybridkv.models.weights.precision`` says what each format is."""

from __future__ import annotations

WEIGHT_FORMATS = ("dtype", "int8", "int4")
WEIGHT_CHOICES = ("auto", *WEIGHT_FORMATS)
