"""What every family reads the same way from config.json: the trunk's sizes, its
end-of-sequence tokens, and the per-layer specs (``hybridkv.models.specs``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hybridkv.memory.layout import AttentionSpec, ModelLayer
from hybridkv.models.config import eos_ids
from hybridkv.models.hf_config import flag_field, float_field, int_field, text_config
from hybridkv.models.kinds import PolicyChoices
from hybridkv.models.specs import layer_specs_from_config


def common_fields(
    hf: Mapping[str, Any],
    *,
    dtype_bytes: int = 2,
    policies: PolicyChoices | None = None,
    mlp: bool = True,
) -> dict[str, Any]:
    """The fields every architecture reads the same way, the per-layer specs included.

    Args:
        hf: The config.json dict.
        dtype_bytes: Bytes per cached K/V value, for the layer specs.
        policies: Per layer kind, a memory policy chosen instead of the config's.
        mlp: Whether the layers have an MLP (``intermediate_size``); Mamba's have none.

    Raises:
        ModelConfigError: a missing or malformed field, named.
        PolicyError: a chosen policy that is not a MemoryPolicy.
    """
    cfg = text_config(hf)
    layers: list[ModelLayer] = layer_specs_from_config(cfg, dtype_bytes, policies=policies)
    attention = any(isinstance(s, AttentionSpec) for s in layers)
    return {
        "model_type": cfg["model_type"],
        "vocab_size": int_field(cfg, "vocab_size"),
        "hidden_size": int_field(cfg, "hidden_size"),
        "intermediate_size": int_field(cfg, "intermediate_size") if mlp else 0,
        "num_heads": int_field(cfg, "num_attention_heads") if attention else 0,
        "rms_norm_eps": float_field(cfg, "rms_norm_eps", 1e-6),
        "layers": layers,
        "tie_word_embeddings": flag_field(cfg, "tie_word_embeddings", False),
        "attention_bias": flag_field(cfg, "attention_bias", False),
        "max_position_embeddings": int_field(cfg, "max_position_embeddings", 2048),
        "eos_token_ids": eos_ids(cfg.get("eos_token_id")),
    }
