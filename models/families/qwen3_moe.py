"""Qwen3-MoE: Qwen3's attention, a mixture of experts in each layer but those of
``mlp_only_layers`` (and off the ``decoder_sparse_step``), whose MLP is dense; the router's
top-k weights renormalised where ``norm_topk_prob``. One MLP per expert in the checkpoint
(``mlp.experts.{e}``), stacked at load."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hybridkv.models.config import ModelConfig
from hybridkv.models.families import Family
from hybridkv.models.families.llama import llama_fields
from hybridkv.models.families.qwen2 import qwen_kinds
from hybridkv.models.hf_config import flag_field, int_field
from hybridkv.models.kinds import PolicyChoices, kinds_by
from hybridkv.models.shapes.decoder import DecoderShape
from hybridkv.models.shapes.moe import ExpertsShape


def parse_qwen3_moe(
    hf: Mapping[str, Any], *, dtype_bytes: int = 2, policies: PolicyChoices | None = None
) -> ModelConfig:
    """Read a Qwen3-MoE config.json."""
    fields = llama_fields(hf, dtype_bytes=dtype_bytes, policies=policies)
    num_layers = len(fields["layers"])
    # The hub's configs name it num_experts; transformers 5 writes num_local_experts.
    experts = int_field(hf, "num_experts" if "num_experts" in hf else "num_local_experts")
    step = int_field(hf, "decoder_sparse_step", 1)
    only = {int(i) for i in hf.get("mlp_only_layers") or ()}
    return ModelConfig(
        **{**fields, "qk_norm": True},
        experts=ExpertsShape(
            num_experts=experts,
            top_k=int_field(hf, "num_experts_per_tok"),
            inner=int_field(hf, "moe_intermediate_size"),
            renormalize=flag_field(hf, "norm_topk_prob", False),
            dense_layers=frozenset(
                i for i in range(num_layers) if i in only or (i + 1) % step != 0
            ),
        ),
    )


FAMILY = Family(
    model_types=("qwen3_moe",),
    layer_kinds=kinds_by(qwen_kinds),
    parse=parse_qwen3_moe,
    decoder=DecoderShape(mlp="experts"),
)
