"""config.json parsing: legacy field names read as transformers reads them, clear errors."""

from __future__ import annotations

import pytest
import torch

from hybridkv.models.checkpoint import architecture_for
from hybridkv.models.config import FULL, SLIDING
from hybridkv.models.errors import ModelConfigError
from hybridkv.models.gemma3 import parse_gemma3
from hybridkv.models.llama import parse_llama
from hybridkv.models.rope import RopeSpec

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
        torch.testing.assert_close(ours.rope[kind].inv_freq(32), expected, atol=0, rtol=1e-6)
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
        ours.inv_freq(128), _reference_inv_freq(reference), atol=0, rtol=1e-6
    )


def test_gemma3_query_scale_uses_query_pre_attn_scalar():
    """Gemma scales scores by query_pre_attn_scalar ** -0.5, not head_dim ** -0.5."""
    assert parse_gemma3(LEGACY_GEMMA3).query_scale == pytest.approx(24**-0.5)


def test_unknown_model_type_is_refused():
    """An architecture we do not implement is named in the error."""
    with pytest.raises(ModelConfigError, match="'mixtral'"):
        architecture_for("mixtral")


def test_unknown_rope_type_is_refused():
    """A rope scaling we do not implement is refused instead of silently ignored."""
    with pytest.raises(ModelConfigError, match="'yarn'"):
        RopeSpec.from_hf({"rope_type": "yarn", "factor": 4.0}, theta=1e4, max_positions=128)


def test_bidirectional_gemma3_is_refused():
    """Bidirectional Gemma 3 (an embedding model) is not a causal LM we can serve."""
    with pytest.raises(ModelConfigError, match="bidirectional"):
        parse_gemma3({**LEGACY_GEMMA3, "use_bidirectional_attention": True})


def test_layer_types_of_wrong_length_are_refused():
    """layer_types must name every layer."""
    with pytest.raises(ModelConfigError, match="layer_types has 2 entries"):
        parse_gemma3({**LEGACY_GEMMA3, "layer_types": [FULL, SLIDING]})
