"""The decoder-only causal LM shared by every architecture, over a flat token batch.

A family (``hybridkv.models.families``) contributes how to read its config.json and the
shape of its decoder layer (``blocks/decoder.py`` builds it); the embedding, rope tables,
final norm, LM head and logit soft-cap live here once.

Flat batch: the tokens of all requests of a step are concatenated, ``[num_tokens]``;
positions say where each sits in its own request, and the paged metadata says which
request (block table) each belongs to.

A pipeline stage builds the same model with only its layers (``layers=range(a, b)``):
the others are :class:`MissingLayer` placeholders, so module and weight names keep their
global layer indices and a checkpoint loads without renaming. Only the first stage has
the embedding, only the last the final norm and the LM head.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator, Sequence

import attrs
import torch
from torch import nn

from hybridkv.kernels import PagedMetadata
from hybridkv.memory.layout import memories
from hybridkv.memory.state_pages import StepStates
from hybridkv.models.blocks.attention import LayerInputs, PagedAttention
from hybridkv.models.blocks.decoder import DecoderLayer
from hybridkv.models.blocks.hyper_connections import HyperHead
from hybridkv.models.blocks.mlp import GatedMLP
from hybridkv.models.blocks.mtp import MtpLayer
from hybridkv.models.blocks.norms import config_norm
from hybridkv.models.blocks.per_layer import PerLayerEmbedding
from hybridkv.models.blocks.rope import RotaryTable, query_scales
from hybridkv.models.blocks.shared_block import SharedBlockLayer
from hybridkv.models.config import ModelConfig
from hybridkv.models.errors import CheckpointError
from hybridkv.models.families import Family, decoder_of, our_name
from hybridkv.models.weights.quantized_linear import QuantizedLinear
from hybridkv.models.weights.rescored_head import RescoredHead


class MissingLayer(nn.Identity):
    """A layer another pipeline stage holds: no weights, never called."""


class _Backbone(nn.Module):
    """Embedding, layers and final norm; named ``model`` as in Hugging Face checkpoints."""

    def __init__(self, config: ModelConfig, family: Family, layers: range) -> None:
        super().__init__()
        self.embed_tokens = (
            nn.Embedding(config.vocab_size, config.hidden_size) if layers.start == 0 else None
        )
        self.layers = nn.ModuleList(
            [
                _layer(config, family, i) if i in layers else MissingLayer()
                for i in range(config.num_layers)
            ]
        )
        is_last = layers.stop == config.num_layers
        self.norm = config_norm(config, config.hidden_size) if is_last else None
        has_inputs = config.per_layer_inputs is not None and layers.start == 0
        self.per_layer_inputs = PerLayerEmbedding(config) if has_inputs else None
        # DeepSeek V4: the residual streams summed into one before the final norm.
        hyper = config.hyper
        self.hc_head = (
            HyperHead(hyper, config.hidden_size, config.rms_norm_eps)
            if hyper is not None and is_last
            else None
        )


def _layer(config: ModelConfig, family: Family, layer: int) -> nn.Module:
    """Layer ``layer`` as its family puts it together: the one decoder layer, or a layer
    running a shared block (Zamba2's)."""
    shape = decoder_of(family, config.layer_types[layer])
    if shape.residual == "shared_block":
        return SharedBlockLayer(config, layer)
    return DecoderLayer(config, layer, shape)


class CausalLM(nn.Module):
    """Token ids and positions in, hidden states out; last positions in, logits out.

    Attributes:
        config: The model config.
        layer_range: The layers this instance holds (all of them unless a pipeline stage).
    """

    def __init__(self, config: ModelConfig, family: Family, layers: range | None = None) -> None:
        super().__init__()
        self.config = config
        self.layer_range = range(config.num_layers) if layers is None else layers
        self.model = _Backbone(config, family, self.layer_range)
        # The layers with a second memory (a state mixer beside their attention, an
        # indexer's keys): a second cache each.
        self._beside = {i: len(memories([s])) - 1 for i, s in enumerate(config.layers)}
        self.lm_head: nn.Module | None = (
            nn.Linear(config.hidden_size, config.vocab_size, bias=False) if self.is_last else None
        )
        # The multi-token prediction layers, where speculative decoding loads them.
        self.mtp = nn.ModuleList(mtp_layers(config, family) if self.is_last else [])
        self.rope_tables: dict[str, RotaryTable] = {}

    @property
    def is_first(self) -> bool:
        """Whether it holds the first layer (and the embedding)."""
        return self.layer_range.start == 0

    @property
    def is_last(self) -> bool:
        """Whether it holds the last layer (and the final norm and LM head)."""
        return self.layer_range.stop == self.config.num_layers

    @classmethod
    def from_weights(
        cls,
        config: ModelConfig,
        family: Family,
        weights: dict[str, torch.Tensor],
        device: torch.device | str,
        *,
        layers: range | None = None,
    ) -> CausalLM:
        """Build the model around already-loaded tensors (no copy, no random init).

        Args:
            config: The parsed config.
            family: The model family.
            weights: The tensors this model holds (see :func:`holds_weight`).
            device: Where they are.
            layers: The layers of a pipeline stage; None for the whole model.

        Raises:
            CheckpointError: weights missing or left over.
        """
        with torch.device("meta"):
            model = cls(config, family, layers)
        weights = {our_name(family, name): tensor for name, tensor in weights.items()}
        embed = weights.get(_EMBED)
        reuses_embed = config.tie_word_embeddings or "lm_head.weight" not in weights
        if model.is_last and embed is not None and reuses_embed:
            weights = {**weights, "lm_head.weight": embed}
        if not model.is_first:
            weights = {k: v for k, v in weights.items() if k != _EMBED}
        result = model.load_state_dict(weights, strict=False, assign=True)
        if result.missing_keys or result.unexpected_keys:
            missing, unexpected = sorted(result.missing_keys), sorted(result.unexpected_keys)
            raise CheckpointError(
                f"checkpoint does not match {config.model_type}: missing {missing[:8]}, "
                f"unexpected {unexpected[:8]}"
            )
        head, embedding = model.lm_head, model.model.embed_tokens
        if config.tie_word_embeddings and head is not None and embedding is not None:
            head.weight = embedding.weight
        kinds = {config.layer_types[i] for i in model.layer_range}
        kinds |= {str(s.kind) for s in config.mtp_layers} if model.mtp else set()
        model.rope_tables = {  # state layers have no rope
            kind: RotaryTable(
                config.rope[kind], config.rope_dims.get(kind, config.head_dim), device
            )
            for kind in sorted(kinds & {*config.rope})
        }
        return model.eval()

    def fuse_projections(self) -> int:
        """Join each layer's q/k/v and gate/up projections, in their stored form (after
        any quantisation: ``models/weights/fused_linear.py``); returns the number joined."""
        return sum(
            module.fuse()
            for module in list(self.modules())
            if isinstance(module, (PagedAttention, GatedMLP))
        )

    def rescore_head(self) -> bool:
        """Give a quantised LM head a 4-bit pass with its best candidates recomputed
        exactly (``models/weights/rescored_head.py``); whether it did. The exact rows are the
        embedding's where the head is tied to it."""
        head, embedding = self.lm_head, self.model.embed_tokens
        # A tensor-parallel rank's head holds a run of the vocabulary (``vocab_share``),
        # and its embedding the same run: that run is rescored, from those rows.
        share = getattr(head, "vocab_share", None)
        stored = head if share is None else share
        exact = None
        if self.config.tie_word_embeddings and embedding is not None:
            exact = embedding.weight
        if stored is None or not RescoredHead.fits(stored, has_exact_rows=exact is not None):
            return False
        assert isinstance(stored, QuantizedLinear)
        if share is None:
            self.lm_head = RescoredHead(stored, exact)
        else:
            assert head is not None
            head.vocab_share = RescoredHead(stored, exact)
        return True

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        caches: Sequence[CacheEntry],
    ) -> torch.Tensor:
        """Embed and run every layer over a flat token batch; hidden states before the norm.

        Args:
            input_ids: ``[num_tokens]`` token ids.
            positions: ``[num_tokens]`` position of each token within its request.
            caches: Per memory of the layers (``run_layers``), its KV cache tensor and its
                group's paged metadata.
        """
        return self.run_layers(self.embed(input_ids), positions, caches, input_ids=input_ids)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``[num_tokens]`` ids -> ``[num_tokens, hidden]`` (scaled where the model scales)."""
        assert self.model.embed_tokens is not None, "only the first stage embeds"
        hidden: torch.Tensor = self.model.embed_tokens(input_ids)
        if self.config.embed_scale is not None:
            # Scaled in the model dtype, as the reference does (bf16 rounds the factor).
            hidden = hidden * torch.tensor(self.config.embed_scale, dtype=hidden.dtype)
        if self.config.hyper is not None:  # each of the residual streams starts as it
            hidden = hidden.unsqueeze(1).expand(-1, self.config.hyper.streams, -1).contiguous()
        return hidden

    def run_layers(
        self,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        caches: Sequence[CacheEntry],
        *,
        input_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Run the layers this model holds, in order, over ``[num_tokens, hidden]``.

        Args:
            hidden: Embeddings, or the previous stage's output.
            positions: ``[num_tokens]`` position of each token within its request.
            caches: Per memory of the layers held (``layer_range`` order, a layer's
                memory followed by the state beside it: ``memories``), its KV cache
                and metadata.
            input_ids: The tokens, where ``hidden`` is their embeddings (the first
                stage): a model with per-layer inputs reads them; and on every stage of a
                model whose layers read them (``ModelConfig.reads_token_ids``).
        """
        hyper = self.config.hyper
        if hyper is not None and hidden.dim() == 2:  # the streams as a pipeline wire sends them
            hidden = hidden.view(hidden.shape[0], hyper.streams, -1)
        per_layer = None
        if self.model.per_layer_inputs is not None:
            assert input_ids is not None, "per-layer inputs are read from the token ids"
            per_layer = self.model.per_layer_inputs(input_ids, hidden)
        tables = {
            kind: table.cos_sin(positions, hidden.dtype) for kind, table in self.rope_tables.items()
        }
        no_rope = (hidden.new_empty(0), hidden.new_empty(0))
        kinds = self.config.layer_types  # a property that builds the tuple: read it once
        nope = self.config.nope_layers
        temperature = self.config.query_temperature
        scales = None if temperature is None else query_scales(temperature, positions)
        # Zamba2's shared blocks read the token embeddings beside the hidden states.
        embeddings = hidden if self.config.shared_blocks is not None else None
        entries = iter(caches)
        for i in self.layer_range:
            cos, sin = no_rope if i in nope else tables.get(kinds[i], no_rope)
            scaled = (
                scales if temperature is None or not temperature.nope_only or i in nope else None
            )
            kv_cache, metadata = next(entries)
            beside = _beside(cos, sin, entries, self._beside[i])
            inputs = LayerInputs(
                cos, sin, kv_cache, metadata, query_scale=scaled,
                per_layer=None if per_layer is None else per_layer[:, i], beside=beside,
                embeddings=embeddings, rotary=self.rope_tables.get(kinds[i]),
                positions=positions, token_ids=input_ids,
            )  # fmt: skip
            hidden = self.model.layers[i](hidden, inputs)
        assert next(entries, None) is None, "a cache for every memory of the layers held"
        return hidden

    def run_mtp(
        self,
        index: int,
        hidden: torch.Tensor,
        token_ids: torch.Tensor,
        positions: torch.Tensor,
        caches: Sequence[CacheEntry],
    ) -> torch.Tensor:
        """MTP layer ``index`` at ``positions`` (``models/shapes/mtp.py``): from the hidden
        states there (the target's after its final norm, or an earlier proposal's) and the
        ids of the tokens after each; its output (normalised: ``MtpLayer``).

        Args:
            caches: Per memory of the MTP layer (``memories``), its cache and metadata.
        """
        kind = str(self.config.mtp_layers[index].kind)
        table = self.rope_tables.get(kind)
        cos, sin = (
            table.cos_sin(positions, hidden.dtype)
            if table is not None
            else (hidden.new_empty(0), hidden.new_empty(0))
        )
        entries = iter(caches)
        kv_cache, metadata = next(entries)
        beside = _beside(cos, sin, entries, len(caches) - 1)
        inputs = LayerInputs(
            cos, sin, kv_cache, metadata, beside=beside, rotary=table, positions=positions,
            token_ids=token_ids,
        )  # fmt: skip
        assert self.model.embed_tokens is not None, "the MTP layers read the embedding"
        out: torch.Tensor = self.mtp[index](hidden, self.model.embed_tokens(token_ids), inputs)
        return out

    def mtp_tokens(self, out: torch.Tensor) -> torch.Tensor:
        """The token the first MTP layer's output names at each row (the LM head's
        argmax)."""
        assert self.lm_head is not None, "only the last stage proposes"
        tokens: torch.Tensor = self.lm_head(self._first_mtp.head_input(out)).argmax(-1)
        return tokens

    def mtp_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        """What the first MTP layer reads of the layers' output: the hidden states after
        the final norm, or the residual streams themselves (DeepSeek V4's)."""
        return hidden if self._first_mtp.reads_streams else self.final_hidden(hidden)

    @property
    def _first_mtp(self) -> MtpLayer:
        layer = self.mtp[0]
        assert isinstance(layer, MtpLayer)
        return layer

    def final_hidden(self, hidden: torch.Tensor) -> torch.Tensor:
        """The hidden states after the final norm (the residual streams summed first)."""
        assert self.model.norm is not None, "only the last stage"
        if self.model.hc_head is not None:
            hidden = self.model.hc_head(hidden)
        out: torch.Tensor = self.model.norm(hidden)
        return out

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm, LM head and soft-cap for the selected rows; float32 ``[rows, vocab]``."""
        assert self.lm_head is not None, "only the last stage"
        logits: torch.Tensor = self.lm_head(self.final_hidden(hidden)).float()
        if self.config.logits_scaling != 1.0:
            logits = logits / self.config.logits_scaling
        cap = self.config.final_softcap
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits


_EMBED = "model.embed_tokens.weight"

#: A memory's cache and its group's metadata for the step.
CacheEntry = tuple[torch.Tensor, PagedMetadata | StepStates | None]


def _beside(
    cos: torch.Tensor, sin: torch.Tensor, entries: Iterator[CacheEntry], count: int
) -> LayerInputs | None:
    """The next ``count`` memories of ``entries``, those beside a layer's own, nested as
    its mixer reads them (the first holds the second, ...: an indexer rotates)."""
    beside = None
    for cache, meta in reversed([next(entries) for _ in range(count)]):
        beside = LayerInputs(cos, sin, cache, meta, beside=beside)
    return beside


def mtp_layers(config: ModelConfig, family: Family) -> list[MtpLayer]:
    """The MTP layers of ``config.mtp_layers``, as ``family``'s checkpoints hold them."""
    if not config.mtp_layers:
        return []
    shape = family.mtp
    assert shape is not None, "MTP layers of a family without them"
    indices = range(config.num_layers, len(config.planned_layers))
    experts = config.experts
    if shape.dense and experts is not None:  # MiMo's: a dense MLP among expert layers
        experts = attrs.evolve(experts, dense_layers=experts.dense_layers | {*indices})
    whole = attrs.evolve(config, layers=config.planned_layers, mtp_layers=(), experts=experts)
    return [MtpLayer(whole, i, decoder_of(family, str(whole.layers[i].kind))) for i in indices]


def holds_weight(name: str, config: ModelConfig, layers: range, names: Collection[str]) -> bool:
    """Whether the model of ``layers`` needs checkpoint tensor ``name`` (of ``names``).

    The first stage takes the embedding, the last the final norm and the LM head (the
    embedding too when the head reuses it); a layer's tensors go to the stage holding it.
    """
    if name.startswith("model.layers."):
        return int(name.split(".")[2]) in layers
    is_first, is_last = layers.start == 0, layers.stop == config.num_layers
    if name == _EMBED:
        tied = config.tie_word_embeddings or "lm_head.weight" not in names
        return is_first or (is_last and tied)
    return is_last
