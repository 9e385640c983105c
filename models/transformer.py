"""The decoder-only causal LM shared by every architecture, over a flat token batch.

An architecture contributes two things: how to read its config.json
(:attr:`Architecture.parse`) and its decoder layer (:attr:`Architecture.layer`); the
embedding, rope tables, final norm, LM head and logit soft-cap live here once.

Flat batch: the tokens of all requests of a step are concatenated, ``[num_tokens]``;
positions say where each sits in its own request, and the paged metadata says which
request (block table) each belongs to.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import attrs
import torch
from torch import nn

from hybridkv.kernels import PagedMetadata
from hybridkv.models.config import ModelConfig
from hybridkv.models.errors import CheckpointError
from hybridkv.models.layers import LayerInputs, RMSNorm
from hybridkv.models.rope import RotaryTable
from hybridkv.models.specs import PolicyChoices


class ConfigParser(Protocol):
    """config.json dict -> :class:`ModelConfig`, its layer specs at a KV dtype and choices."""

    def __call__(
        self, hf: Mapping[str, Any], *, dtype_bytes: int = 2, policies: PolicyChoices | None = None
    ) -> ModelConfig: ...


@attrs.frozen
class Architecture:
    """A supported model family.

    Attributes:
        model_types: The Hugging Face ``model_type`` values it reads.
        parse: config.json dict -> :class:`ModelConfig` (see :class:`ConfigParser`).
        layer: Builds decoder layer ``i`` of a config.
    """

    model_types: tuple[str, ...]
    parse: ConfigParser
    layer: Callable[[ModelConfig, int], nn.Module]


class _Backbone(nn.Module):
    """Embedding, layers and final norm; named ``model`` as in Hugging Face checkpoints."""

    def __init__(self, config: ModelConfig, architecture: Architecture) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            [architecture.layer(config, i) for i in range(config.num_layers)]
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.norm_offset)


class CausalLM(nn.Module):
    """Token ids and positions in, hidden states out; last positions in, logits out."""

    def __init__(self, config: ModelConfig, architecture: Architecture) -> None:
        super().__init__()
        self.config = config
        self.model = _Backbone(config, architecture)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rope_tables: dict[str, RotaryTable] = {}

    @classmethod
    def from_weights(
        cls,
        config: ModelConfig,
        architecture: Architecture,
        weights: dict[str, torch.Tensor],
        device: torch.device | str,
    ) -> CausalLM:
        """Build the model around already-loaded tensors (no copy, no random init).

        Raises:
            CheckpointError: weights missing or left over.
        """
        if config.tie_word_embeddings or "lm_head.weight" not in weights:
            embed = weights.get("model.embed_tokens.weight")
            if embed is not None:
                weights = {**weights, "lm_head.weight": embed}
        with torch.device("meta"):
            model = cls(config, architecture)
        result = model.load_state_dict(weights, strict=False, assign=True)
        if result.missing_keys or result.unexpected_keys:
            missing, unexpected = sorted(result.missing_keys), sorted(result.unexpected_keys)
            raise CheckpointError(
                f"checkpoint does not match {config.model_type}: missing {missing[:8]}, "
                f"unexpected {unexpected[:8]}"
            )
        if config.tie_word_embeddings:
            model.lm_head.weight = model.model.embed_tokens.weight
        model.rope_tables = {
            kind: RotaryTable(config.rope[kind], config.head_dim, device)
            for kind in sorted(set(config.layer_types))
        }
        return model.eval()

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        caches: Sequence[tuple[torch.Tensor, PagedMetadata]],
    ) -> torch.Tensor:
        """Run every layer over a flat token batch; returns hidden states before the norm.

        Args:
            input_ids: ``[num_tokens]`` token ids.
            positions: ``[num_tokens]`` position of each token within its request.
            caches: Per layer, its KV cache tensor and its group's paged metadata.
        """
        hidden = self.model.embed_tokens(input_ids)
        if self.config.embed_scale is not None:
            # Scaled in the model dtype, as the reference does (bf16 rounds the factor).
            hidden = hidden * torch.tensor(self.config.embed_scale, dtype=hidden.dtype)
        tables = {
            kind: table.cos_sin(positions, hidden.dtype) for kind, table in self.rope_tables.items()
        }
        for i, layer in enumerate(self.model.layers):
            cos, sin = tables[self.config.layer_types[i]]
            kv_cache, metadata = caches[i]
            hidden = layer(hidden, LayerInputs(cos, sin, kv_cache, metadata))
        return hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm, LM head and soft-cap for the selected rows; float32 ``[rows, vocab]``."""
        logits = self.lm_head(self.model.norm(hidden)).float()
        cap = self.config.final_softcap
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits
