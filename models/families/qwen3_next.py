"""Qwen3-Next and Qwen3.5 (text): Gated DeltaNet layers (``linear_attention``) with a full
attention layer every ``full_attention_interval`` (4), pre-norm with zero-centred norms;
attention with an output gate (joined to ``q_proj`` in the checkpoint), q/k norms and rope
on ``partial_rotary_factor`` (a quarter) of each head; experts with a gated shared expert
(Qwen3-Next, Qwen3.5-MoE; dense in ``mlp_only_layers`` and off ``decoder_sparse_step``),
or a dense MLP (Qwen3.5).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hybridkv.models.config import ModelConfig, activation_of
from hybridkv.models.families import Family
from hybridkv.models.families.common import common_fields
from hybridkv.models.hf_config import flag_field, int_field
from hybridkv.models.kinds import DELTANET, FULL, PolicyChoices, kinds_by
from hybridkv.models.shapes.decoder import DecoderShape
from hybridkv.models.shapes.deltanet import deltanet_shape
from hybridkv.models.shapes.moe import ExpertsShape
from hybridkv.models.shapes.mtp import MtpShape
from hybridkv.models.shapes.rope import rope_from_hf


def parse_qwen3_next(
    hf: Mapping[str, Any], *, dtype_bytes: int = 2, policies: PolicyChoices | None = None
) -> ModelConfig:
    """Read a Qwen3-Next or Qwen3.5 text config.json."""
    if hf.get("intermediate_size") is None:  # Qwen3.5-MoE: experts in every layer
        hf = {**hf, "intermediate_size": hf.get("moe_intermediate_size")}
    fields = common_fields(hf, dtype_bytes=dtype_bytes, policies=policies)
    if hf.get("partial_rotary_factor") is None:
        hf = {**hf, "partial_rotary_factor": 0.25}
    return ModelConfig(
        **fields,
        norm_offset=1.0,
        activation=activation_of(str(hf.get("hidden_act", "silu"))),
        qk_norm=True,
        embed_scale=None,
        query_scale=int_field(hf, "head_dim", 256) ** -0.5,
        attn_softcap=None,
        final_softcap=None,
        rope={FULL: rope_from_hf(hf, default_theta=10_000.0)},
        mlp_bias=False,
        attention_output_gate="channel",
        deltanet=deltanet_shape(hf),
        experts=_experts(hf, len(fields["layers"])),
    )


def _experts(hf: Mapping[str, Any], num_layers: int) -> ExpertsShape | None:
    """The experts, where ``num_experts``; dense layers by ``mlp_only_layers`` and
    ``decoder_sparse_step``."""
    experts = int(hf.get("num_experts") or 0)
    if not experts:
        return None
    step = int_field(hf, "decoder_sparse_step", 1)
    dense = {*map(int, hf.get("mlp_only_layers") or ())}
    dense |= {i for i in range(num_layers) if (i + 1) % step}
    return ExpertsShape(
        num_experts=experts,
        top_k=int_field(hf, "num_experts_per_tok"),
        inner=int_field(hf, "moe_intermediate_size"),
        renormalize=flag_field(hf, "norm_topk_prob", True),
        dense_layers=frozenset(dense),
        shared_inner=int(hf.get("shared_expert_intermediate_size") or 0),
        shared_gate=True,
        stacks="plain",
    )


def _pattern(cfg: Mapping[str, Any], num_layers: int) -> list[str]:
    """Every ``full_attention_interval``-th layer full attention, the rest DeltaNet."""
    every = int_field(cfg, "full_attention_interval", 4)
    return [FULL if (i + 1) % every == 0 else DELTANET for i in range(num_layers)]


FAMILY = Family(
    model_types=("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text"),
    layer_kinds=kinds_by(_pattern, {"full_attention": FULL, "linear_attention": DELTANET}),
    parse=parse_qwen3_next,
    decoder=DecoderShape(mlp="experts"),
    state_shape=deltanet_shape,
    # The multimodal configs (their text models nested in ``text_config``) are sized.
    sized_types=("qwen3_5", "qwen3_5_moe"),
    # One multi-token prediction layer, full attention, under ``mtp.`` (speculative method mtp).
    mtp=MtpShape(
        layout="mtp",
        count_fields=("num_nextn_predict_layers", "mtp_num_hidden_layers"),
        default_count=1,
        kind=FULL,
    ),
)
