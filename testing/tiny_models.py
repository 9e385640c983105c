"""Tiny random-weight checkpoints, written with transformers (``save_pretrained``): real
model folders for tests, made in a moment and without a download.

``save_tiny(name, folder)`` writes one of :data:`TINY_ARCHITECTURES` (every architecture
the suite compares with transformers: Llama, Gemma 2 and 3 with windows, Mamba2 hybrids
with and without experts, Qwen2 and Qwen3 with sliding layers, Mistral, SmolLM3 with NoPE
layers, Seed-OSS with biases, OLMo 3 and EXAONE 4 with post-norm layers, Qwen3-MoE, Phi-3
with joined projections); ``make gpu-check`` runs each on the GPU against the CPU.
``save_tiny_llama(folder)`` writes a 2-layer Llama (64 wide, a vocabulary of the
257 ids of :func:`~hybridkv.testing.byte_tokenizer`, which it saves beside it), and
returns the folder; ``ModelExecutor.from_pretrained(folder, ...)`` and ``hybridkv serve
FOLDER`` load it like any checkpoint. Needs transformers (``pip install transformers``).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from hybridkv.testing.sample_tokenizers import BYTE_EOS, byte_tokenizer


def save_tiny_llama(folder: Path, *, num_layers: int = 2, seed: int = 0) -> Path:
    """A random Llama of ``num_layers`` layers with the byte tokenizer, in ``folder``
    (made if missing): config.json, model.safetensors, tokenizer.json.

    Raises:
        ModuleNotFoundError: transformers is not installed.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=BYTE_EOS + 1,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        eos_token_id=BYTE_EOS,
        bos_token_id=None,
        tie_word_embeddings=False,
    )
    generator = torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # norms too: ones would hide a wrong norm formula
        for param in model.parameters():
            param.normal_(0.0, 0.5, generator=generator)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    byte_tokenizer().save(str(folder / "tokenizer.json"))
    return folder


#: The sliding window of the tiny Gemma 2 and Gemma 3.
WINDOW = 8

_COMMON: dict[str, Any] = {
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_attention_heads": 4,
    "max_position_embeddings": 512,
    "rms_norm_eps": 1e-6,
}


# Rope fields as checkpoints write them (transformers takes them through **kwargs).
_LLAMA_ROPE: dict[str, Any] = {
    "rope_theta": 5000.0,
    "rope_scaling": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16,
    },
}
#: Special tokens past the tiny vocabulary (SmolLM3's defaults) would not embed.
_NO_SPECIAL_TOKENS: dict[str, Any] = {
    "pad_token_id": None,
    "bos_token_id": None,
    "eos_token_id": None,
}
#: Rope on 3/4 of each head.
_PHI3_ROPE: dict[str, Any] = {"partial_rotary_factor": 0.75}
#: OLMo 3's rope nested by layer kind, a base of its own for each.
_OLMO3_ROPE: dict[str, Any] = {
    "rope_parameters": {
        "full_attention": {"rope_type": "default", "rope_theta": 500_000.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 5_000.0},
    }
}
_GEMMA3_ROPE: dict[str, Any] = {
    "rope_theta": 100_000.0,
    "rope_local_base_freq": 500.0,
    "rope_scaling": {"rope_type": "linear", "factor": 8.0},
}


def _llama() -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        **_COMMON,
        num_hidden_layers=4,
        num_key_value_heads=2,
        **_LLAMA_ROPE,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config)


def _gemma2() -> Any:
    from transformers import Gemma2Config, Gemma2ForCausalLM

    config = Gemma2Config(
        **_COMMON,
        num_hidden_layers=4,
        num_key_value_heads=2,
        head_dim=32,
        sliding_window=WINDOW,
        query_pre_attn_scalar=24,
        attn_logit_softcapping=2.0,
        final_logit_softcapping=3.0,
    )
    return Gemma2ForCausalLM(config)


def _gemma3() -> Any:
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    s, f = "sliding_attention", "full_attention"
    config = Gemma3TextConfig(
        **_COMMON,
        num_hidden_layers=6,
        num_key_value_heads=1,
        head_dim=32,
        sliding_window=WINDOW,
        layer_types=[s, s, f, s, s, f],
        query_pre_attn_scalar=24,
        **_GEMMA3_ROPE,
        final_logit_softcapping=None,
    )
    return Gemma3ForCausalLM(config)


def _qwen2() -> Any:
    """Qwen2 with its two last layers sliding (``max_window_layers``)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        **_COMMON,
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
        **_COMMON,
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
        **_COMMON, num_hidden_layers=4, num_key_value_heads=2, sliding_window=WINDOW
    )
    return MistralForCausalLM(config)


def _smollm3() -> Any:
    """SmolLM3 with every second layer NoPE, and those layers sliding."""
    from transformers import SmolLM3Config, SmolLM3ForCausalLM

    config = SmolLM3Config(
        **_COMMON,
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
        **_COMMON,
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
        **_COMMON,
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
        **_COMMON,
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
        **_COMMON,
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
        **_COMMON,
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
        **_COMMON,
        num_hidden_layers=4,
        num_key_value_heads=2,
        sliding_window=WINDOW,
        logit_scale=0.25,
        **_NO_SPECIAL_TOKENS,
    )
    return Cohere2ForCausalLM(config)


#: Mamba2 fields of the tiny hybrids: SSD chunks of 8 positions, so prefills cross them;
#: a state of 3200 bytes, which an attention page of 16 tokens holds.
_MAMBA2: dict[str, Any] = {
    "mamba_n_heads": 4,
    "mamba_d_state": 8,
    "mamba_n_groups": 2,
    "mamba_d_conv": 4,
    "mamba_expand": 1,
    "mamba_chunk_size": 8,
}


def _bamba() -> Any:
    from transformers import BambaConfig, BambaForCausalLM

    config = BambaConfig(
        **_COMMON, **_MAMBA2, num_hidden_layers=4, num_key_value_heads=2, attn_layer_indices=[1]
    )
    return BambaForCausalLM(config)


def _granite(**fields: Any) -> Any:
    from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM

    m, a = "mamba", "attention"
    config = GraniteMoeHybridConfig(
        **{**_COMMON, **_MAMBA2, **fields},
        num_hidden_layers=4,
        num_key_value_heads=2,
        layer_types=[m, a, m, m],
        embedding_multiplier=2.0,
        residual_multiplier=0.5,
        attention_multiplier=0.2,
        logits_scaling=3.0,
    )
    return GraniteMoeHybridForCausalLM(config)


def _granite_moe() -> Any:
    """Granite 4.0-H with experts (4, two per token) beside the shared MLP, and rope."""
    return _granite(
        intermediate_size=32,
        shared_intermediate_size=96,
        num_local_experts=4,
        num_experts_per_tok=2,
        position_embedding_type="rope",
    )


def _granite_dense() -> Any:
    """Granite 4.0-H without experts and without position embeddings."""
    return _granite(shared_intermediate_size=96, num_local_experts=0)


#: Each architecture's builder of a fresh (untrained) transformers model.
TINY_ARCHITECTURES: dict[str, Callable[[], Any]] = {
    "llama": _llama,
    "gemma2": _gemma2,
    "gemma3": _gemma3,
    "bamba": _bamba,
    "granite_moe": _granite_moe,
    "granite_dense": _granite_dense,
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
}


def save_tiny(name: str, folder: Path, *, seed: int = 0) -> Path:
    """Write the tiny ``name`` of :data:`TINY_ARCHITECTURES` into ``folder`` (config.json,
    model.safetensors) with every weight redrawn around its own mean, norms included (a
    default 0 or 1 would hide a wrong ``1 + weight``), and return the folder.

    Raises:
        KeyError: ``name`` is not one of them.
        ModuleNotFoundError: transformers is not installed.
    """
    import torch

    model = TINY_ARCHITECTURES[name]()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            noise = torch.randn(param.shape, generator=generator) * 0.1
            param.copy_(param.mean() + noise)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    return folder
