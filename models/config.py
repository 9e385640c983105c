"""The model config: every number that changes logits, parsed once from config.json.

Each family (``hybridkv.models.families``) turns a Hugging Face config dict into a
:class:`ModelConfig`; the building blocks (``hybridkv.models.blocks``) read only this. Its layers
are the specs of ``hybridkv.models.specs``, the same values the layout planner sizes the
pool from, so a layer attends exactly what its pages keep.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any, Literal

import attrs

from hybridkv.memory.layout import AttentionSpec, ModelLayer, StateSpec, memories
from hybridkv.models.errors import ModelConfigError
from hybridkv.models.kinds import DELTANET, FULL, LIGHTNING, MAMBA, MAMBA1, SHORT_CONV, SLIDING
from hybridkv.models.shapes.compressed import COMPRESSOR, CompressedShape
from hybridkv.models.shapes.decoder import HyperConnections, PerLayerInputs, SharedBlocks
from hybridkv.models.shapes.deltanet import DeltaNetShape
from hybridkv.models.shapes.latent import LatentShape
from hybridkv.models.shapes.lightning import LightningShape
from hybridkv.models.shapes.mamba1 import Mamba1Shape
from hybridkv.models.shapes.mamba2 import Mamba2Shape
from hybridkv.models.shapes.moe import ExpertsShape
from hybridkv.models.shapes.rope import QueryTemperature, RopeSpec
from hybridkv.models.shapes.short_conv import ShortConvShape

__all__ = ["FULL", "SLIDING", "ModelConfig", "activation_of", "eos_ids"]


def _runnable_layers(instance: ModelConfig, attribute: attrs.Attribute[Any], value: Any) -> None:
    shapes = {
        MAMBA: instance.mamba,
        DELTANET: instance.deltanet,
        SHORT_CONV: instance.short_conv,
        MAMBA1: instance.mamba1,
        LIGHTNING: instance.lightning,
        COMPRESSOR: instance.compressed,
    }
    for spec in memories(value):
        if isinstance(spec, StateSpec) and shapes.get(str(spec.kind)) is None:
            raise ModelConfigError(
                f"layer {spec.name!r} is a {spec.kind or 'state'} layer, and only Mamba2 "
                "(Bamba, Granite 4.0-H), Mamba1 (Jamba), Gated DeltaNet (Qwen3-Next, "
                "Qwen3.5), short convolution (LFM2) and lightning attention (MiniMax) state "
                "layers run here"
            )


def _layers(layers: Iterable[ModelLayer]) -> tuple[ModelLayer, ...]:
    # A typed converter: mypy reads attrs' converter=tuple as taking Iterable[_T_co].
    return tuple(layers)


@attrs.frozen(kw_only=True)
class ModelConfig:
    """A decoder-only transformer, as far as inference needs to know.

    Attributes:
        model_type: The Hugging Face ``model_type``.
        vocab_size: Rows of the embedding and of the LM head.
        hidden_size: Width of the residual stream.
        intermediate_size: Width of the gated MLP (0 where the layers have none).
        num_heads: Query heads (0 in a model without attention: Mamba's).
        rms_norm_eps: Epsilon of every RMSNorm.
        norm_offset: RMSNorm multiplies by ``norm_offset + weight`` (Gemma: 1, Llama: 0).
        activation: ``silu``, ``gelu_tanh``, ``gelu`` (exact) or ``relu2`` (squared ReLU),
            applied to the MLP's gate (to its one projection where it has no gate:
            Nemotron-H).
        qk_norm: RMSNorm of q and k before rope (Gemma 3, Qwen3, OLMo).
        qk_norm_width: Over each head (``head``: Gemma 3, Qwen3) or over the whole
            projection, every head together (``projection``: OLMo 2/3).
        norm_scale_first: RMSNorm multiplies by its weight in float32, then casts back
            (Gemma, OLMo), rather than after (Llama); None: where ``norm_offset`` is set.
        embed_scale: Multiply embeddings by this, cast to the model dtype, or None.
        query_scale: Attention score scale (``query_pre_attn_scalar ** -0.5`` for Gemma).
        attn_softcap: Soft-cap of attention scores, or None.
        final_softcap: Soft-cap of the output logits, or None.
        layers: Per layer, its spec: kind, memory policy (what it keeps and attends), KV
            heads, head dim and cached bytes per value; a state spec for a Mamba2 layer.
        rope: Per layer kind, its rope parameters.
        tie_word_embeddings: The LM head reuses the embedding matrix.
        attention_bias: The q/k/v projections have biases.
        attention_out_bias: The output projection has a bias (by default: as q/k/v;
            Qwen2's has none).
        mlp_bias: MLP projections have biases.
        max_position_embeddings: Longest sequence the model supports.
        eos_token_ids: End-of-sequence tokens named by config.json.
        mamba: The Mamba2 mixer's shape, for models with Mamba2 layers; else None.
        deltanet: The Gated DeltaNet mixer's shape, for models with DeltaNet layers.
        short_conv: The short convolution's shape, for models with such layers (LFM2).
        mamba1: The Mamba1 mixer's shape, for models with Mamba1 layers (Jamba).
        lightning: The lightning attention's shape, for models with such layers (MiniMax).
        residual_scales: Per layer kind, and for ``mlp``, the scales ``(a, b)`` of a
            ``from_norm`` layer's residual and branch (MiniMax's alpha and beta factors).
        nope_layers: The attention layers that do not rotate q and k (NoPE: SmolLM3).
        norm_kind: ``rms`` (RMSNorm) or ``layer`` (LayerNorm without a bias: Cohere).
        rope_interleaved: Rope rotates pairs of adjacent channels (Cohere) rather than the
            two halves of a head; read by reordering q and k rows at load.
        residual_multiplier: Each block's output is scaled by it before the residual add
            (Granite).
        logits_scaling: Logits are divided by it (Granite).
        experts: The MoE layers' experts, or None for a dense MLP in every layer.
        attention_sinks: The layer kinds whose attention heads each have a learned sink
            logit (gpt-oss: every kind; MiMo-V2-Flash: the sliding layers).
        v_head_dim: Width of a value head where it differs from ``head_dim`` (MiMo-V2-Flash:
            128 beside 192); the cache keeps values at the key's width, zero-padded.
        value_scale: Values are multiplied by it before they are cached (MiMo-V2-Flash).
        rope_qk_l2_norm: After rope, each q and k head is divided by its root mean square,
            without a weight, in the layers that rotate (Llama 4's ``use_qk_norm``).
        query_temperature: Queries scaled by their position (Llama 4, Ministral 3), or None.
        attention_output_gate: Attention's output is multiplied by the sigmoid of a gate
            projection of the layer's input (``gate_proj``) before ``o_proj``: one gate per
            output channel (``channel``: AFMoE, Qwen3-Next) or per head (``head``: LFM3's
            ``g_proj``); ``none`` for no gate.
        value_norm: Each value head is RMS-normalised, without a weight, before it is
            cached (Gemma 4).
        values_from_keys: The layer kinds whose values are their key projection's output,
            before the key norm and rope (no ``v_proj``: Gemma 4's ``attention_k_eq_v``).
        per_layer_inputs: Each layer adds a gated projection of a per-layer embedding of
            the token to its output (Gemma 4's PLE), or None.
        layer_scalar: Each layer's output is multiplied by a learned scalar
            (``layer_scalar``: Gemma 4).
        wide_mlp_layers: The layers whose MLP is twice ``intermediate_size`` wide (Gemma
            4's KV-shared layers under ``use_double_wide_mlp``).
        attention_input_width: The width of attention's input where it is not
            ``hidden_size`` (Zamba2's shared blocks read the hidden states beside the token
            embeddings: twice as wide), or None.
        shared_blocks: Attention blocks whose weights serve several layers (Zamba2), or
            None.
        latent: The projections of the attention layers that cache one latent a token
            (multi-head latent attention: DeepSeek V3, Kimi K2), or None.
        compressed: The attention of DeepSeek V4 (a window beside compressed entries), or
            None.
        hyper: The residual streams of hyper-connections (DeepSeek V4), or None.
        mlp_limit: The gated MLPs' gate is clamped above and their up projection on both
            sides at it (DeepSeek V4's shared experts), or None.
        mtp_layers: The specs of the multi-token prediction layers loaded as the
            speculative proposer (``models/shapes/mtp.py``), empty where none are: the
            layout plans their memory after the decoder's (``planned_layers``).
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    rms_norm_eps: float
    norm_offset: float
    activation: str
    qk_norm: bool
    embed_scale: float | None
    query_scale: float
    attn_softcap: float | None
    final_softcap: float | None
    layers: tuple[ModelLayer, ...] = attrs.field(converter=_layers, validator=_runnable_layers)
    rope: Mapping[str, RopeSpec] = attrs.field(hash=False)
    tie_word_embeddings: bool
    attention_bias: bool
    attention_out_bias: bool = attrs.field(
        default=attrs.Factory(lambda self: self.attention_bias, takes_self=True)
    )
    mlp_bias: bool
    max_position_embeddings: int
    eos_token_ids: tuple[int, ...]
    mamba: Mamba2Shape | None = None
    deltanet: DeltaNetShape | None = None
    short_conv: ShortConvShape | None = None
    mamba1: Mamba1Shape | None = None
    lightning: LightningShape | None = None
    residual_scales: Mapping[str, tuple[float, float]] = attrs.field(factory=dict, hash=False)
    qk_norm_width: Literal["head", "projection"] = "head"
    norm_scale_first: bool | None = None
    nope_layers: frozenset[int] = frozenset()
    norm_kind: Literal["rms", "layer"] = "rms"
    rope_interleaved: bool = False
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0
    experts: ExpertsShape | None = None
    attention_sinks: frozenset[str] = frozenset()
    v_head_dim: int | None = None
    value_scale: float = 1.0
    rope_qk_l2_norm: bool = False
    query_temperature: QueryTemperature | None = None
    attention_output_gate: Literal["none", "channel", "head"] = "none"
    value_norm: bool = False
    values_from_keys: frozenset[str] = frozenset()
    per_layer_inputs: PerLayerInputs | None = None
    layer_scalar: bool = False
    wide_mlp_layers: frozenset[int] = frozenset()
    attention_input_width: int | None = None
    shared_blocks: SharedBlocks | None = None
    latent: LatentShape | None = None
    compressed: CompressedShape | None = None
    hyper: HyperConnections | None = None
    mlp_limit: float | None = None
    mtp_layers: tuple[ModelLayer, ...] = attrs.field(default=(), converter=_layers)

    def __attrs_post_init__(self) -> None:
        if not self.layers:
            raise ModelConfigError("a model needs at least one layer, got none")
        # One head width per layer kind (one rope table per kind is built from it: Gemma
        # 4's full layers are twice as wide); the KV heads may differ by layer.
        for kind in {str(s.kind) for s in self.attention_layers}:
            widths = sorted({s.head_dim for s in self.attention_layers if str(s.kind) == kind})
            if len(widths) > 1:
                raise ModelConfigError(f"{kind} layers differ in head dim: {widths}")
        for kv_heads in sorted({s.num_kv_heads for s in self.attention_layers}):
            if self.num_heads % kv_heads:
                raise ModelConfigError(
                    f"num_attention_heads={self.num_heads} is not a multiple of "
                    f"num_key_value_heads={kv_heads}"
                )
        missing = sorted({str(s.kind) for s in self.attention_layers} - set(self.rope))
        if missing:
            raise ModelConfigError(f"no rope parameters for layer types {missing}")

    @property
    def num_layers(self) -> int:
        """Decoder layers."""
        return len(self.layers)

    @property
    def planned_layers(self) -> tuple[ModelLayer, ...]:
        """Every layer the KV layout holds memory for: the decoder's, then the MTP
        layers' (``mtp_layers``, where speculative decoding loads them)."""
        return self.layers + self.mtp_layers

    @property
    def attention_layers(self) -> tuple[AttentionSpec, ...]:
        """The specs of the attention layers, in layer order (state layers left out)."""
        return tuple(s for s in self.layers if isinstance(s, AttentionSpec))

    @property
    def num_kv_heads(self) -> int:
        """Key/value heads of the first attention layer (GQA when fewer than query heads;
        each layer's spec has its own)."""
        attention = self.attention_layers
        return attention[0].num_kv_heads if attention else self.num_heads

    @property
    def head_dim(self) -> int:
        """Width of one head of the first attention layer (each kind's: ``head_dims``)."""
        attention = self.attention_layers
        if attention:
            return attention[0].head_dim
        return self.hidden_size // self.num_heads if self.num_heads else 0

    @property
    def head_dims(self) -> dict[str, int]:
        """Per attention layer kind, the width of its heads."""
        return {str(s.kind): s.head_dim for s in self.attention_layers}

    @property
    def rope_dims(self) -> dict[str, int]:
        """Per attention layer kind, the width its rope tables are built for: the head's,
        or a latent layer's rope key's."""
        latent = self.latent
        if self.compressed is not None:  # DeepSeek V4: the last rope_dim of each head
            return {str(s.kind): self.compressed.rope_dim for s in self.attention_layers}
        return {
            str(s.kind): latent.rope_dim if s.latent and latent is not None else s.head_dim
            for s in self.attention_layers
        }

    @property
    def residual_streams(self) -> int:
        """Residual streams a token carries from layer to layer (hyper-connections'; 1)."""
        return 1 if self.hyper is None else self.hyper.streams

    @property
    def reads_token_ids(self) -> bool:
        """Whether layers past the embedding read the token ids (DeepSeek V4's hashed
        experts), so every pipeline stage needs them."""
        return self.experts is not None and bool(self.experts.hashed_layers)

    @property
    def embeddings_read_by(self) -> str | None:
        """What in the model reads the token embeddings at later layers (Gemma 4's
        per-layer inputs, Zamba2's shared blocks), or None."""
        if self.per_layer_inputs is not None:
            return "Gemma 4's per-layer inputs are computed from them"
        if self.shared_blocks is not None:
            return "Zamba2's shared attention blocks read them beside the hidden states"
        return None

    @property
    def layer_types(self) -> tuple[str, ...]:
        """Per layer, its kind (``full_attention``, ``sliding_attention``, ...)."""
        return tuple(str(s.kind) for s in self.layers)


def eos_ids(value: object) -> tuple[int, ...]:
    """``eos_token_id`` of a config: an int, a list of ints, or absent.

    Raises:
        ModelConfigError: anything else, naming the field.
    """
    if value is None:
        return ()
    items = value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in items):
        raise ModelConfigError(
            f"config field 'eos_token_id' must be a token id or a list of them, got {value!r}"
        )
    return tuple(items)


def activation_of(name: str) -> str:
    """Map a Hugging Face activation name onto ours."""
    if name == "silu":
        return "silu"
    if name in ("gelu_pytorch_tanh", "gelu_tanh"):
        return "gelu_tanh"
    if name in ("relu2", "gelu"):
        return name
    raise ModelConfigError(
        f"activation {name!r} is not supported; supported: silu, gelu_tanh, gelu, relu2"
    )
