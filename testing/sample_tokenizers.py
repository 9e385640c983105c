"""Tokenizers for tests, built in memory (no download): words, and bytes.

``word_tokenizer()`` reads and writes readable text (``"w2 w17 w5"``), one id per word;
``byte_tokenizer()`` gives one id per byte, so any text round-trips, emoji and accents
included (what the byte-level tokenizers of real models do, without their merges).
"""

from __future__ import annotations

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

#: The id of ``<eos>`` in :func:`word_tokenizer`.
WORD_EOS = 1
#: The id of ``<eos>`` in :func:`byte_tokenizer`.
BYTE_EOS = 256


def word_tokenizer(num_words: int = 62) -> Tokenizer:
    """A whitespace word-level tokenizer: ``[UNK]`` (0), ``<eos>`` (1), then ``w2`` ...
    ``w{num_words + 1}``, each its own id; decoding joins words with spaces."""
    vocab = {"[UNK]": 0, "<eos>": WORD_EOS}
    vocab.update({f"w{i}": i for i in range(2, num_words + 2)})
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tokenizer.add_special_tokens(["<eos>"])
    return tokenizer


def byte_tokenizer() -> Tokenizer:
    """A byte-level tokenizer: one token per byte (ids 0-255), then ``<eos>`` (256)."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokenizer = Tokenizer(models.BPE({c: i for i, c in enumerate(alphabet)}, []))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken("<eos>", special=True)])
    return tokenizer
