"""Models of state layers alone, no attention and no MLP: Mamba (``mamba``), Falcon-Mamba
(``falcon_mamba``: its time step, B and C RMS-normalised without weights) and Mamba2
(``mamba2``). Each block is ``out = x + mixer(norm(x))``; the checkpoint's ``backbone.``
names are read as ours, the config's fields under the names Jamba's and Bamba's give them
(``mamba1_shape``, ``mamba2_shape``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from hybridkv.models.config import ModelConfig
from hybridkv.models.families import Family
from hybridkv.models.families.common import common_fields
from hybridkv.models.hf_config import renamed_fields
from hybridkv.models.kinds import MAMBA, MAMBA1, PolicyChoices
from hybridkv.models.shapes.decoder import DecoderShape
from hybridkv.models.shapes.mamba1 import mamba1_shape
from hybridkv.models.shapes.mamba2 import mamba2_shape
from hybridkv.models.shapes.state import StateShape

#: The ``backbone.`` names of Mamba's checkpoints (and Nemotron-H's), as ours.
BACKBONE_RENAMES = {
    "backbone.embeddings.weight": "model.embed_tokens.weight",
    "backbone.norm_f.weight": "model.norm.weight",
}
BACKBONE_PARTS = {"backbone.layers.": "model.layers."}

#: Their config fields by the names ``mamba1_shape`` and ``mamba2_shape`` read.
_FIELDS = {
    "state_size": "mamba_d_state",
    "expand": "mamba_expand",
    "conv_kernel": "mamba_d_conv",
    "time_step_rank": "mamba_dt_rank",
    "use_conv_bias": "mamba_conv_bias",
    "use_bias": "mamba_proj_bias",
    "num_heads": "mamba_n_heads",
    "head_dim": "mamba_d_head",
    "n_groups": "mamba_n_groups",
    "chunk_size": "mamba_chunk_size",
    "layer_norm_epsilon": "rms_norm_eps",
}


def _normalize(hf: Mapping[str, Any]) -> Mapping[str, Any]:
    cfg = renamed_fields(hf, _FIELDS)
    if hf.get("model_type") != "mamba2":
        norm = "weightless" if hf.get("model_type") == "falcon_mamba" else "none"
        cfg["mamba_selection_norm"] = norm
    return cfg


def parse_mamba(
    hf: Mapping[str, Any], *, dtype_bytes: int = 2, policies: PolicyChoices | None = None
) -> ModelConfig:
    """Read a Mamba, Falcon-Mamba or Mamba2 config.json (normalized)."""
    mamba2 = hf["model_type"] == "mamba2"
    return ModelConfig(
        **common_fields(hf, dtype_bytes=dtype_bytes, policies=policies, mlp=False),
        norm_offset=0.0,
        activation="silu",
        qk_norm=False,
        embed_scale=None,
        query_scale=1.0,
        attn_softcap=None,
        final_softcap=None,
        rope={},
        mlp_bias=False,
        mamba=mamba2_shape(hf) if mamba2 else None,
        mamba1=None if mamba2 else mamba1_shape(hf),
    )


def _state_shape(cfg: Mapping[str, Any]) -> StateShape:
    return mamba2_shape(cfg) if cfg["model_type"] == "mamba2" else mamba1_shape(cfg)


FAMILY = Family(
    model_types=("mamba", "falcon_mamba", "mamba2"),
    layer_kinds=lambda cfg, n: [MAMBA if cfg["model_type"] == "mamba2" else MAMBA1] * n,
    parse=parse_mamba,
    decoder=DecoderShape(mixer_norm="norm", mlp_norm=None, mlp="none"),
    renames=BACKBONE_RENAMES,
    part_renames={**BACKBONE_PARTS, ".mixer.": ".mamba."},
    state_shape=_state_shape,
    normalize=_normalize,
)
