"""Tiny random-weight models of the dense attention families on the shared blocks (Qwen2
and on; those with experts: ``tiny_expert_families.py``), as transformers builds them:
``hybridkv.testing.tiny_models`` saves them.

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
NO_SPECIAL_TOKENS: dict[str, Any] = {
    "pad_token_id": None,
    "bos_token_id": None,
    "eos_token_id": None,
}
#: YaRN over a pretraining context of 64, so the ramp between kept and scaled
#: frequencies lies inside the tiny heads.
YARN: dict[str, Any] = {
    "rope_type": "yarn",
    "factor": 8.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 64,
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
        **NO_SPECIAL_TOKENS,
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
        **NO_SPECIAL_TOKENS,
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
        **NO_SPECIAL_TOKENS,
    )
    return Exaone4ForCausalLM(config)


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
        **NO_SPECIAL_TOKENS,
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
        **NO_SPECIAL_TOKENS,
    )
    return Cohere2ForCausalLM(config)


def _ministral3() -> Any:
    """Ministral 3: every layer sliding, YaRN with its mscales, queries scaled by position
    over a pretraining context of 16 (so the tests' prompts cross several steps)."""
    from transformers import Ministral3Config, Ministral3ForCausalLM

    rope = {**YARN, "original_max_position_embeddings": 16, "mscale": 1.0}
    config = Ministral3Config(
        **COMMON,
        num_hidden_layers=3,
        num_key_value_heads=2,
        head_dim=16,
        sliding_window=WINDOW,
        rope_parameters={**rope, "rope_theta": 10_000.0, "llama_4_scaling_beta": 0.3},
        **NO_SPECIAL_TOKENS,
    )
    return Ministral3ForCausalLM(config)


def granite_swa_fields() -> dict[str, Any]:
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
        **NO_SPECIAL_TOKENS,
    }


def _granite_swa() -> Any:
    """Granite SWA: its dense model."""
    from transformers import GraniteSWAConfig, GraniteSWAForCausalLM

    return GraniteSWAForCausalLM(GraniteSWAConfig(**granite_swa_fields()))


#: Each family's builder, by the name the tests know it by.
FAMILY_BUILDERS: dict[str, Callable[[], Any]] = {
    "qwen2": _qwen2,
    "qwen3": _qwen3,
    "mistral": _mistral,
    "smollm3": _smollm3,
    "seed_oss": _seed_oss,
    "olmo3": _olmo3,
    "exaone4": _exaone4,
    "phi3": _phi3,
    "cohere2": _cohere2,
    "ministral3": _ministral3,
    "granite_swa": _granite_swa,
}
