"""Configs shaped like public checkpoints with state layers (Mamba1/2, Gated DeltaNet,
short convolutions, lightning attention), for ``hybridkv plan NAME``: config.json fields as
the hub's releases have them (only those the layer specs read). Part of
``published_shapes.BUILTIN_CONFIGS``."""

from __future__ import annotations

from typing import Any

#: The state hybrids of ``BUILTIN_CONFIGS``.
STATE_MIXER_CONFIGS: dict[str, dict[str, Any]] = {
    # Jamba v0.1: 32 layers, one attention layer in 8, the rest mamba.
    "jamba-like": {
        "model_type": "jamba",
        "num_hidden_layers": 32,
        "hidden_size": 4096,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "attn_layer_period": 8,
        "attn_layer_offset": 4,
        "mamba_d_state": 16,
        "mamba_d_conv": 4,
        "mamba_expand": 2,
    },
    # Bamba 9B: 32 layers, full attention in 3 (9, 18, 27), Mamba2 in the rest: 128 heads
    # of 64 channels, a state of 128, one group.
    "bamba-like": {
        "model_type": "bamba",
        "num_hidden_layers": 32,
        "hidden_size": 4096,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "attn_layer_indices": [9, 18, 27],
        "mamba_n_heads": 128,
        "mamba_d_head": 64,
        "mamba_d_state": 128,
        "mamba_n_groups": 1,
        "mamba_d_conv": 4,
        "mamba_expand": 2,
    },
    # Granite 4.0-H Micro: 40 layers, full attention in 4 of them, Mamba2 in the rest.
    "granite-4.0-h-like": {
        "model_type": "granitemoehybrid",
        "num_hidden_layers": 40,
        "hidden_size": 2048,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "layer_types": ["attention" if i % 10 == 9 else "mamba" for i in range(40)],
        "mamba_n_heads": 64,
        "mamba_d_head": 64,
        "mamba_d_state": 128,
        "mamba_n_groups": 1,
        "mamba_d_conv": 4,
        "mamba_expand": 2,
    },
    # Qwen3-Next-80B-A3B: 48 layers, 3 Gated DeltaNet (16 key heads, 32 value heads of
    # 128) to 1 full attention (2 KV heads of 256), 512 experts.
    "qwen3-next-80b-a3b-like": {
        "model_type": "qwen3_next",
        "num_hidden_layers": 48,
        "hidden_size": 2048,
        "num_attention_heads": 16,
        "num_key_value_heads": 2,
        "head_dim": 256,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 32,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_conv_kernel_dim": 4,
        "full_attention_interval": 4,
        "num_experts": 512,
        "num_experts_per_tok": 10,
    },
    # Qwen3.5-27B (text): 64 layers, 3 Gated DeltaNet (16 key heads, 48 value heads of
    # 128) to 1 full attention (4 KV heads of 256).
    "qwen3.5-27b-like": {
        "model_type": "qwen3_5_text",
        "num_hidden_layers": 64,
        "hidden_size": 5120,
        "num_attention_heads": 24,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 48,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_conv_kernel_dim": 4,
        "full_attention_interval": 4,
    },
    # OLMo Hybrid 7B (transformers' OlmoHybridConfig defaults): 32 layers, 3 Gated
    # DeltaNet (30 heads, keys of 96, values of 192) to 1 full attention (30 heads of 128).
    "olmo-hybrid-7b-like": {
        "model_type": "olmo_hybrid",
        "num_hidden_layers": 32,
        "hidden_size": 3840,
        "num_attention_heads": 30,
        "num_key_value_heads": 30,
        "linear_num_key_heads": 30,
        "linear_num_value_heads": 30,
        "linear_key_head_dim": 96,
        "linear_value_head_dim": 192,
        "linear_conv_kernel_dim": 4,
    },
    # LFM2-1.2B: 16 layers, short convolutions (3 taps) beside 6 full attention layers
    # (8 KV heads of 64).
    "lfm2-1.2b-like": {
        "model_type": "lfm2",
        "num_hidden_layers": 16,
        "hidden_size": 2048,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "conv_L_cache": 3,
        "full_attn_idxs": [2, 5, 8, 10, 12, 14],
    },
    # Nemotron-H 8B: 52 layers, 24 Mamba2 (128 heads of 64, 8 groups of 128 states), 4
    # attention (8 KV heads of 128, no rope) and 24 MLP layers that keep nothing.
    "nemotron-h-8b-like": {
        "model_type": "nemotron_h",
        "num_hidden_layers": 52,
        "hidden_size": 4096,
        "hybrid_override_pattern": "M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-",
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "intermediate_size": 21504,
        "mamba_num_heads": 128,
        "mamba_head_dim": 64,
        "ssm_state_size": 128,
        "n_groups": 8,
        "conv_kernel": 4,
        "chunk_size": 128,
    },
    # Nemotron 3 Nano 30B-A3B: 52 layers, 23 Mamba2 (64 heads of 64, 8 groups of 128
    # states) alternating with 23 of experts (128, six a token, beside a shared one), 6
    # of attention (2 KV heads of 128).
    "nemotron-3-nano-30b-a3b-like": {
        "model_type": "nemotron_h",
        "num_hidden_layers": 52,
        "hidden_size": 2688,
        "hybrid_override_pattern": "MEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEM*EMEMEMEM*EMEMEMEME",
        "num_attention_heads": 32,
        "num_key_value_heads": 2,
        "head_dim": 128,
        "intermediate_size": 1856,
        "mamba_num_heads": 64,
        "mamba_head_dim": 64,
        "ssm_state_size": 128,
        "n_groups": 8,
        "conv_kernel": 4,
        "chunk_size": 128,
        "n_routed_experts": 128,
        "num_experts_per_tok": 6,
        "moe_intermediate_size": 1856,
        "moe_shared_expert_intermediate_size": 3712,
        "routed_scaling_factor": 2.5,
    },
    # MiniMax-Text-01: 80 layers, 7 lightning attention (64 heads of 128) to 1 softmax
    # attention (8 KV heads of 128), 32 experts in every layer.
    "minimax-text-01-like": {
        "model_type": "minimax",
        "num_hidden_layers": 80,
        "hidden_size": 6144,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "layer_types": ["full_attention" if i % 8 == 7 else "linear_attention" for i in range(80)],
    },
    # Falcon-H1 7B: 44 layers, each full attention (2 KV heads of 128) beside a Mamba2
    # (24 heads of 128, one group of 256 states).
    "falcon-h1-7b-like": {
        "model_type": "falcon_h1",
        "num_hidden_layers": 44,
        "hidden_size": 3072,
        "num_attention_heads": 12,
        "num_key_value_heads": 2,
        "head_dim": 128,
        "mamba_d_ssm": 3072,
        "mamba_n_heads": 24,
        "mamba_d_head": 128,
        "mamba_n_groups": 1,
        "mamba_d_state": 256,
        "mamba_d_conv": 4,
    },
    # Zamba2 7B: 81 layers, Mamba2 (112 heads of 64, two groups of 64 states) in each, a
    # shared block (32 heads of 224 over the hidden states beside the embeddings) before
    # the Mamba2 of every sixth: two blocks in turn.
    "zamba2-7b-like": {
        "model_type": "zamba2",
        "num_hidden_layers": 81,
        "hidden_size": 3584,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "n_mamba_heads": 112,
        "mamba_d_state": 64,
        "mamba_ngroups": 2,
        "mamba_expand": 2,
        "mamba_d_conv": 4,
        "num_mem_blocks": 2,
        "use_shared_attention_adapter": True,
        "layers_block_type": ["hybrid" if i % 6 == 5 else "mamba" for i in range(81)],
    },
    # Kimi-Linear-48B-A3B: 27 layers, Kimi Delta Attention (32 heads of 128, a decay per
    # key channel) in 20, multi-head latent attention without rope (a latent of 512 beside
    # 64) in every fourth and the last, as the hub's config names them.
    "kimi-linear-48b-a3b-like": {
        "model_type": "kimi_linear",
        "num_hidden_layers": 27,
        "hidden_size": 2304,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "kv_lora_rank": 512,
        "q_lora_rank": None,
        "qk_rope_head_dim": 64,
        "qk_nope_head_dim": 128,
        "v_head_dim": 128,
        "model_max_length": 1048576,
        "linear_attn_config": {
            "kda_layers": [i for i in range(1, 28) if i % 4 and i != 27],
            "full_attn_layers": [4, 8, 12, 16, 20, 24, 27],
            "num_heads": 32,
            "head_dim": 128,
            "short_conv_kernel_size": 4,
        },
    },
}
