"""Granite SWA: Granite's scalings (``granite_scalings``, Granite 4.0-H's), a learned
attention sink per head, sliding layers (3 to 1 full) and a rope base per layer
(``layer_rope_theta``, 0 for a layer without rope). Granite MoE SWA
(``granitemoe_swa.py``) reads the same, with experts."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from hybridkv.models.config import ModelConfig
from hybridkv.models.errors import ModelConfigError
from hybridkv.models.families import Family
from hybridkv.models.families.granite_hybrid import granite_scalings
from hybridkv.models.families.llama import llama_fields
from hybridkv.models.hf_config import flag_field, int_field
from hybridkv.models.kinds import FULL, SLIDING, PolicyChoices, kinds_by
from hybridkv.models.shapes.moe import ExpertsShape


def _layer_bases(fields: dict[str, Any], thetas: list[float]) -> dict[str, Any]:
    """The rope spec of each kind at its layers' base, and the layers of base 0 as NoPE.

    Raises:
        ModelConfigError: a count unlike the layers', or two bases in one kind.
    """
    kinds = [spec.kind for spec in fields["layers"]]
    if len(thetas) != len(kinds):
        raise ModelConfigError(
            f"layer_rope_theta has {len(thetas)} entries, num_hidden_layers is {len(kinds)}"
        )
    rope = dict(fields["rope"])
    for kind in set(kinds):
        bases = sorted({t for t, k in zip(thetas, kinds, strict=True) if k == kind and t})
        if len(bases) > 1:
            raise ModelConfigError(
                f"layer_rope_theta gives the {kind} layers bases {bases}; one base per "
                "layer kind is supported"
            )
        if bases:
            rope[kind] = attrs.evolve(rope[kind], theta=bases[0])
    return {"rope": rope, "nope_layers": frozenset(i for i, t in enumerate(thetas) if not t)}


def parse_granite_swa(
    hf: Mapping[str, Any], *, dtype_bytes: int = 2, policies: PolicyChoices | None = None
) -> ModelConfig:
    """Read a Granite SWA or Granite MoE SWA config.json."""
    fields = llama_fields(hf, dtype_bytes=dtype_bytes, policies=policies)
    thetas = hf.get("layer_rope_theta")
    fields |= {
        **granite_scalings(hf),
        "tie_word_embeddings": flag_field(hf, "tie_word_embeddings", hf["model_type"] == _DENSE),
        **({} if thetas is None else _layer_bases(fields, [float(t) for t in thetas])),
    }
    experts = None
    if hf["model_type"] != _DENSE:
        fields["intermediate_size"] = int_field(hf, "shared_intermediate_size", 0)
        experts = ExpertsShape(
            num_experts=int_field(hf, "num_local_experts", 8),
            top_k=int_field(hf, "num_experts_per_tok", 2),
            inner=int_field(hf, "intermediate_size"),
            stacks="plain",
        )
    return ModelConfig(
        **fields,
        attention_sinks=frozenset({FULL, SLIDING}),
        experts=experts,
    )


_DENSE = "granite_swa"


def granite_swa_kinds(cfg: Mapping[str, Any], num_layers: int) -> list[str]:
    """Without ``layer_types``: every fourth layer full, from the first."""
    return [FULL if i % 4 == 0 else SLIDING for i in range(num_layers)]


FAMILY = Family(
    model_types=(_DENSE,),
    layer_kinds=kinds_by(granite_swa_kinds),
    parse=parse_granite_swa,
)
