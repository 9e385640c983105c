"""Tiny random-weight models of the attention families on the shared blocks (Qwen2 and
on), as transformers builds them: ``hybridkv.testing.tiny_models`` saves them.

Each builder returns a fresh (untrained) transformers model whose config exercises what
the family adds: windows, NoPE layers, biases, post-norms, experts, joined projections,
sinks, rope scalings.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

#: The sliding window of every tiny model with sliding layers.
WINDOW = 8

COMMON: dict[str, Any] = {
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_attention_heads": 4,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
}


#: Special tokens past the tiny vocabulary (SmolLM3's defaults) would not embed.
_NO_SPECIAL_TOKENS: dict[str, Any] = {
    "pad_token_id": None,
    "bos_token_id": None,
    "eos_token_id": None,
}
#: YaRN over a pretraining context of 64, so the ramp between kept and scaled
#: frequencies lies inside the tiny heads.
_YARN: dict[str, Any] = {
    "rope_type": "yarn",
    "factor": 8.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 64,
}
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
#: Rope on 3/4 of each head (6 frequencies), LongRoPE's short factors inside a
#: pretraining context of 256 (which the tests' prompts stay inside: beyond it
#: transformers rotates a whole forward by the long factors, this engine each position by
#: its own side), and its attention factor.
_PHI3_ROPE: dict[str, Any] = {
    "partial_rotary_factor": 0.75,
    "original_max_position_embeddings": 256,
    "rope_parameters": {
        "rope_type": "longrope",
        "rope_theta": 10_000.0,
        "short_factor": [1.0, 1.3, 1.9, 2.5, 4.0, 6.0],
        "long_factor": [2.0, 3.0, 5.0, 8.0, 13.0, 21.0],
    },
}
#: OLMo 3's rope nested by layer kind, a base of its own for each.
_OLMO3_ROPE: dict[str, Any] = {
    "rope_parameters": {
        "full_attention": {"rope_type": "default", "rope_theta": 500_000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 5_000.0},
    }
}


def _qwen2() -> Any:
    """Qwen2 with its two last layers sliding (``max_window_layers``)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        **COMMON,
        num_hidden_layers=4,
        num_key_value_heads=2,
        use_sliding_window=True,
        sliding_window=WINDOW,
        max_window_layers=2,
    )
    return Qwen2ForCausalLM(config)


def _qwen3() -> Any:
    """Qwen3 with a head dim wider than hidden / heads, and its last layer sliding."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        **COMMON,
        num_hidden_layers=4,
        num_key_value_heads=2,
        head_dim=32,
        use_sliding_window=True,
        sliding_window=WINDOW,
        max_window_layers=3,
        tie_word_embeddings=False,
    )
    return Qwen3ForCausalLM(config)


def _mistral() -> Any:
    """Mistral: every layer sliding."""
    from transformers import MistralConfig, MistralForCausalLM

    config = MistralConfig(
        **COMMON, num_hidden_layers=4, num_key_value_heads=2, sliding_window=WINDOW
    )
    return MistralForCausalLM(config)


def _smollm3() -> Any:
    """SmolLM3 with every second layer NoPE, and those layers sliding."""
    from transformers import SmolLM3Config, SmolLM3ForCausalLM

    config = SmolLM3Config(
        **COMMON,
        num_hidden_layers=4,
        num_key_value_heads=2,
        no_rope_layer_interval=2,
        use_sliding_window=True,
        sliding_window=WINDOW,
        **_NO_SPECIAL_TOKENS,
    )
    return SmolLM3ForCausalLM(config)


def _seed_oss() -> Any:
    """Seed-OSS with biases on q/k/v and on the output projection."""
    from transformers import SeedOssConfig, SeedOssForCausalLM

    config = SeedOssConfig(
        **COMMON,
        num_hidden_layers=3,
        num_key_value_heads=2,
        head_dim=32,
        attention_out_bias=True,
        attention_dropout=0.0,
        residual_dropout=0.0,
    )
    return SeedOssForCausalLM(config)


def _olmo3() -> Any:
    """OLMo 3: post-norm layers, q/k norms over the projection, 3 sliding to 1 full, a
    rope base per layer kind."""
    from transformers import Olmo3Config, Olmo3ForCausalLM

    config = Olmo3Config(
        **COMMON,
        num_hidden_layers=4,
        num_key_value_heads=2,
        sliding_window=WINDOW,
        **_OLMO3_ROPE,
        **_NO_SPECIAL_TOKENS,
    )
    return Olmo3ForCausalLM(config)


def _exaone4() -> Any:
    """EXAONE 4: post-norm layers, per-head q/k norms, 3 sliding to 1 full (NoPE)."""
    from transformers import Exaone4Config, Exaone4ForCausalLM

    config = Exaone4Config(
        **COMMON,
        num_hidden_layers=4,
        num_key_value_heads=2,
        sliding_window=WINDOW,
        sliding_window_pattern=4,
        **_NO_SPECIAL_TOKENS,
    )
    return Exaone4ForCausalLM(config)


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
        **_NO_SPECIAL_TOKENS,
    )
    return Qwen3MoeForCausalLM(config)


def _phi3() -> Any:
    """Phi-3: q/k/v and gate/up joined in the checkpoint, rope on 3/4 of each head, every
    layer sliding."""
    from transformers import Phi3Config, Phi3ForCausalLM

    config = Phi3Config(
        **COMMON,
        num_hidden_layers=3,
        num_key_value_heads=2,
        sliding_window=WINDOW,
        **_PHI3_ROPE,
        **_NO_SPECIAL_TOKENS,
    )
    return Phi3ForCausalLM(config)


def _cohere2() -> Any:
    """Command A's shape: parallel layers, LayerNorm, interleaved rope in the sliding
    layers only, a logit scale."""
    from transformers import Cohere2Config, Cohere2ForCausalLM

    config = Cohere2Config(
        **COMMON,
        num_hidden_layers=4,
        num_key_value_heads=2,
        sliding_window=WINDOW,
        logit_scale=0.25,
        **_NO_SPECIAL_TOKENS,
    )
    return Cohere2ForCausalLM(config)


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
        rope_parameters={**_YARN, "rope_theta": 10_000.0},
        **_NO_SPECIAL_TOKENS,
    )
    return GptOssForCausalLM(config)


def _ministral3() -> Any:
    """Ministral 3: every layer sliding, YaRN with its mscales, queries scaled by position
    over a pretraining context of 16 (so the tests' prompts cross several steps)."""
    from transformers import Ministral3Config, Ministral3ForCausalLM

    rope = {**_YARN, "original_max_position_embeddings": 16, "mscale": 1.0}
    config = Ministral3Config(
        **COMMON,
        num_hidden_layers=3,
        num_key_value_heads=2,
        head_dim=16,
        sliding_window=WINDOW,
        rope_parameters={**rope, "rope_theta": 10_000.0, "llama_4_scaling_beta": 0.3},
        **_NO_SPECIAL_TOKENS,
    )
    return Ministral3ForCausalLM(config)


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
        **_NO_SPECIAL_TOKENS,
    )
    return Llama4ForCausalLM(config)


def _granite_swa_fields() -> dict[str, Any]:
    """Granite's scalings, sinks, 3 sliding to 1 full, a rope base per layer (the first
    layer, full, without rope)."""
    return {
        **COMMON,
        "num_hidden_layers": 4,
        "num_key_value_heads": 2,
        "sliding_window": WINDOW,
        "layer_rope_theta": [0, 5_000.0, 5_000.0, 5_000.0],
        "embedding_multiplier": 2.0,
        "residual_multiplier": 0.5,
        "attention_multiplier": 0.2,
        "logits_scaling": 3.0,
        **_NO_SPECIAL_TOKENS,
    }


def _granite_swa() -> Any:
    """Granite SWA: its dense model."""
    from transformers import GraniteSWAConfig, GraniteSWAForCausalLM

    return GraniteSWAForCausalLM(GraniteSWAConfig(**_granite_swa_fields()))


def _granitemoe_swa() -> Any:
    """Granite MoE SWA: 4 experts, two a token, beside a shared MLP."""
    from transformers import GraniteMoeSWAConfig, GraniteMoeSWAForCausalLM

    fields = {**_granite_swa_fields(), "intermediate_size": 32, "shared_intermediate_size": 48}
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
        **_NO_SPECIAL_TOKENS,
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
        **_NO_SPECIAL_TOKENS,
    )
    return MiMoV2FlashForCausalLM(config)


#: Each family's builder, by the name the tests know it by.
FAMILY_BUILDERS: dict[str, Callable[[], Any]] = {
    "qwen2": _qwen2,
    "qwen3": _qwen3,
    "mistral": _mistral,
    "smollm3": _smollm3,
    "seed_oss": _seed_oss,
    "olmo3": _olmo3,
    "exaone4": _exaone4,
    "qwen3_moe": _qwen3_moe,
    "phi3": _phi3,
    "cohere2": _cohere2,
    "gpt_oss": _gpt_oss,
    "ministral3": _ministral3,
    "llama4": _llama4,
    "granite_swa": _granite_swa,
    "granitemoe_swa": _granitemoe_swa,
    "afmoe": _afmoe,
    "mimo_v2_flash": _mimo_v2_flash,
}
