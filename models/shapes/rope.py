"""Rotary position embedding parameters, read from config.json (torch-free).

A model may use different rope parameters per layer type (Gemma 3: a local base frequency
for sliding layers, the global one with linear scaling for full layers), so a spec is
parsed per layer type; ``hybridkv.models.blocks.rope`` turns each into its table.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from hybridkv.models.errors import ModelConfigError

_SUPPORTED = ("default", "linear", "llama3")


@attrs.frozen(kw_only=True)
class RopeSpec:
    """Parameters of one rotary table.

    Attributes:
        theta: The base wavelength.
        rope_type: ``default``, ``linear`` (frequencies divided by ``factor``) or
            ``llama3`` (low frequencies divided by ``factor``, a smooth ramp between).
        factor: Scaling factor (``linear`` and ``llama3``).
        low_freq_factor: ``llama3`` only.
        high_freq_factor: ``llama3`` only.
        original_max_position_embeddings: ``llama3`` only: the pretraining context.
        partial_rotary_factor: The share of each head rotated (its first channels; Bamba
            rotates half); 0 rotates nothing (Granite 4.0-H without position embeddings).
    """

    theta: float
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    partial_rotary_factor: float = 1.0

    @classmethod
    def from_hf(
        cls, params: Mapping[str, Any] | None, *, theta: float, max_positions: int
    ) -> RopeSpec:
        """Parse a Hugging Face rope dict (``rope_parameters`` or legacy ``rope_scaling``).

        ``theta`` is used where the dict has no ``rope_theta``; a ``None`` dict means
        plain rope at ``theta``.

        Raises:
            ModelConfigError: a rope type we do not implement.
        """
        params = dict(params or {})
        rope_type = str(params.get("rope_type", params.get("type", "default")))
        if rope_type not in _SUPPORTED:
            raise ModelConfigError(
                f"rope_type {rope_type!r} is not supported; supported: {', '.join(_SUPPORTED)}"
            )
        return cls(
            theta=float(params.get("rope_theta", theta)),
            rope_type=rope_type,
            factor=float(params.get("factor", 1.0)),
            low_freq_factor=float(params.get("low_freq_factor", 1.0)),
            high_freq_factor=float(params.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(
                params.get("original_max_position_embeddings", max_positions)
            ),
            partial_rotary_factor=float(params.get("partial_rotary_factor", 1.0)),
        )


def rope_from_hf(hf: Mapping[str, Any], *, default_theta: float) -> RopeSpec:
    """The one rope spec of a config that shares it across layers (Llama, Gemma 2).

    Reads ``rope_parameters`` (transformers 5) or the legacy ``rope_theta`` and
    ``rope_scaling`` fields.
    """
    params = hf.get("rope_parameters") or hf.get("rope_scaling")
    return RopeSpec.from_hf(
        params,
        theta=float(hf.get("rope_theta") or default_theta),
        max_positions=int(hf.get("max_position_embeddings") or 2048),
    )


def rope_by_kind(
    hf: Mapping[str, Any], kinds: tuple[str, ...], *, default_theta: float
) -> dict[str, RopeSpec]:
    """A rope spec per layer kind: ``rope_parameters`` keyed by kind where the config nests
    them so (OLMo 3; a kind it leaves out rotates by default at ``default_theta``), else
    the one spec of :func:`rope_from_hf` for every kind."""
    params = hf.get("rope_parameters")
    if not (isinstance(params, Mapping) and any(k in params for k in kinds)):
        shared = rope_from_hf(hf, default_theta=default_theta)
        return dict.fromkeys(kinds, shared)
    max_positions = int(hf.get("max_position_embeddings") or 2048)
    theta = float(hf.get("rope_theta") or default_theta)
    return {
        kind: RopeSpec.from_hf(params.get(kind), theta=theta, max_positions=max_positions)
        for kind in kinds
    }
