"""Configs shaped like public checkpoints, for ``hybridkv plan NAME`` without a download:
config.json fields as the hub's releases have them (only those the layer specs read), and
nothing else (``models/specs.py`` reads them as any config)."""

from __future__ import annotations

from typing import Any

from hybridkv.models.published_state_shapes import STATE_MIXER_CONFIGS

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

#: DeepSeek-V3's published shape, which V3.2 and Kimi K2 share.
_DEEPSEEK_V3: dict[str, Any] = {
    "model_type": "deepseek_v3",
    "num_hidden_layers": 61,
    "hidden_size": 7168,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "kv_lora_rank": 512,
    "q_lora_rank": 1536,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 128,
    "v_head_dim": 128,
    "num_nextn_predict_layers": 1,
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
    # DeepSeek-V3 (and R1): 61 layers of multi-head latent attention (128 heads over a
    # latent of 512 beside a rope key of 64: 576 values a token and layer).
    "deepseek-v3-like": _DEEPSEEK_V3,
    # DeepSeek-V3.2: DeepSeek V3's layers with a lightning indexer in each (64 heads of
    # 128, the best 2,048 keys a query), its keys a second memory of the layer.
    "deepseek-v3.2-like": {
        **_DEEPSEEK_V3,
        "model_type": "deepseek_v32",
        "index_n_heads": 64,
        "index_head_dim": 128,
        "index_topk": 2048,
    },
    # Kimi K2: DeepSeek V3's layers with 64 heads (the same latent).
    "kimi-k2-like": {
        **_DEEPSEEK_V3,
        "model_type": "kimi_k2",
        "num_attention_heads": 64,
        "num_key_value_heads": 64,
        "num_nextn_predict_layers": 0,  # K2 ships no MTP layer
    },
    # DeepSeek-V4 as its transformers config's defaults (V4-Flash): 43 layers, each a window
    # of 128 tokens of one 512-value vector; beside it entries of 4 tokens (CSA: an indexer
    # of 64 heads of 128 keeps the best 512) or of 128 (HCA), two HCA layers first, then
    # CSA and HCA alternating.
    "deepseek-v4-like": {
        "model_type": "deepseek_v4",
        "num_hidden_layers": 43,
        "hidden_size": 4096,
        "num_attention_heads": 64,
        "num_key_value_heads": 1,
        "head_dim": 512,
        "q_lora_rank": 1024,
        "o_groups": 8,
        "o_lora_rank": 1024,
        "sliding_window": 128,
        "index_n_heads": 64,
        "index_head_dim": 128,
        "index_topk": 512,
        "num_nextn_predict_layers": 1,
    },
    **STATE_MIXER_CONFIGS,
}
