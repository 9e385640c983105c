"""How a family's decoder layer is put together: its residual shape and the checkpoint
names of its parts (torch-free; ``hybridkv.models.blocks.decoder`` builds the layer).

Every layer has one mixer (paged attention as ``self_attn``, or a state mixer, by its
spec) and an MLP (but Mamba's blocks: ``mlp="none"``), each normalised before, after, or
both::

    pre_norm    h = x + m * mixer(norm(x));        out = h + m * mlp(norm(h))
    sandwich    h = x + norm(mixer(norm(x)));      out = h + norm(mlp(norm(h)))
    post_norm   h = x + norm(mixer(x));            out = h + norm(mlp(h))      (OLMo 2/3)
    parallel    n = norm(x);                       out = x + mixer(n) + mlp(n) (Cohere)
    from_norm   n = norm(x); h = a n + b mixer(n); m = norm(h); out = a' m + b' mlp(m)
                                                                       (MiniMax)

with ``m`` the config's ``residual_multiplier`` (1 but for Granite), and ``a``, ``b`` the
config's ``residual_scales`` of the layer's kind (``a'``, ``b'``: of ``mlp``). A layer of
a shared block (Zamba2's ``hybrid`` layers, ``SharedBlocks``) is put together otherwise::

    shared_block  t = linear(block(cat(x, e)));   out = x + mamba(norm(x + t))
                  block(y) = mlp(norm(attention(norm(y))))      (e: the token embeddings)

and a layer of hyper-connections (DeepSeek V4's: ``HyperConnections``) carries ``n``
residual streams ``X`` ``[n, hidden]``, each sublayer reading a weighted sum of them and
writing back to each, the streams mixed by a doubly stochastic matrix::

    hyper       pre, post, comb = hc(X);   X' = post * sublayer(norm(pre . X)) + comb^T X
"""

from __future__ import annotations

from typing import Literal

import attrs

Residual = Literal[
    "pre_norm", "sandwich", "post_norm", "parallel", "from_norm", "shared_block", "hyper"
]
#: ``gated``: one gated MLP. ``shared_and_experts``: Granite's shared MLP
#: (``shared_mlp``) plus, where the config has experts, the mixture (``block_sparse_moe``).
#: ``experts``: the mixture under ``mlp_name``, a gated MLP in the config's dense layers.
#: ``dense_and_experts``: Gemma 4's gated MLP (``mlp``) and, where the config has experts,
#: the mixture beside it (``router`` and ``experts`` in the checkpoint): the MLP's output
#: normalised by ``post_feedforward_layernorm_1``, the mixture's input by
#: ``pre_feedforward_layernorm_2`` and its output by ``post_feedforward_layernorm_2``,
#: its router reading the layer's input to the MLP before any norm; their sum is the
#: output ``post_mlp_norm`` normalises.
#: ``none``: no MLP, the layer is its mixer alone (Mamba's, Mamba2's blocks: ``mlp_norm``
#: None).
MLPKind = Literal["gated", "shared_and_experts", "experts", "dense_and_experts", "none"]


@attrs.frozen(kw_only=True)
class DecoderShape:
    """A decoder layer's residual shape and the names its checkpoint gives its parts.

    Attributes:
        residual: ``pre_norm``, ``sandwich``, ``post_norm``, ``parallel`` or ``from_norm``
            (see the module; ``parallel`` names one norm, ``mixer_norm``).
        mixer_norm: The norm before the mixer (not ``post_norm``).
        mlp_norm: The norm before the MLP (not ``post_norm``).
        post_mixer_norm: The norm of the mixer's output (not ``pre_norm``).
        post_mlp_norm: The norm of the MLP's output (not ``pre_norm``).
        mlp: The MLP's kind.
        mlp_name: The gated MLP's name.
        mixer_name: The mixer's name whatever its kind (Nemotron-H's ``mixer``: attention,
            Mamba2, or an MLP in the layers that keep nothing); None: by its kind
            (``self_attn``, or the state kind's name in ``kinds.STATE_KINDS``).
    """

    residual: Residual = "pre_norm"
    mixer_norm: str | None = "input_layernorm"
    mlp_norm: str | None = "post_attention_layernorm"
    post_mixer_norm: str | None = None
    post_mlp_norm: str | None = None
    mlp: MLPKind = "gated"
    mlp_name: str = "mlp"
    mixer_name: str | None = None

    def __attrs_post_init__(self) -> None:
        if self.mlp == "none":
            if self.residual != "pre_norm" or self.mlp_norm is not None or self.mixer_norm is None:
                raise ValueError(f"a layer without an MLP is pre-norm, one norm: {self!r}")
            return
        before = self.mixer_norm is not None and self.mlp_norm is not None
        after = self.post_mixer_norm is not None and self.post_mlp_norm is not None
        if self.residual == "parallel":
            if self.mixer_norm is None or self.mlp_norm is not None or after:
                raise ValueError(f"a parallel layer names one norm, its input's: {self!r}")
            return
        if self.residual == "shared_block":
            return  # its parts are named by the block (``blocks/shared_block.py``)
        expected = {
            "pre_norm": (True, False),
            "sandwich": (True, True),
            "from_norm": (True, False),
            "hyper": (True, False),
        }
        if (before, after) != expected.get(self.residual, (False, True)):
            raise ValueError(f"a {self.residual} layer names other norms: {self!r}")


#: Llama's layer: pre-norm, ``mlp``.
PRE_NORM = DecoderShape()
#: Gemma's layer: each sublayer's input and output normalised.
SANDWICH = DecoderShape(
    residual="sandwich",
    post_mixer_norm="post_attention_layernorm",
    mlp_norm="pre_feedforward_layernorm",
    post_mlp_norm="post_feedforward_layernorm",
)
#: Cohere's layer: one norm, the mixer and the MLP side by side.
PARALLEL = DecoderShape(residual="parallel", mlp_norm=None)
#: OLMo 2/3's and EXAONE 4's layer: each sublayer's output normalised, not its input.
POST_NORM = DecoderShape(
    residual="post_norm",
    mixer_norm=None,
    mlp_norm=None,
    post_mixer_norm="post_attention_layernorm",
    post_mlp_norm="post_feedforward_layernorm",
)


@attrs.frozen(kw_only=True)
class PerLayerInputs:
    """Gemma 4's per-layer inputs (PLE): each token gets, for every layer, a vector of
    ``width`` from a packed embedding (``embed_tokens_per_layer``, ``vocab_size`` rows,
    scaled by ``sqrt(width)``) averaged with a normalised projection of its embedding
    (``per_layer_model_projection``); a layer multiplies its vector into a gated
    projection of its output (``per_layer_input_gate``, ``per_layer_projection``,
    ``post_per_layer_input_norm``) and adds that to the residual.

    Attributes:
        width: Values per token per layer.
        vocab_size: Rows of the per-layer embedding.
    """

    width: int
    vocab_size: int


@attrs.frozen(kw_only=True)
class SharedBlocks:
    """Zamba2's shared attention blocks: ``count`` blocks of attention and MLP whose
    weights serve every layer of ``uses`` in turn (use ``j`` runs block ``j % count``),
    each use with a KV cache of its own and low-rank adapters of its own added to the
    block's gate/up projection and, with ``attention_adapters``, to its q, k and v. A block
    reads the hidden states beside the token embeddings (``2 x hidden`` wide).

    Attributes:
        count: Blocks (``num_mem_blocks``).
        uses: The layers that run a block, in order (the ``hybrid`` layers).
        adapter_rank: The adapters' rank.
        attention_adapters: q, k and v have adapters (``use_shared_attention_adapter``).
    """

    count: int
    uses: tuple[int, ...]
    adapter_rank: int
    attention_adapters: bool = False

    def owner(self, layer: int) -> int:
        """The layer whose checkpoint tensors hold the weights ``layer``'s block runs."""
        return self.uses[self.uses.index(layer) % self.count]


@attrs.frozen(kw_only=True)
class HyperConnections:
    """DeepSeek V4's manifold-constrained hyper-connections (mHC): ``streams`` residual
    streams per token. Before each sublayer a projection of the normalised streams
    (``attn_hc``, ``ffn_hc``: ``fn``, ``base``, ``scale``) gives the weights that sum
    them into the sublayer's input (``pre``), spread its output over them (``post``),
    and mix them (``comb``, made doubly stochastic by ``sinkhorn_iters`` rounds of
    Sinkhorn-Knopp); the model's head sums them the same way (``hc_head``) before the
    final norm.

    Attributes:
        streams: Residual streams a token carries (``hc_mult``).
        sinkhorn_iters: Rounds of the normalisation (``hc_sinkhorn_iters``).
        eps: Added to every weight and normaliser (``hc_eps``).
    """

    streams: int
    sinkhorn_iters: int
    eps: float
