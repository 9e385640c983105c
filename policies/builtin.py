"""The built-in policies: full attention, sliding window, chunked local, compressed
entries, mamba-like."""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from typing import ClassVar

import attrs

from hybridkv.policies.base import (
    AttentionWindow,
    IsCached,
    MemoryPolicy,
    Span,
    cdiv,
    positive,
)
from hybridkv.policies.errors import PolicyError


@attrs.frozen
class FullAttention(MemoryPolicy):
    """Every earlier token stays resident: live tokens for position n are ``[0, n)``."""

    name: ClassVar[str] = "full"

    def live_spans(self, num_tokens: int) -> tuple[Span, ...]:
        return ((0, num_tokens),) if num_tokens > 0 else ()

    def attention_window(self) -> AttentionWindow:
        return AttentionWindow()  # causal: every key up to the query

    def first_live_block(self, num_tokens: int, block_size: int) -> int:
        return 0

    def next_release(self, num_tokens: int, block_size: int) -> int:
        return sys.maxsize  # nothing is ever released before the request ends

    def max_live_blocks(self, num_tokens: int, block_size: int) -> int:
        return cdiv(max(num_tokens, 1), block_size)

    def longest_hit(self, max_blocks: int, block_size: int, is_cached: IsCached) -> int:
        # Every block of the prefix is needed: the hit ends at the first miss.
        for i in range(max_blocks):
            if not is_cached(i):
                return i
        return max_blocks


@attrs.frozen
class SlidingWindow(MemoryPolicy):
    """Position n reads itself and the ``window - 1`` tokens before it (Mistral, Gemma).

    ``window`` counts the query token, as Hugging Face's ``sliding_window`` does::

        tokens   0 1 2 3 | 4 5 6 7 | 8 9 . .     bs=4, window=5, n=10
        live                   6 7   8 9        live_spans(10) == ((6, 10),)
    """

    name: ClassVar[str] = "sliding_window"
    window: int = attrs.field(validator=positive)

    def live_spans(self, num_tokens: int) -> tuple[Span, ...]:
        start = max(0, num_tokens - self.window + 1)
        return ((start, num_tokens),) if start < num_tokens else ()

    def attention_window(self) -> AttentionWindow:
        return AttentionWindow(self.window)

    def first_live_block(self, num_tokens: int, block_size: int) -> int:
        return max(0, num_tokens - self.window + 1) // block_size

    def next_release(self, num_tokens: int, block_size: int) -> int:
        # The first live block dies once the window start passes its end.
        first = self.first_live_block(num_tokens, block_size)
        return max(num_tokens + 1, (first + 1) * block_size + self.window - 1)

    def max_live_blocks(self, num_tokens: int, block_size: int) -> int:
        # A window of W-1 earlier tokens plus the write position spans at most this many.
        bound = cdiv(self.window - 1, block_size) + 1
        return min(bound, cdiv(max(num_tokens, 1), block_size))

    def longest_hit(self, max_blocks: int, block_size: int, is_cached: IsCached) -> int:
        # A prefix of k blocks needs only the run of cached blocks its window reads, so
        # scan right to left for the first run long enough (or one reaching block 0).
        need = cdiv(self.window - 1, block_size)
        if need == 0:
            return max_blocks
        run = 0
        for i in range(max_blocks - 1, -1, -1):
            if is_cached(i):
                run += 1
                if run >= need:
                    return i + run
            else:
                run = 0
        return run  # the run reaching block 0: the whole prefix [0, run) is cached


@attrs.frozen
class ChunkedLocal(MemoryPolicy):
    """Attention within fixed chunks (Llama 4's local layers): live ``[floor(n/C)*C, n)``."""

    name: ClassVar[str] = "chunked_local"
    chunk: int = attrs.field(validator=positive)

    def live_spans(self, num_tokens: int) -> tuple[Span, ...]:
        start = num_tokens // self.chunk * self.chunk
        return ((start, num_tokens),) if start < num_tokens else ()

    def next_release(self, num_tokens: int, block_size: int) -> int:
        return (num_tokens // self.chunk + 1) * self.chunk  # blocks die at chunk starts

    def max_live_blocks(self, num_tokens: int, block_size: int) -> int:
        # Chunks start at multiples of gcd(C, bs) within a block, so the latest a chunk
        # starts in its first block is bs - gcd; its C positions then span this many blocks.
        latest = block_size - math.gcd(self.chunk, block_size)
        bound = (latest + self.chunk - 1) // block_size + 1
        return min(bound, cdiv(max(num_tokens, 1), block_size))


@attrs.frozen
class CompressedEntries(MemoryPolicy):
    """Entries each made from ``rate`` consecutive tokens (DeepSeek V4's compressed
    attention): entry e is made from tokens ``[e * rate, (e + 1) * rate)``, written once
    its last token is computed and read by every later query. The tokens of an entry not
    yet complete wait in a small state of their own (``models/blocks/compressor.py``), so
    the live positions are the last token of each complete entry, for good.

    A page holds the entries its block's tokens complete, ``block_size // rate`` of them
    (``page_positions``), where the rate divides the block size; where it is a multiple
    of it, one entry in the page of the block its last token falls in, and the blocks
    before it in the same entry take no page (``page_blocks``) and stay null::

        tokens   0 1 2 3 | 4 5 6 7 | 8 9 . .     bs=4, rate=2: a page of 2 entries
        entries  [e0  e1] | [e2  e3] | [e4    ]
        tokens   0 .. 3 | 4 .. 7 | 8 .. 11 | 12 .. 15     bs=4, rate=8
        pages    [null ] | [ e0  ] | [null   ] | [ e1   ]

    So a page is a function of its block's prefix alone, and a prefix hit of k blocks
    resumes with every entry before ``k * block_size`` cached. Rates that are neither a
    divisor nor a multiple of the block size are refused.
    """

    name: ClassVar[str] = "compressed"
    rate: int = attrs.field(validator=positive)

    def live_spans(self, num_tokens: int) -> tuple[Span, ...]:
        r = self.rate
        return tuple((end - 1, end) for end in range(r, num_tokens // r * r + 1, r))

    def page_positions(self, block_size: int) -> int:
        if block_size % self.rate and self.rate % block_size:
            raise PolicyError(
                f"compressed entries of {self.rate} tokens in blocks of {block_size}: the "
                "block size must be a multiple or a divisor of the rate"
            )
        return max(1, block_size // self.rate)

    def _spread(self, block_size: int) -> int:
        """Blocks one entry spans (1 where a block holds whole entries)."""
        self.page_positions(block_size)  # refuses a block size it cannot take
        return max(1, self.rate // block_size)

    def page_blocks(
        self, start: int, end: int, block_size: int, checkpoints: Sequence[int] = ()
    ) -> Sequence[int] | None:
        spread = self._spread(block_size)
        if spread == 1:
            return None  # every block completes entries
        blocks = range(start // block_size, (end - 1) // block_size + 1)
        return [j for j in blocks if (j + 1) % spread == 0]

    def live_block_spans(self, num_tokens: int, block_size: int) -> tuple[Span, ...]:
        spread = self._spread(block_size)
        write = num_tokens // block_size
        if spread == 1:  # every block before the write block holds complete entries
            return ((0, write + 1),)
        # Every spread-th block holds an entry; the write block is held as always.
        spans = [(j, j + 1) for j in range(spread - 1, write, spread)]
        if spans and spans[-1][1] == write:
            return (*spans[:-1], (write - 1, write + 1))
        return (*spans, (write, write + 1))

    def next_release(self, num_tokens: int, block_size: int) -> int:
        # Entries live for good; only the write block of an entry's first blocks moves on.
        return (num_tokens // block_size + 1) * block_size

    def first_live_block(self, num_tokens: int, block_size: int) -> int:
        return min(self._spread(block_size) - 1, num_tokens // block_size)

    def max_live_blocks(self, num_tokens: int, block_size: int) -> int:
        # The held count grows with n: the entry blocks before the last block's start,
        # and that block.
        write = (max(num_tokens, 1) - 1) // block_size
        return write // self._spread(block_size) + 1

    def longest_hit(self, max_blocks: int, block_size: int, is_cached: IsCached) -> int:
        # A prefix is usable while the blocks of its complete entries are cached: the
        # first entry whose block is not bounds it.
        r = self.rate
        for e in range(max_blocks * block_size // r):
            if not is_cached(((e + 1) * r - 1) // block_size):
                return min(max_blocks, ((e + 1) * r - 1) // block_size)
        return max_blocks


@attrs.frozen
class MambaLike(MemoryPolicy):
    """A recurrent layer: position n needs only the state left by token n-1.

    A page holds the state after the last token of its block (``keeps_state``), so a
    request resumes from the page of the block holding token n-1; prefix caching keeps
    those pages at block boundaries::

        tokens   0 1 2 3 | 4 5 6 7 | 8 9 . .     bs=4, n=10
        live                           9        live_spans(10) == ((9, 10),)
        blocks   [null ] | [ s7  ] | [ s9  ]    s7 kept until block 2 is complete

    A step takes pages only where it leaves a state (``MemoryPolicy.page_blocks``, derived
    for every policy that keeps a state): the block it ends in, the last block boundary
    before its end (the checkpoint a repeat of a prompt resumes from), where the prompt
    leaves a prefix other requests share, and with ``checkpoint_every`` k, every k-th
    boundary it crosses.
    """

    name: ClassVar[str] = "mamba"
    keeps_state: ClassVar[bool] = True
    checkpoint_every: int | None = attrs.field(
        default=None, validator=attrs.validators.optional(positive)
    )

    def live_spans(self, num_tokens: int) -> tuple[Span, ...]:
        return ((num_tokens - 1, num_tokens),) if num_tokens > 0 else ()

    def checkpoint_interval(self) -> int | None:
        return self.checkpoint_every

    def next_release(self, num_tokens: int, block_size: int) -> int:
        # The state's block dies once token n-1 moves into the next block.
        return max(num_tokens + 1, ((num_tokens - 1) // block_size + 1) * block_size + 1)

    def max_live_blocks(self, num_tokens: int, block_size: int) -> int:
        # The state read, the last boundary's checkpoint and the running state of a step.
        return min(3, cdiv(max(num_tokens, 1), block_size))
