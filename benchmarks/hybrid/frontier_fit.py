"""How long one request's context fits beside the weights, for the latent-attention models
at their published shapes (DeepSeek V3, V3.2, Kimi K2, Kimi-Linear-48B-A3B) and DeepSeek
V4 (its transformers config's defaults: V4-Flash).

Each model's config is transformers' defaults for its type (their published values)
under ``hybridkv plan``'s row of it (``models/published_shapes.py``: the layers' shapes),
Kimi K2's experts and vocabulary written in (384 experts, one dense layer, 163,840 ids).
Its parameters are counted on the model hybridkv builds from that config (on the meta
device: no memory), the multi-token-prediction layers left out; its weights are those
parameters at the precision of the release (FP8, a byte each, for DeepSeek's and Kimi
K2's, V4's as its Flash-Base release stores its experts; bfloat16 for Kimi Linear's).

For each GPU of ``--gpu-gib`` (80) and each tensor-parallel size (1 and 8), the cache
gets what the weights leave (``gpu - weights / tp``; the latent is whole on every rank,
as are V4's window, entries and their states; Kimi Linear's delta attention states are
split by heads), and ``hybridkv plan``'s
planner (bfloat16, blocks of 16) says the longest request that fits: ``describe``'s
``max_request_tokens``, capped at the context the model was released with (marked
``max``). Nothing is timed: the numbers are the planner's arithmetic.

    python -m benchmarks.hybrid.frontier_fit [--gpu-gib 80] [--json FILE]
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from typing import Any

from benchmarks.common.results import add_json_argument, write_json
from hybridkv.memory.layout import cached_layers
from hybridkv.memory.layout_planner import describe, plan_layout
from hybridkv.models.published_shapes import BUILTIN_CONFIGS
from hybridkv.models.specs import layer_specs_from_config, tensor_rank_spec

GiB = 1 << 30
#: Kimi K2's fields beside DeepSeek V3's (its technical report and config.json).
_KIMI_K2 = {
    "vocab_size": 163840,
    "n_routed_experts": 384,
    "first_k_dense_replace": 1,
    "n_group": 1,
    "topk_group": 1,
}
#: Model -> (plan row, transformers config class, fields over both, bytes a weight, the
#: released context).
MODELS: dict[str, tuple[str, str, Mapping[str, Any], int, int]] = {
    "DeepSeek-V3": ("deepseek-v3-like", "DeepseekV3Config", {}, 1, 163840),
    "DeepSeek-V3.2": ("deepseek-v3.2-like", "DeepseekV32Config", {}, 1, 163840),
    "Kimi K2": ("kimi-k2-like", "DeepseekV3Config", _KIMI_K2, 1, 131072),
    "Kimi-Linear-48B-A3B": ("kimi-linear-48b-a3b-like", "KimiLinearConfig", {}, 2, 1048576),
    "DeepSeek-V4-Flash": ("deepseek-v4-like", "DeepseekV4Config", {}, 1, 1048576),
}
TENSOR_PARALLEL = (1, 8)


def full_config(row: str, config_class: str, fields: Mapping[str, Any]) -> dict[str, Any]:
    """transformers' defaults for the type, under the plan row and ``fields``."""
    import transformers

    defaults = getattr(transformers, config_class)().to_dict()
    if "linear_attn_config" in BUILTIN_CONFIGS[row]:  # the row names the layers
        defaults.pop("layer_types", None)
    return {**defaults, **BUILTIN_CONFIGS[row], **fields}


def parameters(config: Mapping[str, Any]) -> int:
    """Parameters of the model hybridkv builds from ``config`` (embedding and head
    included), counted on the meta device."""
    import torch

    from hybridkv.models.families import normalized, running_family
    from hybridkv.models.transformer import CausalLM

    family = running_family(str(config["model_type"]))
    assert family.parse is not None
    parsed = family.parse(normalized(family, config))
    with torch.device("meta"):
        model = CausalLM(parsed, family)
    return sum(p.numel() for p in model.parameters())


def longest(config: Mapping[str, Any], budget: int, tp: int) -> int:
    """The longest request one rank's cache of ``budget`` bytes holds at ``tp``."""
    from hybridkv.models.families import family_for, normalized

    family = family_for(str(config["model_type"]))
    assert family is not None
    state = None if family.state_shape is None else family.state_shape(normalized(family, config))
    specs = [tensor_rank_spec(s, tp, state) for s in layer_specs_from_config(config)]
    layers = cached_layers(specs)
    report = describe(plan_layout(layers, budget, 16), layers, 4096)
    return report.max_request_tokens or 0


def _cell(tokens: int, context: int) -> str:
    if not tokens:
        return "weights exceed"
    return f"{tokens:,}" + (" (max)" if tokens == context else "")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpu-gib", type=float, default=80.0, help="GiB a GPU (default 80)")
    add_json_argument(parser)
    args = parser.parse_args(argv)
    gpu = int(args.gpu_gib * GiB)
    heads = " ".join(f"{f'tp {tp}: tokens':>16}" for tp in TENSOR_PARALLEL)
    print(f"one GPU of {args.gpu_gib:g} GiB, bfloat16 cache, blocks of 16")
    print(f"{'model':22} {'parameters':>12} {'weights GiB':>12} {heads}")
    rows = []
    for name, (row, config_class, fields, weight_bytes, context) in MODELS.items():
        config = full_config(row, config_class, fields)
        count = parameters(config)
        weights = count * weight_bytes
        fits = {}
        for tp in TENSOR_PARALLEL:
            left = gpu - weights // tp
            fits[tp] = longest(config, left, tp) if left > 0 else 0
        fits = {tp: min(n, context) for tp, n in fits.items()}
        rows.append({"model": name, "row": row, "parameters": count, "weight_bytes": weights,
                     "context": context,
                     "longest_tokens": {str(tp): n for tp, n in fits.items()}})  # fmt: skip
        cells = " ".join(f"{_cell(fits[tp], context):>16}" for tp in TENSOR_PARALLEL)
        print(f"{name:22} {count / 1e9:>11.1f}B {weights / GiB:>12.1f} {cells}")
    write_json(args.json, {"gpu_gib": args.gpu_gib, "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
