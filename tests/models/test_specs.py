"""Layer specs from Hugging Face config dicts, and the built-in model configs."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest

from hybridkv.memory.layout import AttentionSpec, StateSpec
from hybridkv.models.errors import ModelConfigError
from hybridkv.models.published_shapes import BUILTIN_CONFIGS
from hybridkv.models.specs import layer_specs_from_config
from hybridkv.policies import (
    ChunkedLocal,
    FullAttention,
    MambaLike,
    SlidingWindow,
)

FULL = FullAttention()


def config(model_type: str, num_layers: int = 4, **extra: Any) -> dict[str, Any]:
    return {
        "model_type": model_type,
        "num_hidden_layers": num_layers,
        "hidden_size": 64,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        **extra,
    }


def test_llama_layers_are_full_attention_with_default_head_dim() -> None:
    """Llama: every layer full, head dim hidden_size // heads, KV heads from the config."""
    specs = layer_specs_from_config(config("llama"), dtype_bytes=4)
    assert [s.policy for s in specs] == [FULL] * 4
    assert specs[0] == AttentionSpec(
        name="model.layers.0.self_attn",
        policy=FULL,
        num_kv_heads=2,
        head_dim=16,
        dtype_bytes=4,
        kind="full_attention",
    )


def test_mistral_with_sliding_window_slides_every_layer() -> None:
    """Mistral with sliding_window set: every layer a window of that size."""
    specs = layer_specs_from_config(config("mistral", sliding_window=4096))
    assert [s.policy for s in specs] == [SlidingWindow(window=4096)] * 4


def test_mistral_with_null_window_is_full_attention() -> None:
    """Mistral with sliding_window null: every layer full."""
    specs = layer_specs_from_config(config("mistral", sliding_window=None))
    assert [s.policy for s in specs] == [FULL] * 4


def test_gemma2_even_layers_slide() -> None:
    """Gemma 2 alternates, layer 0 sliding, with its explicit head dim."""
    specs = layer_specs_from_config(config("gemma2", sliding_window=8, head_dim=32))
    assert [s.policy for s in specs] == [SlidingWindow(window=8), FULL] * 2
    assert {s.head_dim for s in specs if isinstance(s, AttentionSpec)} == {32}


def test_gemma3_pattern_makes_every_sixth_layer_full() -> None:
    """Gemma 3 without layer_types: layers 5, 11, ... are full, by the default pattern 6."""
    specs = layer_specs_from_config(config("gemma3_text", 12, sliding_window=512))
    full = [i for i, s in enumerate(specs) if s.policy == FULL]
    assert full == [5, 11]
    assert specs[0].policy == SlidingWindow(window=512)


def test_gemma3_nested_text_config_with_layer_types() -> None:
    """A multimodal Gemma 3 config is read from text_config, layer_types first."""
    types = ["sliding_attention", "full_attention", "sliding_attention"]
    text = config("gemma3_text", 3, sliding_window=64, layer_types=types)
    specs = layer_specs_from_config({"model_type": "gemma3", "text_config": text})
    assert [s.policy for s in specs] == [SlidingWindow(window=64), FULL, SlidingWindow(window=64)]


def test_gemma3_missing_head_fields_take_transformers_defaults() -> None:
    """A Gemma 3 text_config without head fields gets 4 KV heads of 256."""
    text = {"model_type": "gemma3_text", "num_hidden_layers": 6, "hidden_size": 2560}
    specs = layer_specs_from_config({"model_type": "gemma3", "text_config": text})
    first = specs[0]
    assert isinstance(first, AttentionSpec)
    assert (first.num_kv_heads, first.head_dim, first.policy) == (4, 256, SlidingWindow(4096))


def test_layer_types_work_for_any_model_type() -> None:
    """An unknown model type with layer_types is read, chunked layers included."""
    types = ["chunked_attention", "full_attention"]
    cfg = config("llama4_text", 2, layer_types=types, attention_chunk_size=8192)
    specs = layer_specs_from_config(cfg)
    assert [s.policy for s in specs] == [ChunkedLocal(chunk=8192), FULL]


def test_unknown_model_type_without_layer_types_is_an_error() -> None:
    """A model type we do not know, without layer_types, is refused by name."""
    with pytest.raises(ModelConfigError, match="'rwkv'"):
        layer_specs_from_config(config("rwkv"))


def test_unknown_layer_type_is_an_error() -> None:
    """A layer type we cannot size is refused, naming it and the supported ones."""
    cfg = config("x", 2, layer_types=["full_attention", "linear_attention"])
    with pytest.raises(ModelConfigError, match=r"layer 1.*'linear_attention'.*full_attention"):
        layer_specs_from_config(cfg)


def test_layer_types_of_wrong_length_is_an_error() -> None:
    """layer_types must have one entry per layer."""
    with pytest.raises(ModelConfigError, match=r"3 entries.*is 4"):
        layer_specs_from_config(config("x", 4, layer_types=["full_attention"] * 3))


def test_window_of_zero_is_an_error() -> None:
    """A window of 0 is refused, naming the field, the value and the limit."""
    cfg = config("x", 1, layer_types=["sliding_attention"], sliding_window=0)
    with pytest.raises(ModelConfigError, match=r"'sliding_window' must be an integer >= 1, got 0"):
        layer_specs_from_config(cfg)


def test_missing_field_is_named() -> None:
    """A config without num_hidden_layers says so."""
    with pytest.raises(ModelConfigError, match="'num_hidden_layers'"):
        layer_specs_from_config({"model_type": "llama"})


def test_jamba_has_one_attention_layer_in_eight() -> None:
    """Jamba-like: attention at 4 and 12, Mamba1 elsewhere with d_inner * (conv window +
    state) float32 values."""
    specs = layer_specs_from_config(BUILTIN_CONFIGS["jamba-like"] | {"num_hidden_layers": 16})
    attention = [i for i, s in enumerate(specs) if isinstance(s, AttentionSpec)]
    assert attention == [4, 12]
    state = specs[0]
    assert isinstance(state, StateSpec) and state.policy == MambaLike()
    assert state.name == "model.layers.0.mamba"
    assert state.state_bytes == 2 * 4096 * (4 - 1 + 16) * 4 and state.kind == "mamba1"


@pytest.mark.parametrize("name", sorted(BUILTIN_CONFIGS))
def test_builtin_configs_give_specs(name: str) -> None:
    """Every built-in config parses into one spec per layer."""
    cfg = BUILTIN_CONFIGS[name]
    assert len(layer_specs_from_config(cfg)) == cfg["num_hidden_layers"]


def test_specs_module_imports_no_torch() -> None:
    """The plan command can size a model without torch."""
    code = "import sys, hybridkv.models.specs; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("cls_name", ["Gemma2Config", "Gemma3TextConfig"])
def test_layer_pattern_matches_transformers(cls_name: str) -> None:
    """Without layer_types, the derived pattern equals the one transformers computes."""
    transformers = pytest.importorskip("transformers")
    hf = getattr(transformers, cls_name)(num_hidden_layers=13, sliding_window=16)
    cfg = hf.to_dict()
    expected = [
        FULL if t == "full_attention" else SlidingWindow(16) for t in cfg.pop("layer_types")
    ]
    assert [s.policy for s in layer_specs_from_config(cfg)] == expected


def test_chosen_policy_replaces_the_policy_of_a_kind() -> None:
    """policies={kind: p} gives every layer of that kind the one policy object p."""
    choice = SlidingWindow(window=64)
    cfg = config("gemma2", sliding_window=8, head_dim=32)
    specs = layer_specs_from_config(cfg, policies={"full_attention": choice})
    assert [s.policy for s in specs] == [SlidingWindow(window=8), choice] * 2
    assert specs[1].policy is specs[3].policy is choice
    assert [s.kind for s in specs] == ["sliding_attention", "full_attention"] * 2


def test_state_layers_take_only_a_state_policy() -> None:
    """A mamba kind may get another state policy (checkpoints every k blocks), never one
    that keeps K/V, and an attention kind never a state policy."""
    specs = layer_specs_from_config(
        BUILTIN_CONFIGS["bamba-like"], policies={"mamba": MambaLike(checkpoint_every=4)}
    )
    assert {s.policy for s in specs if s.kind == "mamba"} == {MambaLike(checkpoint_every=4)}
    with pytest.raises(ModelConfigError, match=r"kind 'mamba1' must be one that keeps a state"):
        layer_specs_from_config(BUILTIN_CONFIGS["jamba-like"], policies={"mamba1": FULL})
    with pytest.raises(ModelConfigError, match=r"'full_attention' must be one that keeps K/V"):
        layer_specs_from_config(
            BUILTIN_CONFIGS["bamba-like"], policies={"full_attention": MambaLike()}
        )


def test_bamba_and_granite_configs_give_mamba2_state_layers() -> None:
    """Bamba's attn_layer_indices and Granite's layer_types name the attention layers; a
    Mamba2 state is float32 conv (x, B, C by K-1) plus SSM (heads x head_dim x state)."""
    bamba = layer_specs_from_config(BUILTIN_CONFIGS["bamba-like"])
    assert [i for i, s in enumerate(bamba) if s.kind == "full_attention"] == [9, 18, 27]
    state = bamba[0]
    assert isinstance(state, StateSpec)
    assert state.state_bytes == 4 * ((8192 + 2 * 128) * 3 + 128 * 64 * 128)
    granite = layer_specs_from_config(BUILTIN_CONFIGS["granite-4.0-h-like"])
    assert [i for i, s in enumerate(granite) if s.kind == "full_attention"] == [9, 19, 29, 39]


def test_latent_attention_keeps_one_vector_a_token() -> None:
    """DeepSeek V3's and Kimi K2's layers keep the 512-value latent beside the 64-value
    rope key, 576 values a token and layer (18 KiB a page of 16 in bfloat16, not a K and
    a V per head); their pages are viewed with a K/V axis of stride 0, the values read
    from the keys' bytes."""
    import torch

    from hybridkv.executor.kv_caches import allocate_kv_caches
    from hybridkv.memory.layout_planner import plan_layout

    for name in ("deepseek-v3-like", "kimi-k2-like"):
        specs = layer_specs_from_config(BUILTIN_CONFIGS[name])
        assert len(specs) == 61
        assert all(isinstance(s, AttentionSpec) and s.latent for s in specs)
        assert {(s.num_kv_heads, s.head_dim, s.block_bytes(16)) for s in specs} == {
            (1, 576, 16 * 576 * 2)
        }
    plan = plan_layout(specs[:2], 1 << 20)
    views = allocate_kv_caches(plan, specs[:2], torch.bfloat16, torch.device("cpu"))
    assert [tuple(v.shape[1:]) for v in views] == [(2, 1, plan.block_size, 576)] * 2
    assert {v.stride(1) for v in views} == {0}
    views[0][1, 0, 0, 0, 0] = 1.0
    assert float(views[0][1, 1, 0, 0, 0]) == 1.0 and float(views[1].abs().sum()) == 0


def test_deepseek_v32_keeps_its_index_keys_beside_each_latent() -> None:
    """DeepSeek V3.2's layers keep the latent (18 KiB a page of 16) and, beside it, the
    indexer's 128-value key a token (4 KiB a page): a page of 36 KiB holds two latents or
    nine index keys, so the 122 memories take 38 slots where pages of the widest took
    122 (4 KiB of every 18 padding)."""
    from hybridkv.memory.layout import cached_layers
    from hybridkv.memory.layout_planner import plan_layout

    specs = layer_specs_from_config(BUILTIN_CONFIGS["deepseek-v3.2-like"])
    assert len(specs) == 61
    besides = [s.beside for s in specs if isinstance(s, AttentionSpec)]
    assert all(isinstance(b, AttentionSpec) and b.latent and b.head_dim == 128 for b in besides)
    plan = plan_layout(cached_layers(specs), 8 << 30)
    assert plan.block_bytes == 2 * 16 * 576 * 2
    assert len({plan.slot_of(s)[1] for s in cached_layers(specs)}) == 38


def test_deepseek_v4_layers_chain_a_window_its_entries_and_their_state() -> None:
    """DeepSeek V4-Flash's 43 layers each keep a window of 128 tokens of one 512-value
    vector, beside it compressed entries (CSA: 640 values an entry of 4 tokens, the
    indexer's 128 beside the attention's 512; HCA: 512 an entry of 128), and beside those
    the state of the tokens waiting for their entry; an entry page of 16 tokens holds 4
    CSA entries, or one HCA entry in every eighth block."""
    from hybridkv.memory.layout import memories
    from hybridkv.policies import CompressedEntries, MambaLike, SlidingWindow

    specs = layer_specs_from_config(BUILTIN_CONFIGS["deepseek-v4-like"])
    assert len(specs) == 43 and len(memories(specs)) == 3 * 43
    for spec in specs:
        assert isinstance(spec, AttentionSpec) and spec.latent and spec.head_dim == 512
        assert spec.policy == SlidingWindow(window=128)
        entries = spec.beside
        assert isinstance(entries, AttentionSpec) and isinstance(entries.beside, StateSpec)
        assert entries.beside.policy == MambaLike()
        rate = 4 if spec.kind == "compressed_sparse_attention" else 128
        assert entries.policy == CompressedEntries(rate=rate)
        assert entries.head_dim == (640 if rate == 4 else 512)
        assert entries.block_bytes(16) == max(1, 16 // rate) * entries.head_dim * 2
        assert entries.policy.page_blocks(0, 256, 16) == (None if rate == 4 else [7, 15])
