"""Incremental detokenization with stop strings."""

from __future__ import annotations

from tokenizers import Tokenizer

from hybridkv.serving.text import TextStream


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
