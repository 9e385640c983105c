"""LFM2: short-convolution layers (``conv``: a state per request) beside full attention
layers (``full_attn_idxs``), pre-norm (``operator_norm``, ``ffn_norm``), q/k norms per head,
a SwiGLU MLP whose width transformers derives from ``intermediate_size``
(``block_auto_adjust_ff_dim``), the final norm named ``embedding_norm``. LFM2-MoE: the
first ``num_dense_layers`` with a dense MLP of ``intermediate_size``, then experts chosen
by sigmoid scores plus a learned bias (``use_expert_bias``), renormalised and scaled."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hybridkv.models.config import ModelConfig
from hybridkv.models.families import Family
from hybridkv.models.families.llama import llama_fields
from hybridkv.models.hf_config import flag_field, float_field, int_field
from hybridkv.models.kinds import FULL, SHORT_CONV, PolicyChoices, kinds_by
from hybridkv.models.shapes.decoder import DecoderShape
from hybridkv.models.shapes.moe import ExpertsShape
from hybridkv.models.shapes.short_conv import short_conv_shape


def parse_lfm2(
    hf: Mapping[str, Any], *, dtype_bytes: int = 2, policies: PolicyChoices | None = None
) -> ModelConfig:
    """Read an LFM2 config.json."""
    if hf.get("tie_word_embeddings") is None:  # older configs name it ``tie_embedding``
        hf = {**hf, "tie_word_embeddings": flag_field(hf, "tie_embedding", True)}
    fields = llama_fields(hf, dtype_bytes=dtype_bytes, policies=policies)
    moe = hf.get("model_type") == "lfm2_moe"
    return ModelConfig(
        **{
            **fields,
            "qk_norm": True,
            "rms_norm_eps": float_field(hf, "norm_eps", 1e-5),
            "intermediate_size": int_field(hf, "intermediate_size") if moe else _mlp_width(hf),
        },
        short_conv=short_conv_shape(hf),
        experts=_experts(hf, len(fields["layers"])) if moe else None,
    )


def _experts(hf: Mapping[str, Any], num_layers: int) -> ExpertsShape:
    """LFM2-MoE's experts, after its ``num_dense_layers`` dense ones."""
    dense = int(hf.get("num_dense_layers") or 0)
    return ExpertsShape(
        num_experts=int_field(hf, "num_experts"),
        top_k=int_field(hf, "num_experts_per_tok"),
        inner=int_field(hf, "moe_intermediate_size"),
        dense_layers=frozenset(range(min(dense, num_layers))),
        router="sigmoid",
        selection_bias=flag_field(hf, "use_expert_bias", True),
        renormalize=flag_field(hf, "norm_topk_prob", True),
        route_scale=float(hf.get("routed_scaling_factor") or 1.0),
        stacks="plain",
    )


def _mlp_width(hf: Mapping[str, Any]) -> int:
    """The MLP's width as transformers derives it: 2/3 of ``intermediate_size`` (or
    ``block_ff_dim``), times ``block_ffn_dim_multiplier``, up to ``block_multiple_of``."""
    width = int_field(hf, "block_ff_dim" if hf.get("block_ff_dim") else "intermediate_size")
    if not flag_field(hf, "block_auto_adjust_ff_dim", True):
        return width
    width = int(2 * width / 3)
    multiplier = hf.get("block_ffn_dim_multiplier", 1.0)
    if multiplier is None:
        return width
    multiple = int_field(hf, "block_multiple_of", 256)
    width = int(float(multiplier) * width)
    return multiple * ((width + multiple - 1) // multiple)


#: An MLP's (or each expert's: ``experts.{e}``) projections as Mixtral's checkpoints name
#: them, theirs -> ours (LFM2's, MiniMax's).
W123_PARTS = {".w1.": ".gate_proj.", ".w3.": ".up_proj.", ".w2.": ".down_proj."}
#: LFM2's names of its parts that differ from ours, theirs -> ours.
LFM2_PARTS = {
    **W123_PARTS,
    ".self_attn.out_proj.": ".self_attn.o_proj.",
    ".self_attn.q_layernorm.": ".self_attn.q_norm.",
    ".self_attn.k_layernorm.": ".self_attn.k_norm.",
}


def _pattern(cfg: Mapping[str, Any], num_layers: int) -> list[str]:
    """Full attention at ``full_attn_idxs`` (every layer without them), conv elsewhere."""
    full = cfg.get("full_attn_idxs")
    attention = set(range(num_layers)) if full is None else {int(i) for i in full}
    return [FULL if i in attention else SHORT_CONV for i in range(num_layers)]


FAMILY = Family(
    model_types=("lfm2", "lfm2_moe"),
    layer_kinds=kinds_by(_pattern, {"full_attention": FULL, "conv": SHORT_CONV}),
    parse=parse_lfm2,
    decoder=DecoderShape(
        mixer_norm="operator_norm", mlp_norm="ffn_norm", mlp_name="feed_forward", mlp="experts"
    ),
    renames={"model.embedding_norm.weight": "model.norm.weight"},
    part_renames=LFM2_PARTS,
    state_shape=short_conv_shape,
)
