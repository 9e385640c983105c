"""Tiny random-weight checkpoints, written with transformers (``save_pretrained``): real
model folders for tests, made in a moment and without a download.

``save_tiny_llama(folder)`` writes a 2-layer Llama (64 wide, a vocabulary of the
257 ids of :func:`~hybridkv.testing.byte_tokenizer`, which it saves beside it), and
returns the folder; ``ModelExecutor.from_pretrained(folder, ...)`` and ``hybridkv serve
FOLDER`` load it like any checkpoint. Needs transformers (``pip install transformers``).
"""

from __future__ import annotations

from pathlib import Path

from hybridkv.testing.sample_tokenizers import BYTE_EOS, byte_tokenizer


def save_tiny_llama(folder: Path, *, num_layers: int = 2, seed: int = 0) -> Path:
    """A random Llama of ``num_layers`` layers with the byte tokenizer, in ``folder``
    (made if missing): config.json, model.safetensors, tokenizer.json.

    Raises:
        ModuleNotFoundError: transformers is not installed.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=BYTE_EOS + 1,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        eos_token_id=BYTE_EOS,
        bos_token_id=None,
        tie_word_embeddings=False,
    )
    generator = torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # norms too: ones would hide a wrong norm formula
        for param in model.parameters():
            param.normal_(0.0, 0.5, generator=generator)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    byte_tokenizer().save(str(folder / "tokenizer.json"))
    return folder
