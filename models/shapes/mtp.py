"""Multi-token prediction (MTP) layers: where a family's checkpoints keep them (torch-free;
``hybridkv.models.blocks.mtp`` builds them).

An MTP layer predicts the token after next. At position ``q`` it reads the target model's
hidden state there (after its final norm) and the embedding of the token at ``q + 1``,
runs one decoder layer of the family over their projection, and the model's LM head
names the token at ``q + 2``::

    g = final_norm(block(proj(cat(embed_norm(embed(t[q+1])), hidden_norm(h[q])))))
    logits = lm_head(g)                        -> t[q+2]

Run again on ``g`` and the token it named, it proposes one more: ``k`` proposals from one
layer. (This is transformers' ``MtpModel``, the reference the tests compare with: the
layer's output is normalised before both its head and the next proposal, and position 0
reads its embedding as any other.)

Three layouts hold them, ``N`` = ``num_hidden_layers``::

    after     model.layers.{N+i}.{enorm, hnorm, eh_proj, shared_head.norm | final_layernorm}
              and the block's tensors beside them    (DeepSeek V3, Ling 3.0)
    nested    model.mtp.layers.{i}.  the same names  (MiMo-V2-Flash)
    mtp       mtp.{fc, pre_fc_norm_embedding, pre_fc_norm_hidden, norm} for layer 0, the
              block's tensors under mtp.layers.{i}.  (Qwen3-Next, Qwen3.5)
    indexed   mtp.{i}.{enorm, hnorm, e_proj, h_proj, norm, hc_head_*} and the block's
              tensors beside them                     (DeepSeek V4: ``blocks/mtp.py``)

A DeepSeek layer's copies of the embedding and of the head are left unread: the model's
serve. Our modules are ``mtp.{i}.{embed_norm, hidden_norm, proj, final_norm, block}``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import attrs

from hybridkv.memory.layout import AttentionSpec, ModelLayer
from hybridkv.models.errors import ModelConfigError

#: The parts of an MTP layer beside its block, the checkpoints' names -> ours.
_PARTS = {
    "enorm": "embed_norm",
    "hnorm": "hidden_norm",
    "eh_proj": "proj",
    "shared_head.norm": "final_norm",
    "final_layernorm": "final_norm",
    "fc": "proj",
    "pre_fc_norm_embedding": "embed_norm",
    "pre_fc_norm_hidden": "hidden_norm",
    "norm": "final_norm",
    "e_proj": "embed_proj",
    "h_proj": "hidden_proj",
}
#: Tensors without a ``.weight`` leaf beside the block (DeepSeek V4's stream sum).
_LEAVES = {f"hc_head_{p}": f"hc_head.hc_{p}" for p in ("fn", "base", "scale")}
#: The copies a DeepSeek MTP layer stores of the model's embedding and head.
_COPIES = ("embed_tokens.", "shared_head.head.")
_PREFIXES = {
    "after": re.compile(r"model\.layers\.(\d+)\.(.*)"),
    "nested": re.compile(r"model\.mtp\.layers\.(\d+)\.(.*)"),
    "mtp": re.compile(r"mtp\.layers\.(\d+)\.(.*)"),
    "indexed": re.compile(r"mtp\.(\d+)\.(.*)"),
}


@attrs.frozen(kw_only=True)
class MtpShape:
    """How a family's checkpoints store their MTP layers.

    Attributes:
        layout: ``after``, ``nested``, ``mtp`` or ``indexed`` (see the module).
        count_fields: The config.json fields that may hold the number of MTP layers,
            the first present counts.
        default_count: The number where none is present (1: Qwen3-Next and MiMo-V2-Flash
            ship one and their configs may not say so).
        kind: The layer kind of the MTP block (Qwen3-Next's is a full attention layer,
            MiMo's and DeepSeek V4's a sliding one); None: the decoder's last layer's.
        dense: The block has a dense MLP where the decoder's layers have experts
            (MiMo-V2-Flash's).
        block_renames: Parts of the block's tensor names that differ from a decoder
            layer's, theirs -> ours.
    """

    layout: Literal["after", "nested", "mtp", "indexed"]
    count_fields: tuple[str, ...] = ("num_nextn_predict_layers", "num_mtp_layers")
    default_count: int = 0
    kind: str | None = None
    dense: bool = False
    block_renames: Mapping[str, str] = attrs.field(factory=dict)

    def count(self, hf: Mapping[str, Any]) -> int:
        """The MTP layers the checkpoint's config says it holds."""
        field = next((f for f in self.count_fields if hf.get(f) is not None), None)
        return self.default_count if field is None else int(hf[field])

    def our_name(self, name: str, num_layers: int) -> str | None:
        """A checkpoint tensor's name in our MTP modules; None for a tensor of no MTP
        layer, ``""`` for an MTP layer's copy of the model's embedding or head."""
        match = _PREFIXES[self.layout].match(name)
        if match is not None:
            index, rest = int(match.group(1)), match.group(2)
            if self.layout == "after":
                if index < num_layers:
                    return None
                index -= num_layers
        elif self.layout == "mtp" and name.startswith("mtp."):
            index, rest = 0, name[len("mtp.") :]  # the parts beside Qwen's one block
        else:
            return None
        if rest.startswith(_COPIES):
            return ""
        if rest in _LEAVES:
            return f"mtp.{index}.{_LEAVES[rest]}"
        part, _, leaf = rest.rpartition(".")
        if part in _PARTS and (self.layout != "mtp" or match is None):
            return f"mtp.{index}.{_PARTS[part]}.{leaf}"
        for theirs, ours in self.block_renames.items():
            rest = rest.replace(theirs, ours)
        return f"mtp.{index}.block.{rest}"

    def template(self, layers: Sequence[ModelLayer]) -> int:
        """The index of the decoder layer whose spec an MTP layer's takes: the last of the
        MTP block's kind that keeps its own pages, else the last such attention layer of
        any kind (DeepSeek V4-Flash has no window-only layer: its window is every layer's).

        Raises:
            ModelConfigError: the decoder has no attention layer keeping its own pages.
        """
        own = [i for i, s in enumerate(layers) if isinstance(s, AttentionSpec) and not s.reads]
        if not own:
            raise ModelConfigError("the model has no attention layer for its MTP layer to be")
        of_kind = [i for i in own if self.kind is None or layers[i].kind == self.kind]
        return (of_kind or own)[-1]

    def specs(self, layers: Sequence[ModelLayer], count: int) -> tuple[AttentionSpec, ...]:
        """The specs of ``count`` MTP layers after the decoder's ``layers``: each the
        template's (:meth:`template`) under the MTP layer's name; a template of another
        kind lends its first memory alone, as the MTP block's kind."""
        template = layers[self.template(layers)]
        assert isinstance(template, AttentionSpec)
        if self.kind is not None and template.kind != self.kind:
            template = attrs.evolve(template, kind=self.kind, beside=None)
        return tuple(_renamed(template, f"mtp.{i}.self_attn") for i in range(count))


def _renamed(spec: AttentionSpec, name: str) -> AttentionSpec:
    """``spec`` under ``name``, the memories beside it renamed along (``name.indexer``)."""
    beside = spec.beside
    if beside is not None:
        suffix = beside.name[len(spec.name) :] if beside.name.startswith(spec.name) else ".beside"
        beside = (
            _renamed(beside, name + suffix)
            if isinstance(beside, AttentionSpec)
            else attrs.evolve(beside, name=name + suffix)
        )
    return attrs.evolve(spec, name=name, beside=beside)


__all__ = ["MtpShape"]
