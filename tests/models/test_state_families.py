"""Gated DeltaNet families (Qwen3-Next, Qwen3.5, Kimi Linear's and Ling's delta attention) beyond
the shared hybrid scenarios (``test_mamba_hybrid.py``): prompts over several of the delta
rule's chunks, the loader
leaving the multi-token prediction layers unread, and layer kinds from the pattern."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from hybridkv.executor.load_options import LoadOptions
from hybridkv.executor.model_executor import ModelExecutor
from hybridkv.memory.layout import StateSpec
from hybridkv.models.errors import ModelConfigError
from hybridkv.models.kinds import DELTANET, FULL
from hybridkv.models.specs import layer_specs_from_config


@pytest.mark.parametrize(
    "name", ["qwen3_next", "qwen3_5", "kimi_linear", "bailing_hybrid", "deepseek_v4"]
)
def test_a_prompt_over_three_chunks_matches(
    name: str, tiny_models: Any, make_driver: Any, prompt_of: Any, check_reference: Any
) -> None:
    """150 tokens prefilled in chunks of 70 (the delta rule's chunks are 64), then decodes."""
    driver = make_driver(name, block_size=16)
    driver.add("a", prompt_of(150, 4))
    driver.run(4, chunk=70)
    check_reference(tiny_models[name], driver, "a")


@pytest.mark.parametrize(
    "name", ["qwen3_next", "olmo_hybrid", "kimi_linear", "bailing_hybrid", "deepseek_v4"]
)
def test_decodes_run_in_bfloat16(name: str, tiny_models: Any, drive: Any, prompt_of: Any) -> None:
    """The delta rule's decode gives its output in the model's dtype (bfloat16 decodes
    once stopped at a float32 output): the logits stay within bfloat16's reach of the
    float32 reference (at most 0.11 of the largest logit measured on these models)."""
    options = LoadOptions(kv_cache_bytes=1 << 20, block_size=4, dtype=torch.bfloat16)
    driver = drive(ModelExecutor.from_pretrained(tiny_models[name].path, options))
    prompt = prompt_of(30, 1)
    driver.add("a", prompt)
    driver.run(3)
    output = driver.active["a"].output
    expected = tiny_models[name].reference_logits(prompt + output[:-1])[len(prompt) - 1 :]
    got = torch.stack(driver.logits["a"]).float()
    reach = _BFLOAT16_REACH.get(name, 0.15)
    assert float((got - expected).abs().max()) <= reach * float(expected.abs().max())


#: DeepSeek V4's tiny model drifts further in bfloat16 (hyper-connections, clamped
#: experts, three softmaxes a layer): transformers' own bfloat16 forward differs from its
#: float32 one by 0.22 of the largest logit on a 33-token prompt, as ours does here.
_BFLOAT16_REACH = {"deepseek_v4": 0.3}


def test_multi_token_prediction_layers_are_left_unread(
    tiny_models: Any, tmp_path: Path, drive: Any, prompt_of: Any, check_reference: Any
) -> None:
    """A checkpoint with Qwen3-Next's ``mtp.*`` tensors beside the model loads, and serves
    the model's logits."""
    folder = tmp_path / "with_mtp"
    shutil.copytree(tiny_models["qwen3_next"].path, folder)
    save_file({"mtp.fc.weight": torch.zeros(64, 128)}, str(folder / "mtp.safetensors"))
    executor = ModelExecutor.from_pretrained(folder, LoadOptions(kv_cache_bytes=1 << 20))
    driver = drive(executor)
    driver.add("a", prompt_of(20, 1))
    driver.run(3)
    check_reference(tiny_models["qwen3_next"], driver, "a")


def test_layer_kinds_follow_full_attention_interval() -> None:
    """Without ``layer_types``, every ``full_attention_interval``-th layer is attention and
    the rest DeltaNet state layers named ``linear_attn``, sized by their shape."""
    config = {
        "model_type": "qwen3_next", "num_hidden_layers": 6, "hidden_size": 64,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "full_attention_interval": 3, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
        "linear_key_head_dim": 8, "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4,
    }  # fmt: skip
    specs = layer_specs_from_config(config)
    assert [s.kind for s in specs] == [DELTANET, DELTANET, FULL] * 2
    assert specs[0].name == "model.layers.0.linear_attn"
    conv, memory = (2 * 16 + 64) * 3, 4 * 8 * 16
    state = specs[0]
    assert isinstance(state, StateSpec) and state.state_bytes == 4 * (conv + memory)


def test_olmo_hybrid_without_rope_matches(
    tiny_models: Any, tmp_path: Path, drive: Any, prompt_of: Any, check_reference: Any
) -> None:
    """OLMo Hybrid as released (``rope_theta`` null: its attention layers without rope)
    gives transformers' logits."""
    import json

    from model_fixtures import TinyModel

    folder = tmp_path / "nope"
    shutil.copytree(tiny_models["olmo_hybrid"].path, folder)
    config = json.loads((folder / "config.json").read_text())
    nope = {"rope_type": "default", "rope_theta": None}
    (folder / "config.json").write_text(json.dumps({**config, "rope_parameters": nope}))
    reference = TinyModel.load("olmo_hybrid", folder)
    driver = drive(ModelExecutor.from_pretrained(folder, LoadOptions(kv_cache_bytes=1 << 20)))
    driver.add("a", prompt_of(40, 2))
    driver.run(4)
    check_reference(reference, driver, "a")


def test_nemotron_h_kinds_from_its_pattern_and_its_mlp_layers_keep_nothing() -> None:
    """``hybrid_override_pattern``'s letters give the kinds; ``-`` and ``E`` (experts,
    Nemotron 3) layers keep nothing, and a policy chosen for them is refused by name, as
    are experts the groups do not divide and latent projections with biases."""
    from hybridkv.memory.layout import NoCacheSpec
    from hybridkv.models.errors import ModelConfigError
    from hybridkv.models.families import family_for, normalized
    from hybridkv.models.published_shapes import BUILTIN_CONFIGS
    from hybridkv.policies import make_policy

    config = BUILTIN_CONFIGS["nemotron-h-8b-like"]
    specs = layer_specs_from_config(config)
    assert [s.kind for s in specs[:9]] == ["mamba", "mlp"] * 3 + ["mamba", "full_attention", "mlp"]
    assert all(isinstance(s, NoCacheSpec) for s in specs if s.kind == "mlp")
    with pytest.raises(ModelConfigError, match="layer kind 'mlp', whose layers keep nothing"):
        layer_specs_from_config(config, policies={"mlp": make_policy("full")})
    family = family_for("nemotron_h")
    assert family is not None and family.parse is not None
    parse = family.parse

    def parse_config(cfg: dict[str, Any]) -> Any:
        return parse(normalized(family, {**cfg, "vocab_size": 256}))

    nano = BUILTIN_CONFIGS["nemotron-3-nano-30b-a3b-like"]
    specs = layer_specs_from_config(nano)
    assert [s.kind for s in specs[:6]] == [
        "mamba",
        "moe",
        "mamba",
        "moe",
        "mamba",
        "full_attention",
    ]
    assert sum(isinstance(s, NoCacheSpec) for s in specs) == 23
    experts = parse_config(nano).experts
    assert experts is not None and (experts.num_experts, experts.top_k) == (128, 6)
    assert (experts.activation, experts.shared_inner, experts.route_scale) == ("relu2", 3712, 2.5)
    with pytest.raises(
        ModelConfigError, match="n_routed_experts=128 is not a multiple of n_group=3"
    ):
        parse_config({**nano, "n_group": 3})
    with pytest.raises(ModelConfigError, match="mlp_bias"):
        parse_config({**nano, "mlp_bias": True})


def test_falcon_h1_layers_keep_attention_and_a_state_side_by_side() -> None:
    """Each Falcon-H1 layer is full attention with a Mamba2 beside it: two memories, named
    as the checkpoint names the mixers, each of its own kind's policy (chosen per kind);
    a policy for the layer's own kind and bad multipliers are refused by name."""
    from hybridkv.memory.layout import AttentionSpec, cached_layers
    from hybridkv.models.errors import ModelConfigError
    from hybridkv.models.families import family_for, normalized
    from hybridkv.models.published_shapes import BUILTIN_CONFIGS
    from hybridkv.policies import MambaLike, SlidingWindow

    config = BUILTIN_CONFIGS["falcon-h1-7b-like"]
    chosen = {"full_attention": SlidingWindow(64), "mamba": MambaLike(checkpoint_every=4)}
    specs = layer_specs_from_config(config, policies=chosen)
    assert all(isinstance(s, AttentionSpec) and s.beside is not None for s in specs)
    memories = cached_layers(specs)
    assert [s.name for s in memories[:3]] == [
        "model.layers.0.self_attn",
        "model.layers.0.mamba",
        "model.layers.1.self_attn",
    ]
    assert [type(s.policy) for s in memories[:2]] == [SlidingWindow, MambaLike]
    assert memories[1].state_bytes == 4 * ((3072 + 2 * 256) * 3 + 24 * 128 * 256)
    with pytest.raises(ModelConfigError, match="no layers of that kind; its kinds: full_att"):
        layer_specs_from_config(config, policies={"hybrid": SlidingWindow(64)})
    family = family_for("falcon_h1")
    assert family is not None and family.scales is not None
    with pytest.raises(ModelConfigError, match="'mlp_multipliers' must be 2 numbers"):
        family.scales(normalized(family, {**config, "mlp_multipliers": [1.0]}))


def test_zamba2_hybrid_layers_keep_a_kv_per_use_and_read_blocks_from_their_first_use() -> None:
    """Zamba2's hybrid layers each keep their use's K/V beside their Mamba2 state (heads
    of 2 x hidden / heads); the later uses of a block read its first use's tensors;
    adapters with fewer KV heads than query heads are refused by name."""
    from hybridkv.memory.layout import AttentionSpec, StateSpec
    from hybridkv.models.errors import ModelConfigError
    from hybridkv.models.families import family_for, normalized
    from hybridkv.models.published_shapes import BUILTIN_CONFIGS

    config = BUILTIN_CONFIGS["zamba2-7b-like"]
    specs = layer_specs_from_config(config)
    hybrid = [i for i, s in enumerate(specs) if isinstance(s, AttentionSpec)]
    assert hybrid == list(range(5, 81, 6))
    assert all(isinstance(s, StateSpec) for i, s in enumerate(specs) if i not in hybrid)
    attention = specs[5]
    assert isinstance(attention, AttentionSpec) and attention.head_dim == 2 * 3584 // 32
    assert attention.beside is not None and attention.beside.name == "model.layers.5.mamba"
    family = family_for("zamba2")
    assert family is not None and family.shared_weights is not None
    shared = family.shared_weights(normalized(family, config))
    assert shared["model.layers.17.shared_transformer."] == "model.layers.5.shared_transformer."
    assert shared["model.layers.23.shared_transformer."] == "model.layers.11.shared_transformer."
    assert "model.layers.5.shared_transformer." not in shared
    assert family.parse is not None
    with pytest.raises(ModelConfigError, match="adapters need num_key_value_heads equal"):
        family.parse(normalized(family, {**config, "num_key_value_heads": 8, "vocab_size": 256}))


def test_kimi_linear_reads_the_hubs_linear_attn_config(
    tiny_models: Any, tmp_path: Path, drive: Any, prompt_of: Any, check_reference: Any
) -> None:
    """Kimi Linear's hub config names its layers in ``linear_attn_config`` (counted from 1)
    with the delta attention's heads, width and taps: read as transformers reads them, the
    model gives its logits; ``hybridkv plan``'s row at the published shape has 20 delta
    attention layers and 7 of one 576-value latent."""
    import json

    from hybridkv.models.published_shapes import BUILTIN_CONFIGS

    folder = tmp_path / "hub"
    shutil.copytree(tiny_models["kimi_linear"].path, folder)
    config = json.loads((folder / "config.json").read_text())
    kinds = config.pop("layer_types")
    config["linear_attn_config"] = {
        "full_attn_layers": [i + 1 for i, k in enumerate(kinds) if k == "full_attention"],
        "kda_layers": [i + 1 for i, k in enumerate(kinds) if k == "linear_attention"],
        "num_heads": config.pop("linear_num_heads"),
        "head_dim": config.pop("linear_head_dim"),
        "short_conv_kernel_size": config.pop("linear_conv_kernel_dim"),
    }
    (folder / "config.json").write_text(json.dumps(config))
    executor = ModelExecutor.from_pretrained(folder, LoadOptions(kv_cache_bytes=1 << 20))
    assert executor.config.layer_types == (DELTANET, FULL, DELTANET, FULL)
    driver = drive(executor)
    driver.add("a", prompt_of(70, 5))
    driver.run(3)
    check_reference(tiny_models["kimi_linear"], driver, "a")
    specs = layer_specs_from_config(BUILTIN_CONFIGS["kimi-linear-48b-a3b-like"])
    assert [i for i, s in enumerate(specs) if s.kind == FULL] == [3, 7, 11, 15, 19, 23, 26]
    state = specs[0]
    assert isinstance(state, StateSpec) and state.state_bytes == 4 * (3 * 4096 * 3 + 32 * 128**2)
    assert {(s.head_dim, s.latent) for s in specs if s.kind == FULL} == {(576, True)}


def test_ling_reads_its_hub_config_and_refuses_clipped_experts(
    tiny_models: Any, tmp_path: Path, drive: Any, prompt_of: Any, check_reference: Any
) -> None:
    """Ling's hub config names the delta attention's heads by the model's (``head_dim``,
    ``short_conv_kernel_size``) and its layers by ``layer_group_size``: read so, the model
    gives its logits; experts whose SwiGLU is clipped are refused by name."""
    import json

    folder = tmp_path / "hub"
    shutil.copytree(tiny_models["bailing_hybrid"].path, folder)
    config = json.loads((folder / "config.json").read_text())
    for name in ("layer_types", "linear_num_heads", "linear_head_dim", "linear_conv_kernel_dim"):
        config.pop(name)
    (folder / "config.json").write_text(json.dumps({**config, "head_dim": 16}))
    executor = ModelExecutor.from_pretrained(folder, LoadOptions(kv_cache_bytes=1 << 20))
    assert executor.config.layer_types == (DELTANET, FULL, DELTANET, FULL)
    driver = drive(executor)
    driver.add("a", prompt_of(70, 6))
    driver.run(3)
    check_reference(tiny_models["bailing_hybrid"], driver, "a")
    limits = {**config, "head_dim": 16, "expert_swiglu_limit_list": [0, 7.0, 7.0, 7.0]}
    (folder / "config.json").write_text(json.dumps(limits))
    with pytest.raises(ModelConfigError, match="'expert_swiglu_limit_list' clips"):
        ModelExecutor.from_pretrained(folder, LoadOptions(kv_cache_bytes=1 << 20))
