"""Tiny random-weight checkpoints, written with transformers (``save_pretrained``): real
model folders for tests, made in a moment and without a download.

``save_tiny(name, folder)`` writes one of :data:`TINY_ARCHITECTURES` (every architecture
the suite compares with transformers: Llama, Gemma 2 and 3 with windows, Mamba2 hybrids
with and without experts, and the families of ``tiny_families.py``,
``tiny_expert_families.py``, ``tiny_state_families.py`` and ``tiny_latent_families.py``);
``make gpu-check`` runs each on the GPU against the CPU.
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
from hybridkv.testing.tiny_expert_families import EXPERT_BUILDERS
from hybridkv.testing.tiny_families import COMMON, FAMILY_BUILDERS, WINDOW
from hybridkv.testing.tiny_latent_families import LATENT_BUILDERS
from hybridkv.testing.tiny_state_families import STATE_BUILDERS


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
_GEMMA3_ROPE: dict[str, Any] = {
    "rope_theta": 100_000.0,
    "rope_local_base_freq": 500.0,
    "rope_scaling": {"rope_type": "linear", "factor": 8.0},
}


def _llama() -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        **COMMON,
        num_hidden_layers=4,
        num_key_value_heads=2,
        **_LLAMA_ROPE,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config)


def _gemma2() -> Any:
    from transformers import Gemma2Config, Gemma2ForCausalLM

    config = Gemma2Config(
        **COMMON,
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
        **COMMON,
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
        **COMMON, **_MAMBA2, num_hidden_layers=4, num_key_value_heads=2, attn_layer_indices=[1]
    )
    return BambaForCausalLM(config)


def _granite(**fields: Any) -> Any:
    from transformers import GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM

    m, a = "mamba", "attention"
    config = GraniteMoeHybridConfig(
        **{**COMMON, **_MAMBA2, **fields},
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
    **FAMILY_BUILDERS,
    **EXPERT_BUILDERS,
    **STATE_BUILDERS,
    **LATENT_BUILDERS,
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

    torch.manual_seed(seed)  # builders that draw at init (Qwen3-Next's A_log) draw alike
    return save_redrawn(TINY_ARCHITECTURES[name](), folder, seed=seed)


def save_redrawn(model: Any, folder: Path, *, seed: int = 0) -> Path:
    """Save the transformers ``model`` into ``folder`` as :func:`save_tiny` does, every
    weight redrawn around its own mean first (and the experts' selection biases, which
    transformers keeps as buffers of zeros); return the folder."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            noise = torch.randn(param.shape, generator=generator) * 0.1
            param.copy_(param.mean() + noise)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(torch.randn(buffer.shape, generator=generator) * 0.1)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    return folder
