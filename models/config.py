"""The model config: every number that changes logits, parsed once from config.json.

Each architecture file (``llama``, ``gemma2``, ``gemma3``) turns a Hugging Face config
dict into a :class:`ModelConfig`; the shared building blocks read only this.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from hybridkv.models.errors import ModelConfigError
from hybridkv.models.rope import RopeSpec
from hybridkv.models.specs import FULL, SLIDING


@attrs.frozen(kw_only=True)
class ModelConfig:
    """A decoder-only transformer, as far as inference needs to know.

    Attributes:
        model_type: The Hugging Face ``model_type``.
        vocab_size: Rows of the embedding and of the LM head.
        hidden_size: Width of the residual stream.
        intermediate_size: Width of the gated MLP.
        num_layers: Decoder layers.
        num_heads: Query heads.
        num_kv_heads: Key/value heads (GQA when fewer than query heads).
        head_dim: Width of one head.
        rms_norm_eps: Epsilon of every RMSNorm.
        norm_offset: RMSNorm multiplies by ``norm_offset + weight`` (Gemma: 1, Llama: 0).
        activation: ``silu`` or ``gelu_tanh``, applied to the MLP's gate.
        qk_norm: RMSNorm over the head dim of q and k before rope (Gemma 3).
        embed_scale: Multiply embeddings by this, cast to the model dtype, or None.
        query_scale: Attention score scale (``query_pre_attn_scalar ** -0.5`` for Gemma).
        attn_softcap: Soft-cap of attention scores, or None.
        final_softcap: Soft-cap of the output logits, or None.
        layer_types: Per layer, ``full_attention`` or ``sliding_attention``.
        sliding_window: Tokens a sliding layer sees, itself included.
        rope: Per layer type, its rope parameters.
        tie_word_embeddings: The LM head reuses the embedding matrix.
        attention_bias: q/k/v/o projections have biases.
        mlp_bias: MLP projections have biases.
        max_position_embeddings: Longest sequence the model supports.
        eos_token_ids: End-of-sequence tokens named by config.json.
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    norm_offset: float
    activation: str
    qk_norm: bool
    embed_scale: float | None
    query_scale: float
    attn_softcap: float | None
    final_softcap: float | None
    layer_types: tuple[str, ...]
    sliding_window: int | None
    rope: Mapping[str, RopeSpec] = attrs.field(hash=False)
    tie_word_embeddings: bool
    attention_bias: bool
    mlp_bias: bool
    max_position_embeddings: int
    eos_token_ids: tuple[int, ...]

    def __attrs_post_init__(self) -> None:
        if len(self.layer_types) != self.num_layers:
            raise ModelConfigError(
                f"layer_types has {len(self.layer_types)} entries, num_hidden_layers is "
                f"{self.num_layers}"
            )
        unknown = sorted(set(self.layer_types) - {FULL, SLIDING})
        if unknown:
            raise ModelConfigError(f"unsupported layer types {unknown}; known: {FULL}, {SLIDING}")
        if SLIDING in self.layer_types and (self.sliding_window or 0) < 1:
            raise ModelConfigError(
                f"sliding layers need sliding_window >= 1, got {self.sliding_window}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ModelConfigError(
                f"num_attention_heads={self.num_heads} is not a multiple of "
                f"num_key_value_heads={self.num_kv_heads}"
            )
        missing = sorted(set(self.layer_types) - set(self.rope))
        if missing:
            raise ModelConfigError(f"no rope parameters for layer types {missing}")

    def window_of(self, layer: int) -> int | None:
        """The sliding window of a layer, or None for full attention."""
        return self.sliding_window if self.layer_types[layer] == SLIDING else None


def eos_ids(value: object) -> tuple[int, ...]:
    """``eos_token_id`` of a config: an int, a list of ints, or absent."""
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)  # type: ignore[attr-defined]


def common_fields(hf: Mapping[str, Any]) -> dict[str, Any]:
    """The fields every architecture reads the same way from a Hugging Face config."""
    try:
        num_heads = int(hf["num_attention_heads"])
        hidden = int(hf["hidden_size"])
        return {
            "model_type": str(hf["model_type"]),
            "vocab_size": int(hf["vocab_size"]),
            "hidden_size": hidden,
            "intermediate_size": int(hf["intermediate_size"]),
            "num_layers": int(hf["num_hidden_layers"]),
            "num_heads": num_heads,
            "num_kv_heads": int(hf.get("num_key_value_heads") or num_heads),
            "head_dim": int(hf.get("head_dim") or hidden // num_heads),
            "rms_norm_eps": float(hf.get("rms_norm_eps", 1e-6)),
            "tie_word_embeddings": bool(hf.get("tie_word_embeddings", False)),
            "attention_bias": bool(hf.get("attention_bias", False)),
            "max_position_embeddings": int(hf.get("max_position_embeddings", 2048)),
            "eos_token_ids": eos_ids(hf.get("eos_token_id")),
        }
    except KeyError as exc:
        raise ModelConfigError(f"config.json lacks the field {exc.args[0]!r}") from None


def activation_of(name: str) -> str:
    """Map a Hugging Face activation name onto ours."""
    if name == "silu":
        return "silu"
    if name in ("gelu_pytorch_tanh", "gelu_tanh"):
        return "gelu_tanh"
    raise ModelConfigError(f"activation {name!r} is not supported; supported: silu, gelu_tanh")
