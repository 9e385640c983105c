"""Generated token ids to text, one streamed delta at a time, cut at stop strings.

Tokens can split a character, and a stop string can span tokens, so the stream holds
back what it cannot emit yet::

    decoded   "... the end. #"     stop=("###",): hold back len("###") - 1 = 2 chars
    emitted   "... the end."       pending " #" (it may begin "###": wait for more)

The deltas join to what one decode of all the tokens gives (``tokenizer.decode``, as
transformers' full decode does). Decoding re-reads a small window of recent tokens rather
than keeping a decoder's state: ``tokenizers``' ``DecodeStream`` raises on sequences
where later tokens change the text of earlier ones (byte-fallback tokens are decoded as a
run: ``<0xEF> <0xAC> <0x84>`` reads "ﬄ" alone, but five replacement characters once
``<0xF0> <0x9F>`` follow), which cut a stream mid-response. Text is therefore held back
while the last token is a byte-fallback token or the text ends in an unfinished
character (U+FFFD), and the window's earlier tokens give the context that decoders which
strip a leading space need::

    ids      ... | t5 t6 | t7 t8      window = ids[prefix:]; text of ids[prefix:read]
                 prefix  read         was emitted; emit decode(window) minus it
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

import attrs
from tokenizers import Tokenizer

_BYTE_TOKEN = re.compile(r"<0x[0-9A-Fa-f]{2}>")
_REPLACEMENT = "\ufffd"


@attrs.frozen
class TokenClasses:
    """The tokens a decoder treats apart, found once per tokenizer (it reads the whole
    vocabulary).

    Attributes:
        byte_ids: Byte-fallback tokens (``<0x00>`` .. ``<0xFF>``).
        special_ids: Special tokens (skipped by ``skip_special_tokens``).
    """

    byte_ids: frozenset[int] = frozenset()
    special_ids: frozenset[int] = frozenset()

    @classmethod
    def of(cls, tokenizer: Tokenizer) -> TokenClasses:
        """The classes of ``tokenizer``'s vocabulary."""
        byte_ids = frozenset(
            token_id
            for text, token_id in tokenizer.get_vocab().items()
            if len(text) == 6 and _BYTE_TOKEN.fullmatch(text)
        )
        added = tokenizer.get_added_tokens_decoder().items()
        return cls(byte_ids, frozenset(i for i, token in added if token.special))


class IncrementalDecoder:
    """Token ids in, new text out; the pieces join to ``tokenizer.decode(all ids)``.

    Args:
        tokenizer: The model's tokenizer.
        skip_special_tokens: Leave special tokens' text out (as ``decode`` does).
        classes: The tokenizer's byte-fallback and special tokens.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        skip_special_tokens: bool = True,
        classes: TokenClasses | None = None,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        classes = classes or TokenClasses()
        self._byte_ids = classes.byte_ids
        # Skipped tokens leave a run of byte tokens open: the run is decoded as a whole.
        self._transparent = classes.special_ids if skip_special_tokens else frozenset()
        self._in_byte_run = False
        self._ids: list[int] = []
        self._prefix = 0  # the window's start
        self._read = 0  # tokens whose text was emitted

    def step(self, token_id: int) -> str:
        """Add one token; the text that became final (maybe empty)."""
        self._ids.append(token_id)
        if token_id in self._byte_ids:
            self._in_byte_run = True
        elif not (self._in_byte_run and token_id in self._transparent):
            self._in_byte_run = False
        if self._in_byte_run:
            return ""  # a run of byte tokens decodes as a whole: wait for its end
        return self._advance(final=False)

    def flush(self) -> str:
        """The text held back, once no token will follow."""
        return self._advance(final=True)

    def _advance(self, *, final: bool) -> str:
        decode = self._tokenizer.decode
        window = self._ids[self._prefix :]
        new = decode(window, skip_special_tokens=self._skip)
        if not final and new.endswith(_REPLACEMENT):
            return ""  # an unfinished character: the next token may complete it
        old = decode(window[: self._read - self._prefix], skip_special_tokens=self._skip)
        if len(new) <= len(old):
            return ""  # e.g. a skipped special token
        self._prefix, self._read = self._read, len(self._ids)
        return new[len(old) :]


class TextStream:
    """Incremental detokenizer for one request, cut at stop strings.

    Args:
        tokenizer: The model's tokenizer.
        stop: Strings that end the text (the first found wins).
        include_stop: Keep the stop string found at the end of the text (vLLM's
            ``include_stop_str_in_output``).
        skip_special_tokens: Leave special tokens' text out.
        classes: The tokenizer's byte-fallback and special tokens.

    Attributes:
        text: Everything emitted so far (the deltas joined).
        is_stopped: A stop string was found; later tokens are ignored.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        stop: Sequence[str] = (),
        *,
        include_stop: bool = False,
        skip_special_tokens: bool = True,
        classes: TokenClasses | None = None,
    ) -> None:
        self._decoder = IncrementalDecoder(
            tokenizer, skip_special_tokens=skip_special_tokens, classes=classes
        )
        self._stop = tuple(stop)
        self._include_stop = include_stop
        # A stop string ending in new text starts at most this far back in old text.
        self._hold = max((len(s) for s in self._stop), default=1) - 1
        self._pending = ""
        self.text = ""
        self.is_stopped = False

    def push(self, token_ids: Iterable[int]) -> str:
        """Decode new tokens and return the text that is now safe to emit."""
        if self.is_stopped:
            return ""
        for token_id in token_ids:
            self._pending += self._decoder.step(token_id)
        return self._release(final=False)

    def finish(self) -> str:
        """The held-back text, once no token will follow."""
        if self.is_stopped:
            return ""
        self._pending += self._decoder.flush()
        return self._release(final=True)

    def _release(self, *, final: bool) -> str:
        hit = self._find_stop()
        if hit is not None:
            self.is_stopped = True
            start, stop = hit
            return self._emit(start + len(stop) if self._include_stop else start, keep=False)
        end = len(self._pending) if final else max(len(self._pending) - self._hold, 0)
        return self._emit(end, keep=True)

    def _find_stop(self) -> tuple[int, str] | None:
        hits = [(i, s) for s in self._stop if (i := self._pending.find(s)) >= 0]
        return min(hits) if hits else None

    def _emit(self, end: int, *, keep: bool) -> str:
        delta = self._pending[:end]
        self._pending = self._pending[end:] if keep else ""
        self.text += delta
        return delta
