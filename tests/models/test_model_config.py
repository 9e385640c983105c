"""config.json parsing: legacy field names read as transformers reads them, clear errors."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from hybridkv.executor.load_options import LoadOptions
from hybridkv.executor.model_executor import ModelExecutor
from hybridkv.models.blocks.rope import inv_freq
from hybridkv.models.config import FULL, SLIDING
from hybridkv.models.errors import ModelConfigError
from hybridkv.models.families import running_family
from hybridkv.models.families.gemma3 import parse_gemma3
from hybridkv.models.families.llama import parse_llama
from hybridkv.models.shapes.rope import RopeSpec
from hybridkv.models.specs import layer_specs_from_config
from hybridkv.policies import FullAttention, SlidingWindow

LEGACY_GEMMA3 = {
    "model_type": "gemma3_text",
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 12,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 32,
    "sliding_window": 16,
    "sliding_window_pattern": 6,
    "rope_theta": 1_000_000.0,
    "rope_local_base_freq": 10_000.0,
    "rope_scaling": {"rope_type": "linear", "factor": 8.0},
    "query_pre_attn_scalar": 24,
}


def _reference_inv_freq(config, layer_type=None):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = config.rope_parameters[layer_type] if layer_type else config.rope_parameters
    if params["rope_type"] == "default":
        head_dim = config.head_dim
        exps = torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim
        return 1.0 / (params["rope_theta"] ** exps)
    return ROPE_INIT_FUNCTIONS[params["rope_type"]](config, layer_type=layer_type)[0]


def test_legacy_gemma3_rope_fields_match_transformers():
    """rope_theta/rope_scaling feed full layers and rope_local_base_freq sliding ones."""
    from transformers import Gemma3TextConfig

    reference = Gemma3TextConfig(**{k: v for k, v in LEGACY_GEMMA3.items() if k != "model_type"})
    ours = parse_gemma3(LEGACY_GEMMA3)
    for kind in (FULL, SLIDING):
        expected = _reference_inv_freq(reference, kind)
        torch.testing.assert_close(inv_freq(ours.rope[kind], 32), expected, atol=0, rtol=1e-6)
    assert ours.rope[SLIDING].theta == 10_000.0


def test_legacy_gemma3_layer_pattern_matches_transformers():
    """Without layer_types, every sliding_window_pattern-th layer is full, as upstream."""
    from transformers import Gemma3TextConfig

    reference = Gemma3TextConfig(**{k: v for k, v in LEGACY_GEMMA3.items() if k != "model_type"})
    assert list(parse_gemma3(LEGACY_GEMMA3).layer_types) == reference.layer_types


def test_legacy_llama3_rope_scaling_matches_transformers():
    """A Llama 3.1-style rope_scaling block gives the reference inverse frequencies."""
    from transformers import LlamaConfig

    scaling = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    legacy = {
        "model_type": "llama",
        "vocab_size": 256,
        "hidden_size": 256,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "rope_theta": 500_000.0,
        "rope_scaling": scaling,
    }
    reference = LlamaConfig(**{k: v for k, v in legacy.items() if k != "model_type"})
    ours = parse_llama(legacy).rope[FULL]
    torch.testing.assert_close(
        inv_freq(ours, 128), _reference_inv_freq(reference), atol=0, rtol=1e-6
    )


def test_gemma3_query_scale_uses_query_pre_attn_scalar():
    """Gemma scales scores by query_pre_attn_scalar ** -0.5, not head_dim ** -0.5."""
    assert parse_gemma3(LEGACY_GEMMA3).query_scale == pytest.approx(24**-0.5)


def test_unknown_model_type_is_refused():
    """An architecture we do not implement is named in the error."""
    with pytest.raises(ModelConfigError, match="'mixtral'"):
        running_family("mixtral")


def test_unknown_rope_type_is_refused():
    """A rope scaling we do not implement is refused instead of silently ignored."""
    with pytest.raises(ModelConfigError, match=r"'su'.*proportional"):
        RopeSpec.from_hf({"rope_type": "su"}, theta=1e4, max_positions=128)


def test_bidirectional_gemma3_is_refused():
    """Bidirectional Gemma 3 (an embedding model) is not a causal LM we can serve."""
    with pytest.raises(ModelConfigError, match="bidirectional"):
        parse_gemma3({**LEGACY_GEMMA3, "use_bidirectional_attention": True})


def test_layer_types_of_wrong_length_are_refused():
    """layer_types must name every layer."""
    with pytest.raises(ModelConfigError, match="layer_types has 2 entries"):
        parse_gemma3({**LEGACY_GEMMA3, "layer_types": [FULL, SLIDING]})


def test_private_sliding_window_pattern_is_one_pattern_everywhere():
    """A Gemma 3 config with only _sliding_window_pattern gives one layer pattern to all."""
    cfg = {k: v for k, v in LEGACY_GEMMA3.items() if k != "sliding_window_pattern"}
    cfg["_sliding_window_pattern"] = 3
    config = parse_gemma3(cfg)
    assert list(config.layers) == layer_specs_from_config(cfg)
    assert [i for i, kind in enumerate(config.layer_types) if kind == FULL] == [2, 5, 8, 11]


def test_private_pattern_checkpoint_plans_and_attends_alike(tiny_models, tmp_path):
    """Planner groups, KV groups and attention layers follow the same pattern (2 here)."""
    shutil.copytree(tiny_models["gemma3"].path, tmp_path, dirs_exist_ok=True)
    hf = json.loads((tmp_path / "config.json").read_text())
    for key in ("layer_types", "sliding_window_pattern"):
        hf.pop(key, None)
    hf["_sliding_window_pattern"] = 2
    (tmp_path / "config.json").write_text(json.dumps(hf))
    executor = ModelExecutor.from_pretrained(
        tmp_path, LoadOptions(kv_cache_bytes=1 << 20, block_size=4)
    )
    expected = [SlidingWindow(8), FullAttention()] * 3
    assert [s.policy for s in layer_specs_from_config(hf)] == expected
    assert [s.policy for s in executor.specs] == expected  # what the KV groups keep
    windows = [layer.self_attn.sliding_window for layer in executor.model.model.layers]
    assert windows == [8, None] * 3


def test_malformed_field_is_named():
    """A field of the wrong type is refused as a ModelConfigError naming it."""
    with pytest.raises(ModelConfigError, match=r"'rms_norm_eps' must be a number, got 'tiny'"):
        parse_gemma3({**LEGACY_GEMMA3, "rms_norm_eps": "tiny"})
    with pytest.raises(ModelConfigError, match=r"'eos_token_id'"):
        parse_llama({**LEGACY_GEMMA3, "model_type": "llama", "eos_token_id": "</s>"})


def test_layers_carry_the_kv_dtype_and_chosen_policies():
    """The parsed layers are the planner's specs: dtype bytes and per-kind choices included."""
    choice = SlidingWindow(32)
    config = parse_gemma3(LEGACY_GEMMA3, dtype_bytes=4, policies={FULL: choice})
    assert {s.dtype_bytes for s in config.layers} == {4}
    assert [s.policy for s in config.layers if s.kind == FULL] == [choice, choice]
