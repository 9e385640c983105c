"""Configs shaped like public checkpoints, for ``hybridkv plan NAME`` without a download:
config.json fields as the hub's releases have them (only those the layer specs read), and
nothing else (``models/specs.py`` reads them as any config)."""

from __future__ import annotations

from typing import Any

_GPT_OSS_20B: dict[str, Any] = {
    "model_type": "gpt_oss",
    "num_hidden_layers": 24,
    "hidden_size": 2880,
    "intermediate_size": 2880,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "sliding_window": 128,
    "num_local_experts": 32,
    "num_experts_per_tok": 4,
}

#: Configs shaped like public checkpoints, for ``hybridkv plan NAME`` without a download.
BUILTIN_CONFIGS: dict[str, dict[str, Any]] = {
    # Gemma 3 1B: 26 layers, 5 sliding (window 512) to 1 full, one KV head of 256.
    "gemma3-like": {
        "model_type": "gemma3_text",
        "num_hidden_layers": 26,
        "hidden_size": 1152,
        "num_attention_heads": 4,
        "num_key_value_heads": 1,
        "head_dim": 256,
        "sliding_window": 512,
        "sliding_window_pattern": 6,
    },
    # Gemma 2 2B: 26 layers alternating sliding (window 4096) and full, 4 KV heads of 256.
    "gemma2-like": {
        "model_type": "gemma2",
        "num_hidden_layers": 26,
        "hidden_size": 2304,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "sliding_window": 4096,
    },
    # Llama 3 8B: 32 full-attention layers, 8 KV heads of 128.
    "llama-like": {
        "model_type": "llama",
        "num_hidden_layers": 32,
        "hidden_size": 4096,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
    },
    # Qwen3 8B: 36 full-attention layers, 8 KV heads of 128.
    "qwen3-8b-like": {
        "model_type": "qwen3",
        "num_hidden_layers": 36,
        "hidden_size": 4096,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
    },
    # Qwen3 30B-A3B: 48 full-attention layers, 4 KV heads of 128, 128 experts (8 a token).
    "qwen3-30b-a3b-like": {
        "model_type": "qwen3_moe",
        "num_hidden_layers": 48,
        "hidden_size": 2048,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 768,
    },
    # Qwen2.5 7B: 28 full-attention layers, 4 KV heads of 128.
    "qwen2.5-7b-like": {
        "model_type": "qwen2",
        "num_hidden_layers": 28,
        "hidden_size": 3584,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
    },
    # Mistral Small 3.2 (24B): 40 full-attention layers, 8 KV heads of 128.
    "mistral-small-3.2-like": {
        "model_type": "mistral",
        "num_hidden_layers": 40,
        "hidden_size": 5120,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "sliding_window": None,
    },
    # Phi-4-mini: 32 full-attention layers, 8 KV heads of 128 (its LongRoPE does not run
    # here yet: sized only).
    "phi-4-mini-like": {
        "model_type": "phi3",
        "num_hidden_layers": 32,
        "hidden_size": 3072,
        "num_attention_heads": 24,
        "num_key_value_heads": 8,
    },
    # Command A: 64 layers, 3 sliding (window 4096) to 1 full, 8 KV heads of 128.
    "command-a-like": {
        "model_type": "cohere2",
        "num_hidden_layers": 64,
        "hidden_size": 12288,
        "num_attention_heads": 96,
        "num_key_value_heads": 8,
        "sliding_window": 4096,
    },
    # SmolLM3 3B: 36 full-attention layers (every 4th without rope), 4 KV heads of 128.
    "smollm3-3b-like": {
        "model_type": "smollm3",
        "num_hidden_layers": 36,
        "hidden_size": 2048,
        "num_attention_heads": 16,
        "num_key_value_heads": 4,
    },
    # OLMo 3 7B: 32 layers, 3 sliding (window 4096) to 1 full, 32 KV heads of 128.
    "olmo3-7b-like": {
        "model_type": "olmo3",
        "num_hidden_layers": 32,
        "hidden_size": 4096,
        "num_attention_heads": 32,
        "num_key_value_heads": 32,
        "sliding_window": 4096,
    },
    # EXAONE 4.0 32B: 64 layers, LLLG (3 sliding of 4096 to 1 full), 8 KV heads of 128.
    "exaone4-32b-like": {
        "model_type": "exaone4",
        "num_hidden_layers": 64,
        "hidden_size": 5120,
        "num_attention_heads": 40,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "sliding_window": 4096,
        "sliding_window_pattern": "LLLG",
    },
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
    # gpt-oss-20b: 24 layers, sliding (window 128) and full alternating, 8 KV heads of 64,
    # 32 experts (4 a token).
    "gpt-oss-20b-like": _GPT_OSS_20B,
    # gpt-oss-120b: 36 layers of gpt-oss-20b's shape, 128 experts.
    "gpt-oss-120b-like": _GPT_OSS_20B | {"num_hidden_layers": 36, "num_local_experts": 128},
    # Llama 4 Scout (17B-16E): 48 layers, chunked (8,192) in the 36 that rotate, full
    # without rope in every 4th, 8 KV heads of 128, 16 experts (1 a token) beside a shared one.
    "llama4-scout-like": {
        "model_type": "llama4_text",
        "num_hidden_layers": 48,
        "hidden_size": 5120,
        "num_attention_heads": 40,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "attention_chunk_size": 8192,
        "no_rope_layer_interval": 4,
        "num_local_experts": 16,
        "num_experts_per_tok": 1,
    },
    # MiMo-V2-Flash: 48 layers, the first and every 6th full (4 KV heads), the other 39
    # sliding (window 128 plus the query, 8 KV heads); keys of 192, values of 128 (cached
    # at 192 here), 256 experts (8 a token).
    "mimo-v2-flash-like": {
        "model_type": "mimo_v2_flash",
        "num_hidden_layers": 48,
        "hidden_size": 4096,
        "num_attention_heads": 64,
        "num_key_value_heads": 4,
        "head_dim": 192,
        "v_head_dim": 128,
        "sliding_window": 129,
        "n_routed_experts": 256,
        "num_experts_per_tok": 8,
    },
    # Gemma 4 31B (its largest): 60 layers, 5 sliding (window 1024, 16 KV heads of 256)
    # to 1 full (4 KV heads of 512, values the keys' projection).
    "gemma-4-31b-like": {
        "model_type": "gemma4_text",
        "num_hidden_layers": 60,
        "hidden_size": 5376,
        "num_attention_heads": 32,
        "num_key_value_heads": 16,
        "head_dim": 256,
        "global_head_dim": 512,
        "num_global_key_value_heads": 4,
        "attention_k_eq_v": True,
        "sliding_window": 1024,
        "num_kv_shared_layers": 0,
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
    # Gemma 4 E4B: 42 layers, 5 sliding (window 512, 2 KV heads of 256) to 1 full (2 of
    # 512); the last 18 read the caches of the last earlier layer of their kind.
    "gemma-4-e4b-like": {
        "model_type": "gemma4_text",
        "num_hidden_layers": 42,
        "hidden_size": 2560,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 256,
        "global_head_dim": 512,
        "sliding_window": 512,
        "num_kv_shared_layers": 18,
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
}
