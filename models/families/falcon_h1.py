"""Falcon-H1: full attention and Mamba2 side by side in every layer, on the same normed
input, their outputs summed (``hybrid`` layers: the attention keeps its K/V in one
group, the Mamba2 beside it its state in another, ``AttentionSpec.beside``)::

    n = norm(x);  h = x + attn(n) + mamba(n);  out = h + mlp(norm(h))

Its muP multipliers (of the embedding, of the LM head, of each projection's input or
output, and per part of the Mamba2 in-projection's rows) are the config's: the
embedding's and the LM head's are the model's ``embed_scale`` and ``logits_scaling``, the
others are folded into the weights they scale at load (``Family.scales``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

import attrs

from hybridkv.models.config import ModelConfig
from hybridkv.models.errors import ModelConfigError
from hybridkv.models.families import Family, RowScale
from hybridkv.models.families.llama import llama_fields
from hybridkv.models.hf_config import flag_field, float_field
from hybridkv.models.kinds import HYBRID, PolicyChoices
from hybridkv.models.shapes.decoder import DecoderShape
from hybridkv.models.shapes.mamba2 import Mamba2Shape, mamba2_shape


def _normalize(hf: Mapping[str, Any]) -> Mapping[str, Any]:
    """``mamba_d_ssm`` (1,024 where absent, as transformers reads it; None: ``mamba_expand``
    x hidden) as the Mamba2 width ``mamba2_shape`` reads."""
    cfg = dict(hf)
    width = hf.get("mamba_d_ssm", 1024)
    if width is not None:
        cfg["mamba_intermediate_size"] = width
    return cfg


def falcon_h1_mamba(cfg: Mapping[str, Any]) -> Mamba2Shape:
    """The Mamba2 beside the attention: its gate meets a norm or not (``mamba_rms_norm``),
    after or before it (``mamba_norm_before_gate``); its out projection's bias is
    ``projectors_bias``."""
    gate: Literal["gate_then_norm", "norm_then_gate", "gate_only"]
    if not flag_field(cfg, "mamba_rms_norm", False):
        gate = "gate_only"
    elif flag_field(cfg, "mamba_norm_before_gate", True):
        gate = "norm_then_gate"
    else:
        gate = "gate_then_norm"
    out_bias = flag_field(cfg, "projectors_bias", False)
    return attrs.evolve(mamba2_shape(cfg), gate=gate, out_bias=out_bias)


def parse_falcon_h1(
    hf: Mapping[str, Any], *, dtype_bytes: int = 2, policies: PolicyChoices | None = None
) -> ModelConfig:
    """Read a Falcon-H1 config.json (normalized)."""
    fields = llama_fields(hf, dtype_bytes=dtype_bytes, policies=policies)
    return ModelConfig(
        **fields
        | {
            "embed_scale": float_field(hf, "embedding_multiplier", 1.0),
            "logits_scaling": 1.0 / float_field(hf, "lm_head_multiplier", 1.0),
        },
        mamba=falcon_h1_mamba(hf),
    )


def _scales(cfg: Mapping[str, Any]) -> dict[str, tuple[RowScale, ...]]:
    """Each projection's multipliers, as runs of its rows: the in-projection's five parts
    (``z``, ``x``, ``B``, ``C``, ``dt``: ``ssm_multipliers``) and its input's
    (``ssm_in_multiplier``), attention's input (q, k, v) and keys, each output, and the
    MLP's gate and down projections (``mlp_multipliers``)."""
    shape = falcon_h1_mamba(cfg)
    inner, bc = shape.intermediate_size, shape.num_groups * shape.state_size
    starts = (0, inner, 2 * inner, 2 * inner + bc, 2 * inner + 2 * bc)
    stops: tuple[int | None, ...] = (*starts[1:], None)
    mup = tuple(zip(starts, stops, _factors(cfg, "ssm_multipliers", 5), strict=True))
    gate, down = _factors(cfg, "mlp_multipliers", 2)

    def whole(name: str, times: float = 1.0) -> tuple[RowScale, ...]:
        return ((0, None, float_field(cfg, name, 1.0) * times),)

    key = float_field(cfg, "key_multiplier", 1.0)
    scales = {
        ".mamba.in_proj.weight": (*mup, *whole("ssm_in_multiplier")),
        ".mamba.in_proj.bias": mup,
        ".self_attn.q_proj.weight": whole("attention_in_multiplier"),
        ".self_attn.k_proj.weight": whole("attention_in_multiplier", key),
        ".self_attn.k_proj.bias": ((0, None, key),),
        ".self_attn.v_proj.weight": whole("attention_in_multiplier"),
    }
    outputs = {
        ".mamba.out_proj": whole("ssm_out_multiplier"),
        ".self_attn.o_proj": whole("attention_out_multiplier"),
        ".feed_forward.gate_proj": ((0, None, gate),),
        ".feed_forward.down_proj": ((0, None, down),),
    }
    for part, runs in outputs.items():
        scales |= {f"{part}.weight": runs, f"{part}.bias": runs}
    return scales


def _factors(cfg: Mapping[str, Any], name: str, count: int) -> list[float]:
    """The ``count`` numbers of field ``name`` (ones where absent).

    Raises:
        ModelConfigError: another count, or not numbers.
    """
    values = cfg.get(name)
    if values is None:
        return [1.0] * count
    try:
        factors = [float(v) for v in values]
    except (TypeError, ValueError):
        factors = []
    if len(factors) != count:
        raise ModelConfigError(f"config field {name!r} must be {count} numbers, got {values!r}")
    return factors


FAMILY = Family(
    model_types=("falcon_h1",),
    layer_kinds=lambda cfg, n: [HYBRID] * n,
    parse=parse_falcon_h1,
    decoder=DecoderShape(mlp_norm="pre_ff_layernorm", mlp_name="feed_forward"),
    renames={"model.final_layernorm.weight": "model.norm.weight"},
    state_shape=falcon_h1_mamba,
    normalize=_normalize,
    scales=_scales,
)
