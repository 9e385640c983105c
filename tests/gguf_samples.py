"""GGUF files written by the tests with the ``gguf`` package, as llama.cpp's converter
lays them out (its tensor names, its q/k row order for Llama, float32 tensors, a byte-level
tokenizer of the 256 byte tokens), from tiny transformers checkpoints."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from hybridkv.testing.tiny_models import save_redrawn

#: Tiny models of the two GGUF architectures the tests write: Llama (q/k rows permuted in
#: the file) and Qwen3 (q/k norms; head dim 128, the one transformers' GGUF reader gives
#: Qwen3).
_SHAPE: dict[str, Any] = {
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "tie_word_embeddings": False,
    "pad_token_id": None,
    "bos_token_id": None,
    "eos_token_id": None,
}


def _model(arch: str) -> Any:
    import transformers

    if arch == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**_SHAPE))
    return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**_SHAPE, head_dim=128))


def _permuted(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's order of a Llama q or k projection's rows (pairs of each head's halves
    interleaved), which GGUF readers undo."""
    return (
        weight.reshape(heads, 2, weight.shape[0] // heads // 2, -1)
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def write_gguf(arch: str, folder: Path) -> tuple[Path, Path]:
    """A tiny ``arch`` (``llama`` or ``qwen3``) saved by transformers into ``folder/hf``
    and written as ``folder/<arch>.gguf``; returns both."""
    import gguf
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    hf = save_redrawn(_model(arch), folder / "hf")
    cfg = json.loads((hf / "config.json").read_text())
    layers = cfg["num_hidden_layers"]
    kind = gguf.MODEL_ARCH.LLAMA if arch == "llama" else gguf.MODEL_ARCH.QWEN3
    names = gguf.get_tensor_name_map(kind, layers)
    path = folder / f"{arch}.gguf"
    writer = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[kind])
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    writer.add_block_count(layers)
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(cfg["num_attention_heads"])
    writer.add_head_count_kv(cfg["num_key_value_heads"])
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    byte_chars = bytes_to_unicode()
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list([byte_chars[i] for i in range(256)])
    writer.add_token_types([1] * 256)
    writer.add_token_scores([0.0] * 256)
    writer.add_token_merges([])
    writer.add_eos_token_id(0)
    for name, tensor in load_file(hf / "model.safetensors").items():
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = cfg["num_attention_heads" if "q_proj" in name else "num_key_value_heads"]
            tensor = _permuted(tensor, heads)
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        assert gguf_name is not None, name
        writer.add_tensor(gguf_name, tensor.float().numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path, hf
