"""How a family's decoder layer is put together: its residual shape and the checkpoint
names of its parts (torch-free; ``hybridkv.models.blocks.decoder`` builds the layer).

Every layer has one mixer (paged attention as ``self_attn``, or Mamba2 as ``mamba``, by
its spec), a norm before it and one before the MLP::

    pre_norm    h = x + m * mixer(norm(x));        out = h + m * mlp(norm(h))
    sandwich    h = x + norm(mixer(norm(x)));      out = h + norm(mlp(norm(h)))

with ``m`` the config's ``residual_multiplier`` (1 but for Granite).
"""

from __future__ import annotations

from typing import Literal

import attrs

Residual = Literal["pre_norm", "sandwich"]
#: ``gated``: one gated MLP. ``shared_and_experts``: Granite's shared MLP
#: (``shared_mlp``) plus, where the config has experts, the mixture (``block_sparse_moe``).
MLPKind = Literal["gated", "shared_and_experts"]


@attrs.frozen(kw_only=True)
class DecoderShape:
    """A decoder layer's residual shape and the names its checkpoint gives its parts.

    Attributes:
        residual: ``pre_norm`` or ``sandwich`` (see the module).
        mixer_norm: The norm before the mixer.
        mlp_norm: The norm before the MLP.
        post_mixer_norm: The norm of the mixer's output (``sandwich`` only).
        post_mlp_norm: The norm of the MLP's output (``sandwich`` only).
        mlp: The MLP's kind.
        mlp_name: The gated MLP's name.
    """

    residual: Residual = "pre_norm"
    mixer_norm: str = "input_layernorm"
    mlp_norm: str = "post_attention_layernorm"
    post_mixer_norm: str | None = None
    post_mlp_norm: str | None = None
    mlp: MLPKind = "gated"
    mlp_name: str = "mlp"

    def __attrs_post_init__(self) -> None:
        sandwiched = self.post_mixer_norm is not None and self.post_mlp_norm is not None
        if sandwiched != (self.residual == "sandwich"):
            raise ValueError("a sandwich names both post norms, a pre-norm layer neither")


#: Llama's layer: pre-norm, ``mlp``.
PRE_NORM = DecoderShape()
#: Gemma's layer: each sublayer's input and output normalised.
SANDWICH = DecoderShape(
    residual="sandwich",
    post_mixer_norm="post_attention_layernorm",
    mlp_norm="pre_feedforward_layernorm",
    post_mlp_norm="post_feedforward_layernorm",
)
