"""Generated token ids to text, one streamed delta at a time, cut at stop strings.

Tokens can split a character (byte-fallback tokens) and a stop string can span tokens,
so the stream holds back what it cannot emit yet::

    decoded   "... the end. #"     stop=("###",): hold back len("###") - 1 = 2 chars
    emitted   "... the end."       pending " #" (it may begin "###": wait for more)
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream


class TextStream:
    """Incremental detokenizer for one request.

    Attributes:
        text: Everything emitted so far (the deltas joined).
        is_stopped: A stop string was found; later tokens are ignored.
    """

    def __init__(self, tokenizer: Tokenizer, stop: Sequence[str] = ()) -> None:
        self._tokenizer = tokenizer
        self._decoder = DecodeStream(skip_special_tokens=True)
        self._stop = tuple(stop)
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
            piece = self._decoder.step(self._tokenizer, token_id)
            if piece:
                self._pending += piece
        cut = self._find_stop()
        if cut is not None:
            self.is_stopped = True
            return self._emit(cut, keep=False)
        return self._emit(max(len(self._pending) - self._hold, 0), keep=True)

    def finish(self) -> str:
        """The held-back text, once no token will follow."""
        return "" if self.is_stopped else self._emit(len(self._pending), keep=True)

    def _find_stop(self) -> int | None:
        hits = [i for i in (self._pending.find(s) for s in self._stop) if i >= 0]
        return min(hits) if hits else None

    def _emit(self, end: int, *, keep: bool) -> str:
        delta = self._pending[:end]
        self._pending = self._pending[end:] if keep else ""
        self.text += delta
        return delta
