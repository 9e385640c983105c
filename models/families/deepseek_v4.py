"""DeepSeek V4: a window of raw tokens in every layer and, in its compressed layers (CSA:
entries of 4 tokens, an indexer picking those a query reads; HCA: of 128), entries beside
it (``blocks/compressed_attention.py``): up to three memories a layer, each a policy of its
own (``sliding_window``, ``compressed``, and a ``mamba``-like state of the tokens waiting
for their entry). The residual is ``hc_mult`` streams (``blocks/hyper_connections.py``);
experts are routed by ``sqrt(softplus)`` scores, or in the ``hash_moe`` layers by a table
of the token id, beside a shared expert, all clamped at ``swiglu_limit``. Older releases'
fields (``compress_ratios``, ``num_hash_layers`` ...) are read as transformers reads them."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from hybridkv.memory.layout import AttentionSpec, StateSpec
from hybridkv.models.config import ModelConfig
from hybridkv.models.errors import ModelConfigError
from hybridkv.models.families import Family
from hybridkv.models.families.llama import llama_fields
from hybridkv.models.hf_config import float_field, int_field
from hybridkv.models.kinds import SLIDING, PolicyChoices, kinds_by
from hybridkv.models.shapes.compressed import (
    COMPRESSOR,
    CSA,
    ENTRIES,
    HCA,
    compressed_shape,
    nested_ropes,
    rope_specs,
)
from hybridkv.models.shapes.decoder import DecoderShape, HyperConnections
from hybridkv.models.shapes.moe import ExpertsShape
from hybridkv.models.shapes.mtp import MtpShape
from hybridkv.policies import CompressedEntries, MambaLike

_KINDS = {"sliding_attention": SLIDING, CSA: CSA, HCA: HCA}


def parse_deepseek_v4(
    hf: Mapping[str, Any], *, dtype_bytes: int = 2, policies: PolicyChoices | None = None
) -> ModelConfig:
    """Read a DeepSeek V4 config.json (normalized)."""
    fields = llama_fields(hf, dtype_bytes=dtype_bytes, policies=policies)
    scoring = hf.get("scoring_func", "sqrtsoftplus")
    if scoring not in ("sqrtsoftplus", "sigmoid"):
        raise ModelConfigError(f"scoring_func {scoring!r}: sqrtsoftplus and sigmoid run here")
    limit, mlp_kinds = hf.get("swiglu_limit"), list(hf["mlp_layer_types"])
    inner = int_field(hf, "moe_intermediate_size")
    experts = ExpertsShape(
        num_experts=int_field(hf, "n_routed_experts"),
        top_k=int_field(hf, "num_experts_per_tok"),
        inner=inner,
        router=scoring,
        selection_bias=True,
        route_scale=float(hf.get("routed_scaling_factor") or 1.0),
        shared_inner=inner,
        stacks="plain",
        activation="silu_clamped" if limit else "silu",
        limit=float(limit or 0.0),
        hashed_layers=frozenset(i for i, k in enumerate(mlp_kinds) if k == "hash_moe"),
        vocab_size=int_field(hf, "vocab_size"),
    )
    main, compress = rope_specs(hf)
    hyper = HyperConnections(
        streams=int_field(hf, "hc_mult"),
        sinkhorn_iters=int_field(hf, "hc_sinkhorn_iters"),
        eps=float_field(hf, "hc_eps", 1e-6),
    )
    return ModelConfig(**{
        **fields,
        "rope": {SLIDING: main, CSA: compress, HCA: compress},
        "experts": experts,
        "compressed": compressed_shape(hf),
        "hyper": hyper,
        "mlp_limit": float(limit) if limit else None,
    })  # fmt: skip


def _beside(cfg: Mapping[str, Any], spec: AttentionSpec) -> AttentionSpec:
    """A layer's window as one vector a token; a compressed layer's entries beside it (a
    CSA entry with its indexer's key) and their compressor's state beside those."""
    kind = str(spec.kind)
    if kind not in (CSA, HCA):
        return attrs.evolve(spec, latent=True)
    shape = compressed_shape(cfg)
    state = StateSpec(
        name=f"{spec.name}.compressor.state", policy=MambaLike(),
        state_bytes=4 * shape.state_values(kind), kind=COMPRESSOR,
    )  # fmt: skip
    entries = AttentionSpec(
        name=f"{spec.name}.compressor", policy=CompressedEntries(shape.rates[kind]),
        num_kv_heads=1, head_dim=shape.entry_width(kind), dtype_bytes=spec.dtype_bytes,
        kind=ENTRIES, latent=True, beside=state,
    )  # fmt: skip
    return attrs.evolve(spec, latent=True, beside=entries)


def _pattern(cfg: Mapping[str, Any], num_layers: int) -> list[str]:
    """transformers' default: two HCA layers, then CSA and HCA alternating."""
    rest = [CSA if i % 2 else HCA for i in range(max(num_layers - 2, 0))]
    return ([HCA] * min(num_layers, 2) + rest)[:num_layers]


def _normalize(cfg: Mapping[str, Any]) -> Mapping[str, Any]:
    """The fields of older releases as transformers' config reads them, its defaults
    filled in, and one ``rope_parameters`` per rope (``main``, ``compress``)."""
    out = dict(cfg)
    rates = dict(out.get("compress_rates") or {CSA: 4, HCA: 128})
    for kind, legacy in ((CSA, "compress_rate_csa"), (HCA, "compress_rate_hca")):
        rates[kind] = out.pop(legacy, None) or rates[kind]
    out["compress_rates"] = rates
    ratios = out.pop("compress_ratios", None)
    if out.get("layer_types") is None and ratios is not None:
        by_ratio = {0: "sliding_attention", 4: CSA, 128: HCA}
        out["layer_types"] = [by_ratio[int(r)] for r in ratios]
    layers = int_field(out, "num_hidden_layers")
    hashed = out.pop("num_hash_layers", None)
    if out.get("mlp_layer_types") is None:
        hashed = 3 if hashed is None else int(hashed)
        out["mlp_layer_types"] = ["hash_moe"] * min(layers, hashed) + ["moe"] * (layers - hashed)
    rope_dim = out.pop("qk_rope_head_dim", None)
    if out.get("partial_rotary_factor") is None:
        out["partial_rotary_factor"] = (rope_dim or 64) / int_field(out, "head_dim")
    out.setdefault("intermediate_size", out.get("moe_intermediate_size"))
    out["rope_parameters"] = nested_ropes(out)
    return out


FAMILY = Family(
    model_types=("deepseek_v4",),
    layer_kinds=kinds_by(_pattern, _KINDS),
    parse=parse_deepseek_v4,
    decoder=DecoderShape(
        residual="hyper",
        mixer_norm="attn_norm",
        mlp_norm="ffn_norm",
        mlp="experts",
        mlp_name="ffn",
        mixer_name="attn",
    ),
    renames={"head.weight": "lm_head.weight"},
    part_renames={
        ".hc_attn_": ".attn_hc.",
        ".hc_ffn_": ".ffn_hc.",
        ".gate.bias": ".gate.expert_bias",
        ".w1.": ".gate_proj.",
        ".w3.": ".up_proj.",
        ".w2.": ".down_proj.",
    },
    kv_shape=lambda cfg, kind: (1, int_field(cfg, "head_dim")),
    beside=_beside,
    normalize=_normalize,
    mtp=MtpShape(layout="indexed", kind=SLIDING),  # a window over the streams: blocks/mtp.py
)
