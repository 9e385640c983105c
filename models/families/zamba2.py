"""Zamba2: Mamba2 layers, and ``hybrid`` layers that run one of ``num_mem_blocks`` shared
attention blocks before their Mamba2 (``models/blocks/shared_block.py``).

A Mamba2 layer is ``out = x + mamba(norm(x))``. A hybrid layer's block reads the hidden
states beside the token embeddings (``2 x hidden`` wide: heads of ``2 x hidden / heads``,
scores scaled by ``(head_dim / 2) ** -0.5``), with rope only under ``use_mem_rope``, and
adds its own low-rank adapters (to q, k and v under ``use_shared_attention_adapter``; to
the MLP's gate and up always). A hybrid layer keeps
two memories: its use's K/V and its Mamba2's state (``AttentionSpec.beside``). The
checkpoint holds each block under its first use; the loader reads it for the others.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from hybridkv.models.config import ModelConfig
from hybridkv.models.errors import ModelConfigError
from hybridkv.models.families import Family
from hybridkv.models.families.llama import llama_fields
from hybridkv.models.hf_config import flag_field, int_field, renamed_fields
from hybridkv.models.kinds import FULL, HYBRID, MAMBA, PolicyChoices, named_kinds
from hybridkv.models.shapes.decoder import DecoderShape, SharedBlocks
from hybridkv.models.shapes.mamba2 import Mamba2Shape, mamba2_shape

#: Its config fields by the names ``mamba2_shape`` reads.
_FIELDS = {
    "n_mamba_heads": "mamba_n_heads",
    "mamba_ngroups": "mamba_n_groups",
    "chunk_size": "mamba_chunk_size",
    "add_bias_linear": "mamba_proj_bias",
}
_KINDS = {"mamba": MAMBA, "linear_attention": MAMBA, "hybrid": HYBRID}


def _normalize(hf: Mapping[str, Any]) -> Mapping[str, Any]:
    """transformers' derived fields and defaults: heads of ``2 x hidden / heads``, the
    MLP ``4 x hidden`` wide, tied embeddings, the time step clamped at ``time_step_min``,
    a convolution bias whatever ``use_conv_bias`` says (as transformers builds it)."""
    cfg = renamed_fields(hf, _FIELDS)
    hidden, heads = int_field(hf, "hidden_size"), int_field(hf, "num_attention_heads", 32)
    cfg["num_attention_heads"] = heads
    cfg["head_dim"] = 2 * hidden // heads
    cfg["intermediate_size"] = hf.get("intermediate_size") or 4 * hidden
    cfg["tie_word_embeddings"] = hf.get("tie_word_embeddings", True)
    cfg["hidden_act"] = hf.get("hidden_act", "gelu")
    cfg["mlp_bias"] = hf.get("add_bias_linear", False)
    cfg["mamba_conv_bias"] = True
    cfg["mamba_d_head"] = "auto"
    cfg["time_step_limit"] = (float(hf.get("time_step_min", 0.001)), float("inf"))
    return cfg


def zamba2_mamba(cfg: Mapping[str, Any]) -> Mamba2Shape:
    """Its Mamba2: transformers' defaults (8 heads, states of 64), its norm's epsilon 1e-5."""
    defaults = {"mamba_n_heads": 8, "mamba_d_state": 64, "mamba_n_groups": 1}
    return attrs.evolve(mamba2_shape({**defaults, **cfg}), norm_eps=1e-5)


def _blocks(cfg: Mapping[str, Any], num_layers: int) -> SharedBlocks:
    kinds = _kinds(cfg, num_layers)
    return SharedBlocks(
        count=int_field(cfg, "num_mem_blocks", 1),
        uses=tuple(i for i, kind in enumerate(kinds) if kind == HYBRID),
        adapter_rank=int_field(cfg, "adapter_rank", 128),
        attention_adapters=flag_field(cfg, "use_shared_attention_adapter", False),
    )


def parse_zamba2(
    hf: Mapping[str, Any], *, dtype_bytes: int = 2, policies: PolicyChoices | None = None
) -> ModelConfig:
    """Read a Zamba2 config.json (normalized).

    Raises:
        ModelConfigError: adapters with fewer KV heads than query heads (transformers adds
            one adapter's output, as wide as the queries, to the keys and values too).
    """
    fields = llama_fields(hf, dtype_bytes=dtype_bytes, policies=policies)
    blocks = _blocks(hf, len(fields["layers"]))
    kv_heads = int_field(hf, "num_key_value_heads", fields["num_heads"])
    if blocks.attention_adapters and kv_heads != fields["num_heads"]:
        raise ModelConfigError(
            f"Zamba2's adapters need num_key_value_heads equal to num_attention_heads, got "
            f"{kv_heads} and {fields['num_heads']}"
        )
    head_dim = int_field(hf, "head_dim")
    nope = frozenset() if flag_field(hf, "use_mem_rope", False) else frozenset(blocks.uses)
    return ModelConfig(
        **fields | {"query_scale": (head_dim / 2) ** -0.5},
        nope_layers=nope,
        mamba=zamba2_mamba(hf),
        attention_input_width=2 * int_field(hf, "hidden_size"),
        shared_blocks=blocks,
    )


def _kinds(cfg: Mapping[str, Any], num_layers: int) -> list[str]:
    """``layers_block_type`` (``layer_types``): Mamba2 or hybrid layers."""
    names = cfg.get("layers_block_type") or cfg.get("layer_types")
    if not isinstance(names, list):
        raise ModelConfigError("a Zamba2 config needs layers_block_type, a list")
    return named_kinds([str(n) for n in names], num_layers, _KINDS)


def _shared_weights(cfg: Mapping[str, Any]) -> dict[str, str]:
    """Each later use's block read from its first use's tensors."""
    blocks = _blocks(cfg, int_field(cfg, "num_hidden_layers"))
    prefix = "model.layers.{}.shared_transformer."
    return {
        prefix.format(use): prefix.format(blocks.owner(use))
        for use in blocks.uses
        if blocks.owner(use) != use
    }


FAMILY = Family(
    model_types=("zamba2",),
    layer_kinds=_kinds,
    parse=parse_zamba2,
    decoder=DecoderShape(mlp="none", mlp_norm=None),
    decoders={FULL: DecoderShape(residual="shared_block")},
    renames={"model.final_layernorm.weight": "model.norm.weight"},
    part_renames={".mamba_decoder.": "."},
    state_shape=zamba2_mamba,
    normalize=_normalize,
    shared_weights=_shared_weights,
)
