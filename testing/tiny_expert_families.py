"""Tiny random-weight models of the families with experts or Gemma 4's new parts (shared
KV layers, per-layer inputs), as transformers builds them: ``hybridkv.testing.tiny_models``
saves them beside those of ``tiny_families.py``."""

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


def _qwen3_next() -> Any:
    """Qwen3-Next: three Gated DeltaNet layers (4 value heads of 16 over 2 key heads of 8,
    a conv of 4) to one gated full attention layer with rope on a quarter of each head;
    experts (4, two a token) beside a gated shared expert, a dense first layer."""
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    config = Qwen3NextConfig(**_qwen3_next_fields(), num_experts=4, num_experts_per_tok=2,
                             moe_intermediate_size=16, shared_expert_intermediate_size=32,
                             mlp_only_layers=[0])  # fmt: skip
    return Qwen3NextForCausalLM(config)


def _qwen3_5() -> Any:
    """Qwen3.5 (text): Qwen3-Next's mixers with Qwen3.5's projections, a dense MLP."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    return Qwen3_5ForCausalLM(Qwen3_5TextConfig(**_qwen3_next_fields()))


def _qwen3_5_moe() -> Any:
    """Qwen3.5-MoE (text): Qwen3.5's mixers, experts (4, two a token) in every layer beside
    a gated shared expert."""
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    fields = {k: v for k, v in _qwen3_next_fields().items() if k != "intermediate_size"}
    experts: dict[str, Any] = {
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 16,
    }
    config = Qwen3_5MoeTextConfig(**fields, **experts, shared_expert_intermediate_size=32)
    return Qwen3_5MoeForCausalLM(config)


def _olmo_hybrid() -> Any:
    """OLMo Hybrid: three DeltaNet layers (pre-norm, write rates up to 2) to a post-norm
    full attention layer without rope."""
    from transformers import OlmoHybridConfig, OlmoHybridForCausalLM

    fields = {k: v for k, v in _qwen3_next_fields().items() if k != "head_dim"}
    return OlmoHybridForCausalLM(OlmoHybridConfig(**fields))


def _qwen3_next_fields() -> dict[str, Any]:
    return {
        **COMMON,
        "num_hidden_layers": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 8,
        "linear_value_head_dim": 16,
        "linear_conv_kernel_dim": 4,
        **NO_SPECIAL_TOKENS,
    }


def _lfm2() -> Any:
    """LFM2: short convolutions (3 taps) with full attention in layers 1 and 3, q/k norms,
    the MLP's width derived (2/3 of 144, up to a multiple of 32)."""
    from transformers import Lfm2Config, Lfm2ForCausalLM

    config = Lfm2Config(
        **{**COMMON, "intermediate_size": 144}, num_hidden_layers=4, num_key_value_heads=2,
        full_attn_idxs=[1, 3], conv_L_cache=3, block_multiple_of=32,
        block_ffn_dim_multiplier=1.0, norm_eps=1e-5, **NO_SPECIAL_TOKENS,
    )  # fmt: skip
    return Lfm2ForCausalLM(config)


def _lfm2_moe() -> Any:
    """LFM2-MoE: LFM2's mixers, a dense first layer, then experts (4, two a token) chosen
    by sigmoid scores plus a learned bias, scaled."""
    from transformers import Lfm2MoeConfig, Lfm2MoeForCausalLM

    config = Lfm2MoeConfig(
        **COMMON, num_hidden_layers=4, num_key_value_heads=2,
        layer_types=["conv", "full_attention"] * 2,
        conv_L_cache=3, num_dense_layers=1, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=16, routed_scaling_factor=1.5, norm_eps=1e-5,
        **NO_SPECIAL_TOKENS,
    )  # fmt: skip
    model = Lfm2MoeForCausalLM(config)
    import torch

    with torch.no_grad():  # the selection bias is a buffer the redraw leaves at zero
        for layer in model.model.layers[1:]:
            layer.feed_forward.expert_bias.copy_(torch.tensor([0.3, -0.2, 0.1, 0.0]))
    return model


def _lfm3() -> Any:
    """LFM3: short convolutions (3 taps), a sliding window of 8 and full attention (its rope
    proportional over half of each head), a gate per head, sandwich norms."""
    from transformers import Lfm3Config, Lfm3ForCausalLM

    config = Lfm3Config(
        **COMMON, num_hidden_layers=5, num_key_value_heads=2, head_dim=16,
        layer_types=["conv", "sliding_attention", "full_attention", "conv", "sliding_attention"],
        sliding_window=WINDOW, conv_L_cache=3, norm_eps=1e-5, **NO_SPECIAL_TOKENS,
    )  # fmt: skip
    return Lfm3ForCausalLM(config)


def _jamba() -> Any:
    """Jamba: Mamba1 layers (8 states, a conv of 4, time steps of rank 4) with attention at
    layer 1 of every 2, experts (4, two a token) in every second layer."""
    from transformers import JambaConfig, JambaForCausalLM

    config = JambaConfig(
        **COMMON, num_hidden_layers=4, num_key_value_heads=2, attn_layer_period=2,
        attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1, num_experts=4,
        num_experts_per_tok=2, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2,
        mamba_dt_rank=4, use_mamba_kernels=False, **NO_SPECIAL_TOKENS,
    )  # fmt: skip
    return JambaForCausalLM(config)


def _mamba_fields() -> dict[str, Any]:
    return {
        "vocab_size": 256, "hidden_size": 64, "num_hidden_layers": 3, "state_size": 8,
        "conv_kernel": 4, "expand": 2, "layer_norm_epsilon": 1e-5, **NO_SPECIAL_TOKENS,
    }  # fmt: skip


def _mamba() -> Any:
    """Mamba: three Mamba1 blocks (8 states, a conv of 4), no attention, no MLP."""
    from transformers import MambaConfig, MambaForCausalLM

    return MambaForCausalLM(MambaConfig(**_mamba_fields(), time_step_rank=4))


def _falcon_mamba() -> Any:
    """Falcon-Mamba: Mamba's blocks, the time step, B and C normalised without weights."""
    from transformers import FalconMambaConfig, FalconMambaForCausalLM

    config = FalconMambaConfig(**_mamba_fields(), time_step_rank=4, mixer_rms_eps=1e-6)
    return FalconMambaForCausalLM(config)


def _mamba2() -> Any:
    """Mamba2: three Mamba2 blocks (8 heads of 16, two B/C groups, SSD chunks of 8)."""
    from transformers import Mamba2Config, Mamba2ForCausalLM

    config = Mamba2Config(**_mamba_fields(), num_heads=8, head_dim=16, n_groups=2, chunk_size=8)
    return Mamba2ForCausalLM(config)


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
    "qwen3_next": _qwen3_next,
    "qwen3_5": _qwen3_5,
    "qwen3_5_moe": _qwen3_5_moe,
    "olmo_hybrid": _olmo_hybrid,
    "jamba": _jamba,
    "lfm2": _lfm2,
    "lfm2_moe": _lfm2_moe,
    "lfm3": _lfm3,
    "mamba": _mamba,
    "falcon_mamba": _falcon_mamba,
    "mamba2": _mamba2,
}
