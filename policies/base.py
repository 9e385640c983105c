"""The memory policy base class: one hook, everything else derived from it.

A policy is pure arithmetic about token positions. It holds no state, imports no torch,
and knows nothing about pages or pools: ``hybridkv.memory`` turns its answers into block
tables. A new kind of layer is a subclass that writes :meth:`MemoryPolicy.live_spans`.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from typing import ClassVar

import attrs

from hybridkv.policies.errors import PolicyError

#: A half-open interval ``[start, end)`` of token positions or block indices.
Span = tuple[int, int]

#: How many block starts the generic ``max_live_blocks`` scans at each end of a request.
_SCAN_BLOCKS = 2048

#: The first doubling boundary (in blocks) a state policy keeps by default.
_DOUBLING_FROM = 16

#: Tells whether block i of a request's prefix is cached (for a given group).
IsCached = Callable[[int], bool]


def cdiv(a: int, b: int) -> int:
    """Ceiling division for non-negative ``a`` and positive ``b``."""
    return -(-a // b)


def positive(_: object, attribute: attrs.Attribute[int], value: int) -> None:
    """attrs validator: an integer parameter of a policy must be at least 1."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise PolicyError(f"{attribute.name} must be an integer >= 1, got {value!r}")


@attrs.frozen
class AttentionWindow:
    """Keys ``(p - size, p]`` for the query at position p: one run ending at the query.

    ``size`` counts the query itself, as Hugging Face's ``sliding_window`` does; None means
    no bound, every key ``[0, p]`` (causal attention). Attention kernels have fast paths for
    exactly this shape.
    """

    size: int | None = attrs.field(default=None, validator=attrs.validators.optional(positive))


@attrs.frozen
class MemoryPolicy(abc.ABC):
    """Which earlier tokens a layer must keep resident, and what follows from that.

    Subclasses are frozen attrs classes whose fields are the policy's parameters. The
    registry name is the class variable ``name``. Only :meth:`live_spans` is required;
    the other methods are derived from it and may be overridden for speed, never for
    meaning.
    """

    name: ClassVar[str] = ""

    #: A page of this policy's groups holds one state per block (a recurrent layer's),
    #: not the K/V of the block's tokens; executors read and write such pages as
    #: ``hybridkv.memory.state_pages`` says.
    keeps_state: ClassVar[bool] = False

    @abc.abstractmethod
    def live_spans(self, num_tokens: int) -> tuple[Span, ...]:
        """Positions that must still be resident to compute the token after the first n.

        ``num_tokens`` is n: positions ``0 .. n-1`` have been computed and position ``n`` is
        the one being computed now (its own K/V are written in the same step, so it is not
        part of the answer). Return sorted, disjoint, non-empty spans inside ``[0, n)``.

        Invariant (no resurrection): a position that is not live for n is not live for any
        later n' either. That is what lets the allocator free pages for good::

            tokens   0 1 2 3 | 4 5 6 7 | 8 9 . .     block_size=4, sliding window W=5, n=10
            live                   6 7   8 9          live_spans(10) == ((6, 10),)
            blocks   [null ] | [ b7  ] | [ b2  ]     block 0 is dead: freed, null in the table
        """

    # -- derived, for attention -------------------------------------------------------

    def attention_window(self) -> AttentionWindow | None:
        """The keys a query attends as one window ending at it, when they always are.

        A query at position p attends ``live_spans(p)`` plus p itself (its own key is written
        in the same step). When that is the run ``(p - size, p]`` for every p, the answer
        names the window and kernels take their fast path; None (the generic answer, always
        correct) sends attention through the live spans themselves::

            sliding window W=3     query 9 attends keys 7 8 9        AttentionWindow(3)
            sinks 2 + window 3     query 9 attends keys 0 1 . . 7 8 9   None: not one run

        Overrides are for speed, never for meaning: a window that differs from the live
        spans at any p would attend keys the allocator has released.
        """
        return None

    def page_blocks(
        self, start: int, end: int, block_size: int, checkpoints: Sequence[int] = ()
    ) -> Sequence[int] | None:
        """Blocks that take a page in a step over positions ``[start, end)``.

        None (the generic answer for K/V) means every block the positions touch: a page
        holds the K/V of its tokens, so each one needs its page. A policy that
        ``keeps_state`` holds one state per page (``hybridkv.memory.state_pages``) and
        keeps a checkpoint, the state after a block's last token, only where a future
        request may resume; the blocks without one stay the null block, never read::

            tokens   0 1 2 3 | 4 5 6 7 | 8 9 10 11 | 12 13 . .    bs=4, a step over [1, 14)
            pages    [null ] | [ s7  ] | [ s11   ] | [ s13  ]     checkpoints=(8,), the last
                                                                  boundary, the running state

        The checkpoints of a step: the running state in the block it ends in; the last
        block boundary before its end (a repeat of a prompt resumes there); every
        :meth:`checkpoint_interval` blocks, or where that is None the boundaries after
        16, 32, 64, ... blocks (a prompt that shares a prefix of b blocks with a later one
        leaves a state at b/2 blocks or more, for one page per doubling of its length:
        the later prompt is the first to know the prefix is shared); the token counts in
        ``checkpoints`` (block
        multiples the KV cache manager asks for: where a prompt leaves the prefix other
        requests share, so the next request with that prefix resumes at its end). A
        decode that completes a block leaves its state there, so a conversation resumes
        where its reply ended.
        """
        if not self.keeps_state:
            return None
        last = (end - 1) // block_size
        blocks = {last}
        if last * block_size > start:  # the boundary before the last block is in the step
            blocks.add(last - 1)
        first = start // block_size
        every = self.checkpoint_interval()
        if every is not None:
            blocks.update(j for j in range(first, last) if (j + 1) % every == 0)
        else:  # doubling boundaries: a prefix shared later resumes from half of it or more
            count = _DOUBLING_FROM
            while count <= last:
                if count > first:
                    blocks.add(count - 1)
                count *= 2
        for tokens in checkpoints:
            j = tokens // block_size - 1
            if start < tokens <= end and first <= j < last:
                blocks.add(j)
        return sorted(blocks)

    def page_positions(self, block_size: int) -> int:
        """Positions of its cache one page holds: a block's tokens (the generic answer), or
        fewer where a policy keeps one vector for several tokens (``CompressedEntries``:
        one entry a ``rate`` of them). A K/V page is this many vectors a KV head."""
        return block_size

    def checkpoint_interval(self) -> int | None:
        """For a policy that ``keeps_state``: keep a checkpoint every this many blocks of a
        long prefill (None: at doubling block counts, see :meth:`page_blocks`)."""
        return None

    # -- derived, in blocks ------------------------------------------------------------

    def live_block_spans(self, num_tokens: int, block_size: int) -> tuple[Span, ...]:
        """Blocks that must be held to compute position ``num_tokens`` (and write it).

        The live token spans map to the blocks they touch, and the block that position
        ``num_tokens`` is written into is always held::

            tokens   0 1 2 3 | 4 5 6 7 | 8 9 . .     bs=4, W=5, n=10
            spans    live tokens [6, 10) + write position 10 -> blocks [1, 3)
        """
        out: list[Span] = []
        for start, end in self.live_spans(num_tokens):
            first, stop = start // block_size, cdiv(end, block_size)
            if out and first <= out[-1][1]:
                out[-1] = (out[-1][0], max(out[-1][1], stop))
            else:
                out.append((first, stop))
        write = num_tokens // block_size
        if out and write < out[-1][1]:
            return tuple(out)
        if out and write == out[-1][1]:
            out[-1] = (out[-1][0], write + 1)
        else:
            out.append((write, write + 1))
        return tuple(out)

    def first_live_block(self, num_tokens: int, block_size: int) -> int:
        """Index of the first block still needed at ``num_tokens``; all before may be dead.

        Only an upper bound on what may be freed: a policy with several spans (sinks) keeps
        some early blocks, and the allocator asks :meth:`live_block_spans` for those.
        """
        return self.live_block_spans(num_tokens, block_size)[0][0]

    def next_release(self, num_tokens: int, block_size: int) -> int:
        """A token count before which no block held at ``num_tokens`` can become dead.

        The allocator skips its release scan until a request reaches this count. The
        generic answer, ``num_tokens + 1``, always scans; overriding it is only for speed
        and must never return a count past a block's death.
        """
        return num_tokens + 1

    def max_live_blocks(self, num_tokens: int, block_size: int) -> int:
        """Most blocks a request of ``num_tokens`` holds at once (for admission checks).

        Within one block of positions the held set only shrinks (no resurrection, and the
        write block stays), so the peak is at a position that starts a block::

            tokens   0 1 2 3 | 4 5 6 7 | 8 9       bs=4: held(8) >= held(9), held(4) >= held(7)

        The generic answer scans those positions, the first and the last
        ``_SCAN_BLOCKS`` of them for a long request, where a window-like policy has its
        transition and its steady state. Policies with a closed form override it.
        """
        starts: Sequence[int] = range(0, max(num_tokens, 1), block_size)
        if len(starts) > 2 * _SCAN_BLOCKS:
            starts = [*starts[:_SCAN_BLOCKS], *starts[-_SCAN_BLOCKS:]]
        return max(
            sum(stop - start for start, stop in self.live_block_spans(p, block_size))
            for p in starts
        )

    def is_hit_usable(self, num_tokens: int, block_size: int, is_cached: IsCached) -> bool:
        """Whether a cached prefix of ``num_tokens`` (a block multiple) can be resumed.

        It can when every block live for computing position ``num_tokens`` is cached, except
        the write block, which is new. ``is_cached(i)`` tells whether block i is cached.
        """
        for start, end in self.live_spans(num_tokens):
            for i in range(start // block_size, cdiv(end, block_size)):
                if not is_cached(i):
                    return False
        return True

    def longest_hit(self, max_blocks: int, block_size: int, is_cached: IsCached) -> int:
        """The largest ``k <= max_blocks`` such that a prefix of k blocks is usable.

        Returns a block count; 0 (no hit) is always usable. The generic search tries each
        length from the longest down; subclasses override it with a one-pass scan.
        """
        for k in range(max_blocks, 0, -1):
            if self.is_hit_usable(k * block_size, block_size, is_cached):
                return k
        return 0
