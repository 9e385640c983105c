"""DeepSeek V3 and Kimi K2: every layer multi-head latent attention, which keeps one
vector per token and layer, the compressed latent (``kv_lora_rank``) beside the rope key
(``qk_rope_head_dim``), from which the keys and values of all its heads come
(``blocks/latent_attention.py``); a dense MLP in the first ``first_k_dense_replace``
layers, then experts chosen by DeepSeek's router (sigmoid scores plus a learned bias,
within the best ``topk_group`` of ``n_group`` groups, renormalised and scaled) beside
``n_shared_experts`` shared ones; under a YaRN rope, the scores' scale times YaRN's
``mscale_all_dim`` squared."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hybridkv.models.config import ModelConfig
from hybridkv.models.errors import ModelConfigError
from hybridkv.models.families import Family
from hybridkv.models.families.llama import llama_fields
from hybridkv.models.hf_config import int_field
from hybridkv.models.kinds import FULL, PolicyChoices
from hybridkv.models.shapes.decoder import DecoderShape
from hybridkv.models.shapes.latent import latent_shape, latent_width
from hybridkv.models.shapes.moe import ExpertsShape, grouped_sigmoid_router
from hybridkv.models.shapes.mtp import MtpShape
from hybridkv.models.shapes.rope import softmax_mscale


def parse_deepseek_v3(
    hf: Mapping[str, Any], *, dtype_bytes: int = 2, policies: PolicyChoices | None = None
) -> ModelConfig:
    """Read a DeepSeek V3 (or Kimi K2) config.json."""
    return ModelConfig(**latent_fields(hf, dtype_bytes=dtype_bytes, policies=policies))


def latent_fields(
    hf: Mapping[str, Any], *, dtype_bytes: int, policies: PolicyChoices | None
) -> dict[str, Any]:
    """The ``ModelConfig`` fields of DeepSeek V3's latent attention and experts (Kimi
    Linear's too)."""
    fields = llama_fields(hf, dtype_bytes=dtype_bytes, policies=policies)
    latent = latent_shape(hf)
    shared = int(hf.get("n_shared_experts") or 0) * int_field(hf, "moe_intermediate_size")
    experts = ExpertsShape(
        **grouped_sigmoid_router(hf),
        shared_inner=shared,
        dense_layers=_dense_layers(hf, len(fields["layers"])),
        stacks="plain",
    )
    scale = latent.qk_head_dim**-0.5 * softmax_mscale(hf)
    return {**fields, "query_scale": scale, "latent": latent, "experts": experts}


def _dense_layers(hf: Mapping[str, Any], num_layers: int) -> frozenset[int]:
    """The layers with a dense MLP: ``dense`` in ``mlp_layer_types`` where the config
    has them, else the first ``first_k_dense_replace``.

    Raises:
        ModelConfigError: ``mlp_layer_types`` not one of dense or sparse per layer.
    """
    kinds = hf.get("mlp_layer_types")
    if kinds is None:
        return frozenset(range(min(int(hf.get("first_k_dense_replace") or 0), num_layers)))
    if len(kinds) != num_layers or set(kinds) - {"dense", "sparse"}:
        raise ModelConfigError(
            f"config field 'mlp_layer_types' must hold {num_layers} of dense or sparse"
        )
    return frozenset(i for i, kind in enumerate(kinds) if kind == "dense")


def _kinds(cfg: Mapping[str, Any], num_layers: int) -> list[str]:
    return [FULL] * num_layers


FAMILY = Family(
    model_types=("deepseek_v3", "kimi_k2"),
    layer_kinds=_kinds,
    parse=parse_deepseek_v3,
    decoder=DecoderShape(mlp="experts"),
    latent_width=latent_width,
    mtp=MtpShape(layout="after"),  # the layers after num_hidden_layers
)
