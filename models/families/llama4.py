"""Llama 4 (text): chunked local attention in the layers that rotate, full attention
without rope (NoPE) in every ``no_rope_layer_interval``-th; rope on adjacent channel
pairs, each q and k head divided by its RMS after it (``use_qk_norm``); queries of the
NoPE layers scaled by position (``attn_temperature_tuning``); a mixture of experts in the
``moe_layers`` (sigmoid router weighting the expert's input, a shared expert beside),
a dense MLP of ``intermediate_size_mlp`` in the others."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hybridkv.models.config import ModelConfig
from hybridkv.models.families import Family
from hybridkv.models.families.llama import llama_fields
from hybridkv.models.families.smollm3 import rotates
from hybridkv.models.hf_config import flag_field, float_field, int_field
from hybridkv.models.kinds import CHUNKED, FULL, PolicyChoices, kinds_by
from hybridkv.models.shapes.decoder import DecoderShape
from hybridkv.models.shapes.moe import ExpertsShape
from hybridkv.models.shapes.rope import QueryTemperature


def parse_llama4(
    hf: Mapping[str, Any], *, dtype_bytes: int = 2, policies: PolicyChoices | None = None
) -> ModelConfig:
    """Read a Llama 4 text config.json (``llama4_text``)."""
    fields = llama_fields(hf, dtype_bytes=dtype_bytes, policies=policies)
    num_layers = len(fields["layers"])
    step = int_field(hf, "interleave_moe_layer_step", 1)
    moe = hf.get("moe_layers")
    moe_layers = set(range(step - 1, num_layers, step) if moe is None else moe)
    inner = fields["intermediate_size"]
    temperature = None
    if flag_field(hf, "attn_temperature_tuning", True):
        temperature = QueryTemperature(
            beta=float_field(hf, "attn_scale", 0.1),
            every=float_field(hf, "floor_scale", 8192),
            offset=1.0,
            nope_only=True,
        )
    return ModelConfig(
        **{
            **fields,
            "intermediate_size": int_field(hf, "intermediate_size_mlp", inner),
            "rms_norm_eps": float_field(hf, "rms_norm_eps", 1e-5),
        },
        rope_interleaved=True,
        rope_qk_l2_norm=flag_field(hf, "use_qk_norm", True),
        nope_layers=frozenset(i for i, r in enumerate(rotates(hf, num_layers)) if not r),
        query_temperature=temperature,
        experts=ExpertsShape(
            num_experts=int_field(hf, "num_local_experts"),
            top_k=int_field(hf, "num_experts_per_tok", 1),
            inner=inner,
            dense_layers=frozenset(set(range(num_layers)) - moe_layers),
            router="sigmoid",
            renormalize=False,
            weight_inputs=True,
            shared_inner=inner,
            stacks="transposed",
        ),
    )


def _kinds(cfg: Mapping[str, Any], num_layers: int) -> list[str]:
    """Chunked where the layer rotates (and ``attention_chunk_size`` is set), else full."""
    chunked = cfg.get("attention_chunk_size") is not None
    return [CHUNKED if r and chunked else FULL for r in rotates(cfg, num_layers)]


FAMILY = Family(
    model_types=("llama4_text",),
    layer_kinds=kinds_by(_kinds),
    parse=parse_llama4,
    decoder=DecoderShape(mlp="experts", mlp_name="feed_forward"),
)
