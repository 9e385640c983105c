"""Incremental detokenization with stop strings."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer

from hybridkv.serving.openai.text import TextStream, TokenClasses


def ids(tokenizer: Tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text).ids


def test_deltas_join_to_the_decoded_text(word_tokenizer: Tokenizer) -> None:
    """Pushing tokens one by one emits the same text as decoding them at once."""
    tokens = ids(word_tokenizer, "w2 w3 w4 w5")
    stream = TextStream(word_tokenizer)
    text = "".join(stream.push([t]) for t in tokens) + stream.finish()
    assert text == word_tokenizer.decode(tokens)


def test_stop_string_cuts_the_text(word_tokenizer: Tokenizer) -> None:
    """Text from the stop string on is never emitted, and the stream stops."""
    stream = TextStream(word_tokenizer, stop=("w4",))
    text = "".join(stream.push([t]) for t in ids(word_tokenizer, "w2 w3 w4 w5"))
    assert (text, stream.is_stopped) == ("w2 w3 ", True)


def test_stop_string_spanning_tokens_is_found(word_tokenizer: Tokenizer) -> None:
    """A stop string made of two tokens' text is caught although no token holds it."""
    stream = TextStream(word_tokenizer, stop=("w3 w4",))
    text = "".join(stream.push([t]) for t in ids(word_tokenizer, "w2 w3 w4 w5"))
    assert (text, stream.is_stopped) == ("w2 ", True)


def test_text_that_may_begin_a_stop_string_is_held_back(word_tokenizer: Tokenizer) -> None:
    """The tail that could start a stop string waits, and finish() releases it."""
    stream = TextStream(word_tokenizer, stop=("w3 w9",))
    emitted = stream.push(ids(word_tokenizer, "w2 w3"))
    assert emitted + stream.finish() == "w2 w3"
    assert emitted != "w2 w3"


def byte_fallback_tokenizer() -> Tokenizer:
    """A tokenizer decoding as Gemma's does: byte-fallback tokens, then fused text."""
    from tokenizers import AddedToken, decoders, models

    pieces = ["<unk>", "<0xEF>", "<0xAC>", "<0x84>", "<0xF0>", "<0x9F>", "🌏", "▁sea"]
    model = models.BPE({p: i for i, p in enumerate(pieces)}, [], byte_fallback=True)
    tokenizer = Tokenizer(model)
    tokenizer.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    tokenizer.add_special_tokens([AddedToken("<eos>", special=True)])
    return tokenizer


def stream_text(stream: TextStream, token_ids: list[int]) -> str:
    return "".join(stream.push([t]) for t in token_ids) + stream.finish()


def test_byte_run_that_turns_invalid_decodes_as_a_whole() -> None:
    """Bytes that read "ﬄ" alone but not before a 4-byte prefix come out as decode gives them.

    The sequence that made tokenizers' DecodeStream raise mid-stream.
    """
    tokenizer = byte_fallback_tokenizer()
    ids = [1, 2, 3, 4, 5, 6]
    stream = TextStream(tokenizer, classes=TokenClasses.of(tokenizer))
    assert stream_text(stream, ids) == tokenizer.decode(ids) == "\ufffd" * 5 + "🌏"


def test_skipped_special_token_keeps_a_byte_run_open() -> None:
    """A special token inside a run of byte tokens does not end the run."""
    tokenizer = byte_fallback_tokenizer()
    eos = tokenizer.token_to_id("<eos>")
    ids = [1, 2, 3, eos, 4, 5, 7]
    stream = TextStream(tokenizer, classes=TokenClasses.of(tokenizer))
    assert stream_text(stream, ids) == tokenizer.decode(ids)


def test_special_tokens_are_kept_when_asked() -> None:
    """With skip_special_tokens=False the text holds the special tokens' text."""
    tokenizer = byte_fallback_tokenizer()
    eos = tokenizer.token_to_id("<eos>")
    stream = TextStream(tokenizer, skip_special_tokens=False)
    assert stream_text(stream, [7, eos]) == " sea<eos>"


def test_include_stop_keeps_the_stop_string(word_tokenizer: Tokenizer) -> None:
    """include_stop ends the text with the stop string found."""
    stream = TextStream(word_tokenizer, stop=("w4",), include_stop=True)
    text = "".join(stream.push([t]) for t in ids(word_tokenizer, "w2 w3 w4 w5"))
    assert (text, stream.is_stopped) == ("w2 w3 w4", True)


def test_gemma_sequence_that_cut_streams() -> None:
    """The built-in Gemma 3 tokenizer's failing sequence streams as its full decode."""
    from hybridkv.serving.cli.builtin_models import cache_dir

    path = cache_dir() / "gemma-3-270m" / "tokenizer.json"
    if not path.is_file():
        pytest.skip("the built-in Gemma 3 checkpoint has not been converted here")
    tokenizer = Tokenizer.from_file(str(path))
    ids = [477, 410, 370, 478, 397, 248821]
    stream = TextStream(tokenizer, classes=TokenClasses.of(tokenizer))
    assert stream_text(stream, ids) == tokenizer.decode(ids, skip_special_tokens=True)
