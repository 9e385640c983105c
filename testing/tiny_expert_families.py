"""Tiny random-weight models of the families with experts or Gemma 4's new parts (shared
KV layers, per-layer inputs), as transformers builds them: ``hybridkv.testing.tiny_models``
saves them beside those of ``tiny_families.py`` and ``tiny_state_families.py``."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from hybridkv.testing.tiny_families import (
    COMMON,
    NO_SPECIAL_TOKENS,
    WINDOW,
    YARN,
    granite_swa_fields,
)

#: Llama 3's rope scaling over a pretraining context of 16 (Llama 4 Scout's kind).
_LLAMA3_ROPE: dict[str, Any] = {
    "rope_parameters": {
        "rope_type": "llama3",
        "rope_theta": 5_000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16,
    }
}


def _qwen3_moe() -> Any:
    """Qwen3-MoE: 4 experts, 2 a token, weights not renormalised, a dense first layer."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        **COMMON,
        num_hidden_layers=3,
        num_key_value_heads=2,
        moe_intermediate_size=32,
        num_experts=4,
        num_experts_per_tok=2,
        norm_topk_prob=False,
        mlp_only_layers=[0],
        **NO_SPECIAL_TOKENS,
    )
    return Qwen3MoeForCausalLM(config)


def _gpt_oss() -> Any:
    """gpt-oss: sliding and full layers alternating, sinks, biased experts (4, two a
    token) whose SwiGLU clamps inside the tiny activations' range, YaRN rope."""
    from transformers import GptOssConfig, GptOssForCausalLM

    config = GptOssConfig(
        **{**COMMON, "intermediate_size": 32},
        num_hidden_layers=4,
        num_key_value_heads=2,
        head_dim=16,
        sliding_window=WINDOW,
        num_local_experts=4,
        num_experts_per_tok=2,
        swiglu_limit=0.5,
        rope_parameters={**YARN, "rope_theta": 10_000.0},
        **NO_SPECIAL_TOKENS,
    )
    return GptOssForCausalLM(config)


def _llama4() -> Any:
    """Llama 4 (text): chunks of 8, the last layer NoPE and full, experts (4, one a token)
    in every second layer beside a shared one, a wider dense MLP in the others; queries
    of the NoPE layer scaled from position 7 on (``floor_scale`` 8)."""
    from transformers import Llama4ForCausalLM, Llama4TextConfig

    config = Llama4TextConfig(
        **{**COMMON, "intermediate_size": 32},
        intermediate_size_mlp=96,
        num_hidden_layers=4,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=4,
        num_experts_per_tok=1,
        interleave_moe_layer_step=2,
        attention_chunk_size=WINDOW,
        floor_scale=8,
        attn_scale=0.3,
        **_LLAMA3_ROPE,
        **NO_SPECIAL_TOKENS,
    )
    return Llama4ForCausalLM(config)


def _granitemoe_swa() -> Any:
    """Granite MoE SWA: 4 experts, two a token, beside a shared MLP."""
    from transformers import GraniteMoeSWAConfig, GraniteMoeSWAForCausalLM

    fields = {**granite_swa_fields(), "intermediate_size": 32, "shared_intermediate_size": 48}
    config = GraniteMoeSWAConfig(**fields, num_local_experts=4, num_experts_per_tok=2)
    return GraniteMoeSWAForCausalLM(config)


def _afmoe() -> Any:
    """AFMoE (Trinity): every second layer full without rope, output gates, a dense
    first layer, experts (4, two a token) chosen with a bias beside two shared ones,
    muP's embedding scale."""
    from transformers import AfmoeConfig, AfmoeForCausalLM

    config = AfmoeConfig(
        **COMMON,
        moe_intermediate_size=16,
        num_hidden_layers=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=4,
        num_experts_per_tok=2,
        num_shared_experts=2,
        route_scale=1.5,
        sliding_window=WINDOW,
        global_attn_every_n_layers=2,
        mup_enabled=True,
        **NO_SPECIAL_TOKENS,
    )
    return AfmoeForCausalLM(config)


def _mimo_v2_flash() -> Any:
    """MiMo-V2-Flash: keys of 24 and values of 16, the sliding layers with twice the KV
    heads and sinks, rope on a third of each head, a dense first layer, experts (4 in 2
    groups, the best group's two a token) chosen with a bias."""
    from transformers import MiMoV2FlashConfig, MiMoV2FlashForCausalLM

    config = MiMoV2FlashConfig(
        **COMMON,
        moe_intermediate_size=16,
        num_hidden_layers=4,
        num_key_value_heads=1,
        head_dim=24,
        v_head_dim=16,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        routed_scaling_factor=1.5,
        sliding_window=WINDOW,
        **NO_SPECIAL_TOKENS,
    )
    return MiMoV2FlashForCausalLM(config)


def _gemma4() -> Any:
    """Gemma 4 as its small models are: full layers twice as wide as the sliding ones with
    one KV head, proportional rope, the last two layers reading the caches of layers 2 and
    3 with MLPs twice as wide, per-layer inputs, a learned scale per layer."""
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    config = Gemma4TextConfig(
        **_gemma4_fields(),
        num_hidden_layers=6,
        layer_types=[*_GEMMA4_KINDS, *_GEMMA4_KINDS],
        num_kv_shared_layers=2,
        use_double_wide_mlp=True,
        hidden_size_per_layer_input=16,
        vocab_size_per_layer_input=COMMON["vocab_size"],
    )
    return _scaled_layers(Gemma4ForCausalLM(config))


def _gemma4_moe() -> Any:
    """Gemma 4 as its MoE and largest models are: full layers whose values are their keys'
    projection (``attention_k_eq_v``) with their own KV heads, experts (4, two a token)
    beside every layer's MLP, a final soft-cap."""
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    config = Gemma4TextConfig(
        **_gemma4_fields(),
        num_hidden_layers=4,
        layer_types=[*_GEMMA4_KINDS, "full_attention"],
        attention_k_eq_v=True,
        enable_moe_block=True,
        num_experts=4,
        top_k_experts=2,
        moe_intermediate_size=16,
        hidden_size_per_layer_input=0,
        final_logit_softcapping=30.0,
    )
    return _scaled_layers(Gemma4ForCausalLM(config))


_GEMMA4_KINDS = ("sliding_attention", "sliding_attention", "full_attention")


def _gemma4_fields() -> dict[str, Any]:
    return {
        **COMMON,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "global_head_dim": 32,
        "num_global_key_value_heads": 1,
        "sliding_window": WINDOW,
        **NO_SPECIAL_TOKENS,
    }


def _scaled_layers(model: Any) -> Any:
    """``model`` with each layer's ``layer_scalar`` (a buffer the redraw of the weights
    leaves at 1) set apart from 1, so that a scale not applied shows; and q/k norm weights
    around 0.3, not 1: Gemma 4 leaves its scores unscaled, and at 1 the tiny heads' scores
    are so peaked that int8 weights move even transformers' own logits by a KL of 0.012
    (0.0005 at 0.3; the redraw keeps each weight's mean)."""
    import torch

    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            layer.layer_scalar.fill_(0.75 + 0.1 * i)
            for name in ("q_norm", "k_norm"):
                norm = getattr(layer.self_attn, name, None)
                if norm is not None:
                    norm.weight.fill_(0.3)
    return model


#: Each family's builder, by the name the tests know it by.
EXPERT_BUILDERS: dict[str, Callable[[], Any]] = {
    "qwen3_moe": _qwen3_moe,
    "gpt_oss": _gpt_oss,
    "llama4": _llama4,
    "granitemoe_swa": _granitemoe_swa,
    "afmoe": _afmoe,
    "mimo_v2_flash": _mimo_v2_flash,
    "gemma4": _gemma4,
    "gemma4_moe": _gemma4_moe,
}
