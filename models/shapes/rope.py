"""Rotary position embedding parameters, read from config.json (torch-free).

A model may use different rope parameters per layer type (Gemma 3: a local base frequency
for sliding layers, the global one with linear scaling for full layers), so a spec is
parsed per layer type; ``hybridkv.models.blocks.rope`` turns each into its table.

The scalings are those checkpoints name in ``rope_type``: ``linear``, ``llama3``, ``yarn``
(gpt-oss, Qwen's long-context configs, Ministral 3), ``longrope`` (Phi-3 128k, Phi-4-mini),
``dynamic`` (NTK) and ``proportional`` (Gemma 4's full layers: the first
``partial_rotary_factor`` of each half-split pair rotates at the frequencies of the whole
head, the rest not at all). The last two change with the sequence length: here a position's
rotation depends on that position alone, as it does in transformers' step-by-step decode
(and in vLLM): ``longrope`` rotates positions below ``original_max_position_embeddings``
by its short factors and the rest by its long ones; ``dynamic`` rotates position p as a
sequence of ``max(p + 1, max_position_embeddings)`` tokens. A prompt longer than that
prefilled in one forward is rotated by transformers with the factors of its full length.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import attrs

from hybridkv.models.errors import ModelConfigError

_SUPPORTED = ("default", "linear", "llama3", "yarn", "longrope", "dynamic", "proportional")


@attrs.frozen(kw_only=True)
class RopeSpec:
    """Parameters of one rotary table.

    Attributes:
        theta: The base wavelength.
        rope_type: One of ``default``, ``linear`` (frequencies divided by ``factor``),
            ``llama3`` (low frequencies divided by ``factor``, a smooth ramp between),
            ``yarn``, ``longrope``, ``dynamic`` or ``proportional`` (see the module).
        factor: Scaling factor (all but ``default``).
        low_freq_factor: ``llama3`` only.
        high_freq_factor: ``llama3`` only.
        original_max_position_embeddings: The pretraining context (``llama3``, ``yarn``,
            ``longrope``).
        max_position_embeddings: The config's context (``dynamic`` scales beyond it).
        partial_rotary_factor: The share of each head rotated (its first channels; Bamba
            rotates half); 0 rotates nothing (Granite 4.0-H without position embeddings).
        attention_factor: cos and sin are multiplied by it (``yarn``, ``longrope``).
        beta_fast: ``yarn``: rotations above which a frequency is kept.
        beta_slow: ``yarn``: rotations below which a frequency is divided by ``factor``.
        truncate: ``yarn``: the ramp's ends rounded outwards to whole channels.
        short_factor: ``longrope``: per frequency, its divisor inside the pretraining context.
        long_factor: ``longrope``: per frequency, its divisor beyond it.
    """

    theta: float
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    max_position_embeddings: int = 8192
    partial_rotary_factor: float = 1.0
    attention_factor: float = 1.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()

    @classmethod
    def from_hf(
        cls,
        params: Mapping[str, Any] | None,
        *,
        theta: float,
        max_positions: int,
        top: Mapping[str, Any] | None = None,
    ) -> RopeSpec:
        """Parse a Hugging Face rope dict (``rope_parameters`` or legacy ``rope_scaling``).

        ``theta`` is used where the dict has no ``rope_theta``; a ``None`` dict means
        plain rope at ``theta``. ``top`` is the config, for the fields older configs keep
        beside the dict (``partial_rotary_factor``, Phi-3's
        ``original_max_position_embeddings``).

        Raises:
            ModelConfigError: a rope type we do not implement, or one missing its fields.
        """
        params, top = dict(params or {}), top or {}
        rope_type = str(params.get("rope_type", params.get("type", "default")))
        if rope_type not in _SUPPORTED:
            raise ModelConfigError(
                f"rope_type {rope_type!r} is not supported; supported: {', '.join(_SUPPORTED)}"
            )
        original = top.get("original_max_position_embeddings")
        original = int(original or params.get("original_max_position_embeddings", max_positions))
        factor = params.get("factor")
        if factor is None:  # DeepSeek's yarn and Phi-3's longrope: the contexts' ratio
            factor = max_positions / original if rope_type in ("yarn", "longrope") else 1.0
        spec = cls(
            theta=float(params.get("rope_theta", theta)),
            rope_type=rope_type,
            factor=float(factor),
            low_freq_factor=float(params.get("low_freq_factor", 1.0)),
            high_freq_factor=float(params.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=original,
            max_position_embeddings=max_positions,
            partial_rotary_factor=float(
                params.get("partial_rotary_factor", top.get("partial_rotary_factor", 1.0))
            ),
            beta_fast=float(params.get("beta_fast") or 32.0),
            beta_slow=float(params.get("beta_slow") or 1.0),
            truncate=bool(params.get("truncate", True)),
            short_factor=_factors(params, "short_factor", rope_type),
            long_factor=_factors(params, "long_factor", rope_type),
        )
        return attrs.evolve(spec, attention_factor=_attention_factor(spec, params))


def _factors(params: Mapping[str, Any], name: str, rope_type: str) -> tuple[float, ...]:
    if rope_type != "longrope":
        return ()
    if not isinstance(params.get(name), list):
        raise ModelConfigError(f"longrope rope parameters need {name!r}, a list of numbers")
    return tuple(float(f) for f in params[name])


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _attention_factor(spec: RopeSpec, params: Mapping[str, Any]) -> float:
    """The multiplier of cos and sin: the config's ``attention_factor``, else the one
    YaRN's and LongRoPE's papers give for ``factor``."""
    if params.get("attention_factor") is not None:
        return float(params["attention_factor"])
    if spec.rope_type == "yarn":
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            return _yarn_mscale(spec.factor, mscale) / _yarn_mscale(spec.factor, mscale_all_dim)
        return _yarn_mscale(spec.factor)
    if spec.rope_type == "longrope" and spec.factor > 1.0:
        context = spec.original_max_position_embeddings
        return math.sqrt(1 + math.log(spec.factor) / math.log(context))
    return 1.0


@attrs.frozen(kw_only=True)
class QueryTemperature:
    """Queries multiplied by ``1 + beta * log(1 + floor((p + offset) / every))`` at
    position p: attention sharpened far into long contexts (Llama 4's temperature tuning
    on its NoPE layers, Ministral 3's ``llama_4_scaling_beta`` on every layer).

    Attributes:
        beta: The log's multiplier.
        every: Positions per step of the floor.
        offset: Added to the position first (Llama 4: 1).
        nope_only: Only the layers without rope are scaled (Llama 4).
    """

    beta: float
    every: float
    offset: float = 0.0
    nope_only: bool = False


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
        top=hf,
    )


def softmax_mscale(hf: Mapping[str, Any]) -> float:
    """The multiplier of the attention scores' scale under a scaled rope with
    ``mscale_all_dim`` (DeepSeek's: YaRN's mscale of that dimension, squared, for every
    channel, the rotated ones and the rest); 1 otherwise."""
    params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    spec = rope_from_hf(hf, default_theta=10_000.0)
    all_dim = params.get("mscale_all_dim") if isinstance(params, Mapping) else None
    if spec.rope_type == "default" or not all_dim:
        return 1.0
    return _yarn_mscale(spec.factor, float(all_dim)) ** 2


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
        kind: RopeSpec.from_hf(params.get(kind), theta=theta, max_positions=max_positions, top=hf)
        for kind in kinds
    }
