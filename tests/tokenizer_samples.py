"""Tokenizers the tests share, built in memory (no download)."""

from __future__ import annotations

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

#: The id of ``<eos>`` in :func:`byte_tokenizer`.
BYTE_EOS = 256


def byte_tokenizer() -> Tokenizer:
    """A byte-level tokenizer: one token per byte (ids 0-255), then ``<eos>`` (256)."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokenizer = Tokenizer(models.BPE({c: i for i, c in enumerate(alphabet)}, []))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken("<eos>", special=True)])
    return tokenizer
