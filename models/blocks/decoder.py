"""The one decoder layer every family builds, from its config and its ``DecoderShape``.

The parts are registered under the names the family's checkpoint gives them, so weights
load with ``load_state_dict`` and no renaming; the mixer is the layer's spec's: paged
attention (``self_attn``) for an attention spec (latent attention for one caching a
latent), Mamba2 (``mamba``), Gated DeltaNet
(``linear_attn``) or a short convolution (``conv``) for a state spec of that kind.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from hybridkv.memory.layout import AttentionSpec, NoCacheSpec, StateSpec
from hybridkv.models.blocks.attention import LayerInputs, PagedAttention
from hybridkv.models.blocks.compressed_attention import CompressedAttention
from hybridkv.models.blocks.deltanet import GatedDeltaNet
from hybridkv.models.blocks.hyper_connections import HyperConnection
from hybridkv.models.blocks.latent_attention import LatentAttention
from hybridkv.models.blocks.lightning import LightningAttention
from hybridkv.models.blocks.mamba1 import Mamba1Mixer
from hybridkv.models.blocks.mamba2 import Mamba2Mixer
from hybridkv.models.blocks.mlp import ACTIVATIONS, GatedMLP, PlainMLP, SharedMLP
from hybridkv.models.blocks.moe import MixtureOfExperts
from hybridkv.models.blocks.norms import config_norm
from hybridkv.models.blocks.short_conv import ShortConv
from hybridkv.models.config import ModelConfig
from hybridkv.models.kinds import DELTANET, LIGHTNING, MAMBA1, MOE, SHORT_CONV, STATE_KINDS
from hybridkv.models.shapes.decoder import DecoderShape

#: Gemma 4's norms of its MLP and experts side by side (``dense_and_experts``).
_BESIDE_NORMS = (
    "post_feedforward_layernorm_1",
    "pre_feedforward_layernorm_2",
    "post_feedforward_layernorm_2",
)


def _cacheless_mixer(config: ModelConfig, kind: str) -> nn.Module:
    """The mixer of a layer that keeps nothing: experts beside a shared expert (``moe``)
    or an MLP, neither with a gate."""
    if kind != MOE:
        return PlainMLP(config, bias=config.mlp_bias)
    experts = config.experts
    assert experts is not None, "a MoE layer in a model without experts"
    shared = PlainMLP(config, bias=config.mlp_bias, inner=experts.shared_inner)
    return MixtureOfExperts(config.hidden_size, experts, shared if experts.shared_inner else None)


def _state_mixer(config: ModelConfig, kind: str, layer: int) -> nn.Module:
    """The state mixer of ``kind`` for ``layer``, from the config's shape of it."""
    eps = config.rms_norm_eps
    if kind == DELTANET:
        assert config.deltanet is not None, "a DeltaNet layer without its shape"
        return GatedDeltaNet(config.deltanet, eps)
    if kind == MAMBA1:
        assert config.mamba1 is not None, "a Mamba1 layer without its shape"
        return Mamba1Mixer(config.mamba1, eps)
    if kind == LIGHTNING:
        assert config.lightning is not None, "a lightning layer without its shape"
        return LightningAttention(config.lightning, layer)
    if kind == SHORT_CONV:
        assert config.short_conv is not None, "a short-conv layer without its shape"
        return ShortConv(config.short_conv)
    assert config.mamba is not None, "a state layer without a Mamba2 shape"
    return Mamba2Mixer(config.mamba, eps)


class DecoderLayer(nn.Module):
    """One layer: a norm, the mixer, the residual add; a norm, the MLP, the residual add
    (``models/shapes/decoder.py`` has the formulas)."""

    def __init__(self, config: ModelConfig, layer: int, shape: DecoderShape) -> None:
        super().__init__()
        size = config.hidden_size
        self._names = shape
        norms = [shape.mixer_norm, shape.mlp_norm, shape.post_mixer_norm, shape.post_mlp_norm]
        for name in norms:
            if name is not None:
                self.add_module(name, config_norm(config, size))
        spec = config.layers[layer]
        # The mixer, under its checkpoint name: ``self_attn``, ``mamba``, ``linear_attn``.
        state = isinstance(spec, StateSpec)
        self._mixer = shape.mixer_name or (STATE_KINDS[str(spec.kind)] if state else "self_attn")
        # A layer that keeps nothing has an MLP or experts for its mixer (Nemotron-H's).
        self._cacheless = isinstance(spec, NoCacheSpec)
        mixer: nn.Module
        if self._cacheless:
            mixer = _cacheless_mixer(config, str(spec.kind))
        elif state:
            mixer = _state_mixer(config, str(spec.kind), layer)
        elif config.compressed is not None:
            mixer = CompressedAttention(config, layer)
        elif isinstance(spec, AttentionSpec) and spec.latent:
            mixer = LatentAttention(config, layer)
        else:
            mixer = PagedAttention(config, layer)
        self.add_module(self._mixer, mixer)
        # A state mixer beside the attention (Falcon-H1's Mamba2), under its kind's name.
        self._beside: str | None = None
        if isinstance(spec, AttentionSpec) and isinstance(spec.beside, StateSpec):
            self._beside = STATE_KINDS[str(spec.beside.kind)]
            self.add_module(self._beside, _state_mixer(config, str(spec.beside.kind), layer))
        experts = config.experts
        dense = experts is None or layer in experts.dense_layers
        wide = 2 * config.intermediate_size if layer in config.wide_mlp_layers else None
        self.moe: MixtureOfExperts | None = None
        if shape.mlp == "dense_and_experts":
            self.mlp = GatedMLP(config, bias=config.mlp_bias, inner=wide)
            if experts is not None:
                self.moe = MixtureOfExperts(size, experts)
                for name in _BESIDE_NORMS:
                    self.add_module(name, config_norm(config, size))
        elif shape.mlp == "none":
            pass
        elif shape.mlp == "gated" or (shape.mlp == "experts" and dense):
            self.add_module(shape.mlp_name, GatedMLP(config, bias=config.mlp_bias, inner=wide))
        elif shape.mlp == "experts":
            assert experts is not None
            shared = None
            if experts.shared_inner:
                shared = GatedMLP(config, bias=config.mlp_bias, inner=experts.shared_inner)
            hashed = layer in experts.hashed_layers
            self.add_module(shape.mlp_name, MixtureOfExperts(size, experts, shared, hashed=hashed))
        else:
            # Granite SWA's MoE may have none (``shared_intermediate_size`` 0).
            inner = config.intermediate_size
            self.shared_mlp = SharedMLP(size, inner) if inner else None
            self.block_sparse_moe = None if experts is None else MixtureOfExperts(size, experts)
        self.residual_multiplier = config.residual_multiplier
        scales = config.residual_scales
        self._scales = (scales.get(str(spec.kind), (1.0, 1.0)), scales.get("mlp", (1.0, 1.0)))
        # Gemma 4: a per-layer input gated into the output, and a learned output scale.
        if config.per_layer_inputs is not None:
            width = config.per_layer_inputs.width
            self.per_layer_input_gate = nn.Linear(size, width, bias=False)
            self.per_layer_projection = nn.Linear(width, size, bias=False)
            self.post_per_layer_input_norm = config_norm(config, size)
        self.act = ACTIVATIONS[config.activation]
        if shape.residual == "hyper":  # DeepSeek V4's streams around each sublayer
            assert config.hyper is not None, "a hyper-connected layer without its shape"
            eps = config.rms_norm_eps
            self.attn_hc = HyperConnection(config.hyper, size, eps)
            self.ffn_hc = HyperConnection(config.hyper, size, eps)
        self.layer_scalar = nn.Parameter(torch.empty(1)) if config.layer_scalar else None

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
        """Gemma 4's router and experts, named on the layer, read into the mixture."""
        if self.moe is not None:
            for part in ("router.", "experts."):
                for key in [k for k in state_dict if k.startswith(prefix + part)]:
                    state_dict[f"{prefix}moe.{key[len(prefix) :]}"] = state_dict.pop(key)
        super()._load_from_state_dict(state_dict, prefix, *args)

    def mix(self, hidden: torch.Tensor, inputs: LayerInputs) -> torch.Tensor:
        """Run whichever mixer the layer has (the sum of both, where a state mixer runs
        beside the attention)."""
        mixer = getattr(self, self._mixer)
        out: torch.Tensor = mixer(hidden) if self._cacheless else mixer(hidden, inputs)
        if self._beside is not None:
            assert inputs.beside is not None, "a state beside the attention without its cache"
            out = out + getattr(self, self._beside)(hidden, inputs.beside)
        return out

    def _mlp(
        self, normed: torch.Tensor, hidden: torch.Tensor, token_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The MLP of the normed input (Granite's: the experts' output plus the shared
        MLP's; Gemma 4's: the dense MLP's beside the experts', which read ``hidden``;
        DeepSeek V4's hashed experts, chosen by ``token_ids``)."""
        if self._names.mlp != "shared_and_experts":
            mlp = getattr(self, self._names.mlp_name)
            hashed = isinstance(mlp, MixtureOfExperts) and mlp.tid2eid is not None
            out: torch.Tensor = mlp(normed, token_ids=token_ids) if hashed else mlp(normed)
            if self.moe is None:
                return out
            after_mlp, before_experts, after_experts = (getattr(self, n) for n in _BESIDE_NORMS)
            experts_out = self.moe(before_experts(hidden), route_input=hidden)
            beside: torch.Tensor = after_mlp(out) + after_experts(experts_out)
            return beside
        shared, experts = self.shared_mlp, self.block_sparse_moe
        if experts is None:
            assert shared is not None, "a Granite layer without experts has a shared MLP"
            dense: torch.Tensor = shared(normed)
            return dense
        routed: torch.Tensor = experts(normed)
        return routed if shared is None else routed + shared(normed)

    def forward(self, hidden: torch.Tensor, inputs: LayerInputs) -> torch.Tensor:
        names, scale = self._names, self.residual_multiplier
        if names.residual == "from_norm":  # MiniMax's: the residual is the normed input
            (a, b), (a_mlp, b_mlp) = self._scales
            normed = self._norm(names.mixer_norm, hidden)
            hidden = normed * a + self.mix(normed, inputs) * b
            normed = self._norm(names.mlp_norm, hidden)
            return normed * a_mlp + self._mlp(normed, hidden) * b_mlp
        if names.residual == "hyper":  # ``hidden``: the streams, [T, n, hidden]
            collapsed, post, comb = self.attn_hc(hidden)
            out = self.mix(self._norm(names.mixer_norm, collapsed), inputs)
            hidden = HyperConnection.write_back(hidden, out, post, comb)
            collapsed, post, comb = self.ffn_hc(hidden)
            out = self._mlp(self._norm(names.mlp_norm, collapsed), collapsed, inputs.token_ids)
            return HyperConnection.write_back(hidden, out, post, comb)
        if names.residual == "parallel":
            normed = self._norm(names.mixer_norm, hidden)
            return hidden + self.mix(normed, inputs) + self._mlp(normed, hidden)
        mixed = self.mix(self._norm(names.mixer_norm, hidden), inputs)
        mixed = self._norm(names.post_mixer_norm, mixed)
        hidden = hidden + (mixed * scale if scale != 1.0 else mixed)
        if names.mlp == "none":
            return hidden
        normed = self._norm(names.mlp_norm, hidden)
        out = self._norm(names.post_mlp_norm, self._mlp(normed, hidden))
        hidden = hidden + (out * scale if scale != 1.0 else out)
        if inputs.per_layer is not None:
            gated = self.act(self.per_layer_input_gate(hidden)) * inputs.per_layer
            hidden = hidden + self.post_per_layer_input_norm(self.per_layer_projection(gated))
        return hidden if self.layer_scalar is None else hidden * self.layer_scalar

    def _norm(self, name: str | None, x: torch.Tensor) -> torch.Tensor:
        """``x`` through the norm of that name; unchanged where the shape names none."""
        if name is None:
            return x
        out: torch.Tensor = getattr(self, name)(x)
        return out
