"""The attention families at their published shapes: the bytes one request holds in
hybridkv's layout, in a uniform one, and in vLLM 0.34's layout of the same model, side by
side, and how many such requests fit.

For each shape of ``models/published_shapes.py`` the issue lists, the layer specs come from
``layer_specs_from_config`` (bfloat16 K/V, block size 16):

- **hybridkv**: ``plan_layout`` and ``describe``: the pages a request of L tokens holds in
  every group, times the bytes of a page id over every slot (packing and padding
  counted as the planner lays them out);
- **uniform**: every layer as full attention with its own page: L tokens of every layer
  that keeps K/V;
- **vLLM 0.34**: its own planner on the same layers (``get_kv_cache_groups`` and
  ``get_kv_cache_config_from_groups`` of ``vllm/v1/core/kv_cache_planning.py``, vLLM's
  code run from the wheel's sources as ``hybrid/cliffs.py`` runs 0.33's): one
  ``FullAttentionSpec``, ``SlidingWindowSpec`` or ``ChunkedLocalAttentionSpec`` per layer
  that keeps K/V (values of their own width, as vLLM keeps MiMo-V2-Flash's; Gemma 4's
  KV-shared layers have no spec, as vLLM gives them none; an ``MLAAttentionSpec`` of one
  576-value latent for DeepSeek V3's and Kimi K2's latent attention, and for DeepSeek
  V3.2's indexer one of its keys as vLLM caches them, 128 fp8 values and a float32 scale
  a token, where hybridkv keeps them in the model's dtype; DeepSeek V4's compressed
  layers are not mapped: for them the bytes each memory kind keeps are printed instead),
  vLLM's default layout
  (``LBNHC``, the first of its preference); a request of L tokens holds, in each group,
  the blocks of its block size the group's window keeps, times vLLM's bytes per block.

Requests that fit: ``(blocks - 1) // blocks per request`` in the same budget for each.

    python -m benchmarks.hybrid.family_layouts [--reference-src DIR | --no-reference]
        [--budget GIB] [--json FILE]

The wheel is fetched as ``hybrid/cliffs.py`` fetches 0.33's (``pip download --no-deps``
into the peer cache, never installed). Results: docs/benchmarks.md, section "The
attention families' layouts against vLLM 0.34's".
"""

from __future__ import annotations

import argparse
import importlib
import sys
import types
from collections.abc import Sequence
from typing import Any

from benchmarks.common.results import add_json_argument, write_json
from benchmarks.hybrid.vllm_mamba import load_reference
from hybridkv.memory.layout import AttentionSpec, LayerSpec, cached_layers, owns_pages
from hybridkv.memory.layout_planner import describe, plan_layout
from hybridkv.models.published_shapes import BUILTIN_CONFIGS
from hybridkv.models.specs import layer_specs_from_config
from hybridkv.policies import (
    ChunkedLocal,
    CompressedEntries,
    FullAttention,
    MemoryPolicy,
    SlidingWindow,
)

VLLM_VERSION = "0.34.0"
#: The published shapes of the issue's rows.
SHAPES = (
    "qwen3-8b-like", "qwen3-30b-a3b-like", "gpt-oss-20b-like", "gpt-oss-120b-like",
    "llama4-scout-like", "mistral-small-3.2-like", "phi-4-mini-like", "gemma-4-31b-like",
    "gemma-4-e4b-like", "mimo-v2-flash-like", "command-a-like", "olmo3-7b-like",
    "smollm3-3b-like", "exaone4-32b-like", "deepseek-v3-like", "deepseek-v3.2-like",
    "kimi-k2-like", "deepseek-v4-like",
)  # fmt: skip
TOKENS = (4096, 32768)
BLOCK = 16
GiB = 1 << 30


def hybridkv_row(specs: Sequence[LayerSpec], budget: int, tokens: int) -> dict[str, Any]:
    """hybridkv's and the uniform layout's bytes per request and requests that fit."""
    specs = cached_layers(specs)  # DeepSeek V3.2's index keys beside its latents
    plan = plan_layout(specs, budget, BLOCK)
    report = describe(plan, specs, tokens)
    page_id = sum(report.stage_slots) * plan.block_bytes
    owners = [s for s in specs if owns_pages(s)]
    uniform_page = sum(s.block_bytes(BLOCK) for s in owners)
    return {
        "hybridkv_bytes": report.blocks_per_request * page_id,
        "hybridkv_requests": report.max_requests,
        "hybridkv_padding": round(report.padding_fraction, 4),
        "uniform_bytes": report.uniform_blocks_per_request * uniform_page,
        "uniform_requests": report.uniform_max_requests,
    }


def vllm_row(vllm: Any, specs: Sequence[LayerSpec], budget: int, tokens: int) -> dict[str, Any]:
    """vLLM 0.34's groups for ``specs`` in ``budget``: bytes per request, requests that fit."""
    import torch

    planning = vllm.planning
    kv_specs = {}
    for spec in cached_layers(specs):
        if not owns_pages(spec):
            continue
        assert isinstance(spec, AttentionSpec)
        if spec.name.endswith(".indexer"):  # DeepSeek V3.2's index keys: fp8 and a scale
            kv_specs[spec.name] = vllm.spec.MLAAttentionSpec(
                block_size=BLOCK, num_kv_heads=1, head_size=spec.head_dim + 4,
                dtype=torch.uint8,
            )  # fmt: skip
            continue
        common = dict(block_size=BLOCK, num_kv_heads=spec.num_kv_heads, head_size=spec.head_dim,
                      dtype=torch.bfloat16)  # fmt: skip
        policy = spec.policy
        if spec.latent:
            kv_specs[spec.name] = vllm.spec.MLAAttentionSpec(**common)
        elif isinstance(policy, SlidingWindow):
            kv_specs[spec.name] = vllm.spec.SlidingWindowSpec(
                **common, sliding_window=policy.window
            )
        elif isinstance(policy, ChunkedLocal):
            kv_specs[spec.name] = vllm.spec.ChunkedLocalAttentionSpec(
                **common, attention_chunk_size=policy.chunk
            )
        else:
            kv_specs[spec.name] = vllm.spec.FullAttentionSpec(**common)
    config = _vllm_config(vllm)
    groups = planning.get_kv_cache_groups(config, kv_specs)
    layout = config.cache_config.get_resolved_kv_cache_layout()
    per_block = planning._get_kv_cache_bytes_per_block(groups, layout)
    num_blocks = budget // per_block
    need = sum(_policy(g.kv_cache_spec).max_live_blocks(tokens, g.kv_cache_spec.block_size)
               for g in groups)  # fmt: skip
    return {
        "vllm_bytes": need * per_block,
        "vllm_requests": (num_blocks - 1) // need,
        "vllm_groups": len(groups),
        "vllm_block_sizes": sorted({g.kv_cache_spec.block_size for g in groups}),
    }


def per_head_bytes(config: dict[str, Any], tokens: int) -> int:
    """For a model of latent attention, the bytes a request of ``tokens`` would hold with
    a bfloat16 key and value per head in every layer (what an engine that does not keep
    the latent caches); 0 for any other model."""
    if "kv_lora_rank" not in config:
        return 0
    key = config["qk_nope_head_dim"] + config["qk_rope_head_dim"]
    per_token = config["num_attention_heads"] * (key + config["v_head_dim"]) * 2
    return int(per_token * config["num_hidden_layers"] * tokens)


def specs_of(shape: str) -> list[Any]:
    """The layer specs of a published shape, bfloat16."""
    return list(layer_specs_from_config(BUILTIN_CONFIGS[shape], dtype_bytes=2))


def kind_bytes(specs: Sequence[LayerSpec], tokens: int) -> dict[str, int]:
    """Per memory policy, the bytes a request of ``tokens`` keeps live in the layers of
    it, without pages or padding: each layer's live positions times a position's bytes
    (a compressed layer's: an entry's), or one state."""
    out: dict[str, int] = {}
    for spec in cached_layers(specs):
        if not owns_pages(spec):
            continue
        if isinstance(spec, AttentionSpec):
            live = sum(b - a for a, b in spec.policy.live_spans(tokens))
            size = spec.block_bytes(BLOCK) // spec.policy.page_positions(BLOCK) * live
        else:
            size = spec.state_bytes
        out[repr(spec.policy)] = out.get(repr(spec.policy), 0) + size
    return out


def _policy(spec: Any) -> MemoryPolicy:
    """The hybridkv policy that keeps what a vLLM spec's manager keeps."""
    if getattr(spec, "sliding_window", None):
        return SlidingWindow(window=spec.sliding_window)
    if getattr(spec, "attention_chunk_size", None):
        return ChunkedLocal(chunk=spec.attention_chunk_size)
    return FullAttention()


def _vllm_config(vllm: Any) -> Any:
    """The config fields vLLM's planner reads, as a vLLM engine would set them by default
    (no hybrid-manager opt-out, no HiSparse, no block override, the default layout)."""
    cache = types.SimpleNamespace(
        num_gpu_blocks_override=None,
        prefix_cache_retention_interval=None,
        kv_cache_layout="LBNHC",
    )
    cache.get_resolved_kv_cache_layout = lambda: vllm.layout.KVCacheLayout.LBNHC
    return types.SimpleNamespace(
        cache_config=cache,
        scheduler_config=types.SimpleNamespace(disable_hybrid_kv_cache_manager=False),
        attention_config=types.SimpleNamespace(hisparse_config=None),
    )


def load_vllm(args: argparse.Namespace) -> tuple[Any, str]:
    """vLLM 0.34's planner modules (or None) and a line saying what was loaded or why not."""
    vllm, line = load_reference(args, VLLM_VERSION, "planner")
    if vllm is None:
        return None, line
    vllm.planning = importlib.import_module("vllm.v1.core.kv_cache_planning")
    vllm.layout = importlib.import_module("vllm.v1.kv_cache_layout")
    # HiSparse is one of the loader's stand-ins; without a hisparse_config vLLM's own
    # function returns None on its first line, which is what stands in for it here.
    vllm.planning.get_hisparse_kv_cache_groups = lambda config, specs: None
    # The attention backends import a GPU platform; the specs here set no block stride
    # alignment, so vLLM reads only the class ``MultipleOf`` from that module (isinstance).
    backend = types.ModuleType("vllm.v1.attention.backend")
    backend.MultipleOf = type("MultipleOf", (), {})  # type: ignore[attr-defined]
    sys.modules.setdefault("vllm.v1.attention.backend", backend)
    return vllm, line


HEADER = (
    f"{'shape':24} {'hybridkv MiB':>13} {'(padding)':>9} {'uniform MiB':>12} {'vLLM MiB':>10}"
    f" | {'fit: ours':>9} {'uniform':>8} {'vLLM':>6} {'vLLM blocks':>12}"
)


def _mib(n: int) -> str:
    return f"{n / (1 << 20):,.1f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reference-src", help="an unpacked vLLM 0.34 source tree")
    parser.add_argument("--no-reference", action="store_true", help="skip vLLM")
    parser.add_argument("--budget", type=float, default=80.0, help="KV GiB (default 80)")
    add_json_argument(parser)
    args = parser.parse_args(argv)
    vllm, line = load_vllm(args)
    print(line)
    budget = int(args.budget * GiB)
    rows = []
    for tokens in TOKENS:
        print(f"\nrequests of {tokens} tokens, {args.budget:g} GiB of KV, bfloat16, block {BLOCK}")
        print(HEADER)
        for shape in SHAPES:
            specs = specs_of(shape)
            row = {"shape": shape, "tokens": tokens, **hybridkv_row(specs, budget, tokens)}
            compressed = any(isinstance(x.policy, CompressedEntries) for x in cached_layers(specs))
            if vllm is not None and not compressed:  # vLLM's V4 path is not mapped here
                row |= vllm_row(vllm, specs, budget, tokens)
            if compressed:
                row["kind_bytes"] = kind_bytes(specs, tokens)
            rows.append(row)
            theirs = _mib(row["vllm_bytes"]) if "vllm_bytes" in row else "-"
            fit = row.get("vllm_requests", "-")
            sizes = ",".join(map(str, row.get("vllm_block_sizes", []))) or "-"
            print(f"{shape:24} {_mib(row['hybridkv_bytes']):>13} {row['hybridkv_padding']:>9.1%} "
                  f"{_mib(row['uniform_bytes']):>12} {theirs:>10} | {row['hybridkv_requests']:>9} "
                  f"{row['uniform_requests']:>8} {fit:>6} {sizes:>12}")  # fmt: skip
        for row in rows[-len(SHAPES) :]:
            if "kind_bytes" in row:  # and how each kind grows: the bytes a token adds
                longer = kind_bytes(specs_of(row["shape"]), 2 * tokens)
                row["kind_growth"] = {
                    p: (longer[p] - n) / tokens for p, n in row["kind_bytes"].items()
                }
            for policy, size in row.get("kind_bytes", {}).items():
                print(f"  {row['shape']}: {policy} keeps {_mib(size)} MiB a request, "
                      f"{row['kind_growth'][policy]:,.0f} bytes more a token")  # fmt: skip
            expanded = per_head_bytes(BUILTIN_CONFIGS[row["shape"]], tokens)
            if expanded:
                row["per_head_kv_bytes"] = expanded
                print(f"  {row['shape']}: a key and a value per head instead of the latent: "
                      f"{_mib(expanded)} MiB a request")  # fmt: skip
    write_json(args.json, {"vllm": line, "budget_gib": args.budget, "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
