"""The model families: one module each, found by ``model_type`` (``ls models/families`` is
the list of what loads).

A family reads its config.json vocabulary into a :class:`ModelConfig` and says which
kind each layer is; it builds no module and names no memory policy: the layers' memory
specs follow from their kinds (``models/specs.py``) and every family's decoder is the one
``blocks/decoder.py`` builds from the family's :class:`DecoderShape`. Family modules are
torch-free (``hybridkv plan`` sizes models it never loads) and imported on first use.

A family without ``parse`` is sized by ``hybridkv plan`` but does not run here.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import attrs

from hybridkv.memory.layout import AttentionSpec, ModelLayer
from hybridkv.models.config import ModelConfig
from hybridkv.models.errors import ModelConfigError
from hybridkv.models.kinds import PolicyChoices
from hybridkv.models.shapes.decoder import PRE_NORM, DecoderShape
from hybridkv.models.shapes.mtp import MtpShape
from hybridkv.models.shapes.state import StateShape

#: ``model_type`` -> the module here that reads it.
MODULES = {
    "llama": "llama",
    "gemma2": "gemma2",
    "gemma3_text": "gemma3",
    "gemma3": "gemma3",
    "bamba": "bamba",
    "granitemoehybrid": "granite_hybrid",
    "mistral": "mistral",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "smollm3": "smollm3",
    "seed_oss": "seed_oss",
    "qwen3_moe": "qwen3_moe",
    "phi3": "phi3",
    "cohere2": "cohere2",
    "olmo3": "olmo3",
    "exaone4": "exaone4",
    "gpt_oss": "gpt_oss",
    "ministral3": "ministral3",
    "llama4_text": "llama4",
    "granite_swa": "granite_swa",
    "granitemoe_swa": "granitemoe_swa",
    "afmoe": "afmoe",
    "mimo_v2_flash": "mimo_v2_flash",
    "gemma4_text": "gemma4",
    "qwen3_next": "qwen3_next",
    "lfm2": "lfm2",
    "lfm2_moe": "lfm2",
    "olmo_hybrid": "olmo_hybrid",
    "qwen3_5_text": "qwen3_next",
    "qwen3_5_moe_text": "qwen3_next",
    "qwen3_5": "qwen3_next",
    "qwen3_5_moe": "qwen3_next",
    "gemma4": "gemma4",
    "jamba": "jamba",
    "lfm3": "lfm3",
    "mamba": "mamba",
    "falcon_mamba": "mamba",
    "mamba2": "mamba",
    "nemotron_h": "nemotron_h",
    "minimax": "minimax",
    "mixtral": "mistral",
    "falcon_h1": "falcon_h1",
    "zamba2": "zamba2",
    "deepseek_v3": "deepseek_v3",
    "kimi_k2": "deepseek_v3",
    "kimi_linear": "kimi_linear",
    "bailing_hybrid": "bailing_hybrid",
    "deepseek_v32": "deepseek_v32",
    "deepseek_v4": "deepseek_v4",
}


#: Rows ``start:stop`` of a tensor multiplied by ``factor`` (``Family.scales``).
RowScale = tuple[int, int | None, float]


class ConfigParser(Protocol):
    """config.json dict -> :class:`ModelConfig`, its layer specs at a KV dtype and choices."""

    def __call__(
        self, hf: Mapping[str, Any], *, dtype_bytes: int = 2, policies: PolicyChoices | None = None
    ) -> ModelConfig: ...


@attrs.frozen(kw_only=True)
class Family:
    """A model family.

    Attributes:
        model_types: The ``model_type`` values it runs.
        layer_kinds: ``(config, num_layers)`` -> each layer's kind (``full_attention``,
            ``sliding_attention``, ``chunked_attention``, ``mamba``), ``layer_types`` first.
        parse: config.json dict -> :class:`ModelConfig`; None where it does not run.
        decoder: How its decoder layer is put together.
        decoders: Per layer kind, a decoder shape of its own where layers of that kind
            are put together otherwise (OLMo Hybrid's DeltaNet layers: pre-norm beside
            its post-norm attention layers).
        renames: Checkpoint tensor names that differ from ours, checkpoint name -> ours.
        part_renames: Parts of every layer's tensor names that differ from ours (LFM2's
            ``.feed_forward.w1.`` for ``.feed_forward.gate_proj.``), theirs -> ours.
        state_shape: config -> the shape of its state layers' mixer (the bytes of a
            state, float32 whatever the K/V's dtype; tensor parallelism splits its
            heads); None for a family without state layers.
        sized_types: Further ``model_type`` values it sizes but does not run.
        kv_shape: ``(config, kind)`` -> the KV heads and head width of that kind's
            layers, where they differ by kind (MiMo-V2-Flash, Gemma 4); None:
            ``num_key_value_heads`` and ``head_dim`` for every layer.
        shared_kv: ``(config, kinds)`` -> for each layer that reads an earlier layer's
            cache rather than keeping its own, that layer's index (Gemma 4); None: none.
        unread: Prefixes of checkpoint tensors the loader leaves unread (Qwen3-Next's
            multi-token prediction layers, ``mtp.``).
        scales: config -> per ending of a tensor name (``.mamba.in_proj.weight``), runs of
            its rows multiplied at load, ``(start, stop, factor)`` (stop None: to the
            end): multipliers the family's layers apply to a projection's input or
            output, folded into its weights (Falcon-H1's muP multipliers); None: none.
        latent_width: config -> the width of the one vector per token its attention layers
            keep (multi-head latent attention: ``kv_lora_rank + qk_rope_head_dim``); None:
            a key and a value per KV head.
        shared_weights: config -> per prefix of the tensors of a part that serves several
            layers, the prefix the checkpoint holds them under (Zamba2's shared blocks,
            stored at their first use): the loader reads them for each that the
            checkpoint does not hold apart; None: none.
        beside: ``(config, spec)`` -> an attention layer's spec with the memories it keeps
            beside its keys (``AttentionSpec.beside``: DeepSeek V4's compressed entries
            and the state of the tokens waiting for one); None: none.
        mtp: Where its checkpoints keep their multi-token prediction layers and how
            those compute (``models/shapes/mtp.py``); None: it has none we run.
        normalize: config.json -> the same with the fields its hub releases name otherwise
            renamed as the family reads them (MiMo-V2-Flash's ``sliding_window_size``);
            applied (``normalized``) before any other hook reads the config, and
            idempotent.
    """

    model_types: tuple[str, ...]
    layer_kinds: Callable[[Mapping[str, Any], int], list[str]]
    parse: ConfigParser | None = None
    decoder: DecoderShape = PRE_NORM
    decoders: Mapping[str, DecoderShape] = attrs.field(factory=dict)
    renames: Mapping[str, str] = attrs.field(factory=dict)
    part_renames: Mapping[str, str] = attrs.field(factory=dict)
    state_shape: Callable[[Mapping[str, Any]], StateShape] | None = None
    sized_types: tuple[str, ...] = ()
    kv_shape: Callable[[Mapping[str, Any], str], tuple[int, int]] | None = None
    shared_kv: Callable[[Mapping[str, Any], list[str]], Mapping[int, int]] | None = None
    normalize: Callable[[Mapping[str, Any]], Mapping[str, Any]] | None = None
    unread: tuple[str, ...] = ()
    scales: Callable[[Mapping[str, Any]], Mapping[str, tuple[RowScale, ...]]] | None = None
    shared_weights: Callable[[Mapping[str, Any]], Mapping[str, str]] | None = None
    latent_width: Callable[[Mapping[str, Any]], int] | None = None
    beside: Callable[[Mapping[str, Any], AttentionSpec], AttentionSpec] | None = None
    mtp: MtpShape | None = None


def normalized(family: Family | None, cfg: Mapping[str, Any]) -> Mapping[str, Any]:
    """``cfg`` as ``family``'s hooks read it (its ``normalize`` applied, where it has one):
    every caller of a family's ``layer_kinds``, ``parse`` or ``state_shape`` passes this."""
    return cfg if family is None or family.normalize is None else family.normalize(cfg)


def mtp_specs(
    family: Family | None, cfg: Mapping[str, Any], layers: Sequence[ModelLayer]
) -> tuple[AttentionSpec, ...]:
    """The spec of the first MTP layer of ``family``'s checkpoints of config ``cfg``, after
    the decoder's ``layers``: it proposes every token (``executor/mtp_step.py``), the
    others are left unread and unplanned.

    Raises:
        ModelConfigError: no family, or one with no MTP layers we run, or the config
            counts none.
    """
    cfg = normalized(family, cfg)
    shape = None if family is None else family.mtp
    if shape is None or not shape.count(cfg):
        raise ModelConfigError(
            f"speculative method mtp: this {cfg.get('model_type')} checkpoint has no "
            "multi-token prediction layers we run (num_nextn_predict_layers is "
            f"{cfg.get('num_nextn_predict_layers')!r}); use method ngram or draft_model"
        )
    return shape.specs(layers, 1)


def decoder_of(family: Family, kind: str) -> DecoderShape:
    """The decoder shape of ``family``'s layers of ``kind``."""
    return family.decoders.get(kind, family.decoder)


def our_name(family: Family, name: str) -> str:
    """A checkpoint tensor's name as ``family``'s model registers it."""
    name = family.renames.get(name, name)
    for theirs, ours in family.part_renames.items():
        name = name.replace(theirs, ours)
    return name


def family_for(model_type: str) -> Family | None:
    """The family that runs or sizes ``model_type``, or None."""
    module = MODULES.get(model_type)
    return None if module is None else _module_family(module)


def running_family(model_type: str) -> Family:
    """The family that runs ``model_type``.

    Raises:
        ModelConfigError: none does, naming the types that run.
    """
    family = family_for(model_type)
    if family is None or model_type not in family.model_types:
        known = ", ".join(runnable_model_types())
        raise ModelConfigError(f"model_type {model_type!r} is not supported; supported: {known}")
    return family


def runnable_model_types() -> list[str]:
    """Every ``model_type`` a family runs."""
    return [t for t in MODULES if t in _module_family(MODULES[t]).model_types]


def _module_family(module: str) -> Family:
    family: Family = importlib.import_module(f"{__name__}.{module}").FAMILY
    return family
