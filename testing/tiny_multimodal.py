"""Tiny multimodal checkpoints (Gemma 3, Llama 4, Gemma 4 with tiny vision towers), as
transformers builds them: the tests serve their text models (``--text-only``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

_TEXT: dict[str, Any] = {
    "vocab_size": 256,
    "hidden_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "sliding_window": 8,
    "pad_token_id": None,
    "bos_token_id": None,
    "eos_token_id": None,
}
_IMAGE_TOKENS: dict[str, Any] = {
    "image_token_index": 255,
    "boi_token_index": 254,
    "eoi_token_index": 253,
}


def _gemma3() -> Any:
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    vision = {"hidden_size": 32, "intermediate_size": 32, "num_hidden_layers": 1,
              "num_attention_heads": 2, "image_size": 28, "patch_size": 14}  # fmt: skip
    text = {**_TEXT, "intermediate_size": 96, "sliding_window_pattern": 2}
    config = Gemma3Config(
        text_config=text, vision_config=vision, mm_tokens_per_image=4, **_IMAGE_TOKENS
    )
    return Gemma3ForConditionalGeneration(config)


def _llama4() -> Any:
    from transformers import Llama4Config, Llama4ForConditionalGeneration

    vision = {"hidden_size": 32, "intermediate_size": 32, "num_hidden_layers": 1,
              "num_attention_heads": 2, "image_size": 28, "patch_size": 14,
              "vision_output_dim": 32, "projector_input_dim": 32,
              "projector_output_dim": 64}  # fmt: skip
    text = {**_TEXT, "intermediate_size": 32, "intermediate_size_mlp": 96,
            "num_local_experts": 4, "attention_chunk_size": 8}  # fmt: skip
    return Llama4ForConditionalGeneration(
        Llama4Config(text_config=text, vision_config=vision, **_IMAGE_TOKENS)
    )


def _gemma4() -> Any:
    """Gemma 4 with per-layer inputs and its last layer reading layer 2's cache."""
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration

    vision = {"hidden_size": 32, "intermediate_size": 32, "num_hidden_layers": 1,
              "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 16,
              "patch_size": 4, "pooling_kernel_size": 2,
              "position_embedding_size": 64}  # fmt: skip
    text = {**_TEXT, "intermediate_size": 96, "global_head_dim": 32,
            "layer_types": ["sliding_attention", "sliding_attention", "full_attention",
                            "full_attention"],
            "num_kv_shared_layers": 1, "hidden_size_per_layer_input": 16,
            "vocab_size_per_layer_input": 256, "pad_token_id": 0}  # fmt: skip
    config = Gemma4Config(
        text_config=text, vision_config=vision, image_token_id=255, boi_token_id=254,
        eoi_token_id=253, video_token_id=252, audio_token_id=251, boa_token_id=250,
        eoa_token_index=249,
    )  # fmt: skip
    return Gemma4ForConditionalGeneration(config)


#: Each multimodal model's builder, by name.
MULTIMODAL_BUILDERS: dict[str, Callable[[], Any]] = {
    "gemma3": _gemma3,
    "llama4": _llama4,
    "gemma4": _gemma4,
}
