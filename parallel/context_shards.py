"""Where a request's tokens live and are computed under context parallelism (cp ranks).

**Storage: round-robin KV.** The engine plans virtual blocks of ``block_size * cp``
tokens; page ``b`` of a virtual block table exists on every rank, and each rank's page
holds its ``block_size`` tokens of that virtual block, so each rank holds 1/cp of every
request's pages. Tokens are dealt in units of ``interleave`` tokens (1: one token, or
``block_size``: one block), ``cp = 2``, ``block_size = 4``::

    position        0 1 2 3 4 5 6 7 | 8 9 ...     virtual block 0 | 1
    interleave 1    0 1 0 1 0 1 0 1 | 0 1         owner rank
    interleave 4    0 0 0 0 1 1 1 1 | 0 0

A rank keeps its tokens in order at local indices 0, 1, 2, ...; local index ``l`` sits in
page ``table[l // block_size]`` at offset ``l % block_size``, as a one-rank cache would.

**Compute: 2 x cp chunks.** A prefill's new tokens are cut into ``2 * cp`` contiguous
chunks and rank i runs chunks i and ``2cp - 1 - i``, so every rank gets one early (cheap)
and one late (expensive) chunk of the causal triangle. Chunks differ by at most a token,
the longer ones last, so the request's last token is always in rank 0's second chunk::

    11 tokens, cp = 2    chunk  0: [0 1]  1: [2 3 4]  2: [5 6 7]  3: [8 9 10]
                         rank 0 runs chunks 0 and 3, rank 1 chunks 1 and 2

This module imports no torch.
"""

from __future__ import annotations

import attrs

from hybridkv.models.errors import ParallelConfigError


@attrs.frozen
class KVInterleave:
    """Round-robin placement of a request's tokens over ``cp`` ranks' pages.

    Attributes:
        cp: Context-parallel ranks.
        block_size: Tokens per page on one rank (a virtual block holds ``cp`` times this).
        unit: Consecutive tokens dealt to one rank (1 or ``block_size``; it divides it).
    """

    cp: int
    block_size: int
    unit: int = 1

    def __attrs_post_init__(self) -> None:
        if self.cp < 1 or self.block_size < 1:
            raise ParallelConfigError(
                f"cp ({self.cp}) and block_size ({self.block_size}) must be >= 1"
            )
        if self.unit < 1 or self.block_size % self.unit:
            raise ParallelConfigError(
                f"the KV interleave of {self.unit} tokens must divide the block size "
                f"{self.block_size} (1 interleaves tokens, {self.block_size} blocks)"
            )

    @property
    def virtual_block_size(self) -> int:
        """Tokens per block as the engine's allocator counts them."""
        return self.block_size * self.cp

    def owner(self, position: int) -> int:
        """The rank storing the token at ``position``."""
        return (position // self.unit) % self.cp

    def local_index(self, position: int) -> int:
        """Where the owner keeps ``position`` among its tokens of the request."""
        span = self.unit * self.cp
        return (position // span) * self.unit + position % self.unit

    def position(self, rank: int, local_index: int) -> int:
        """The global position of ``rank``'s token at ``local_index`` (the inverse)."""
        unit = self.unit
        return (local_index // unit) * unit * self.cp + rank * unit + local_index % unit

    def num_local(self, num_tokens: int, rank: int) -> int:
        """How many of positions ``[0, num_tokens)`` ``rank`` stores."""
        span = self.unit * self.cp
        rest = num_tokens % span - rank * self.unit
        return (num_tokens // span) * self.unit + min(max(rest, 0), self.unit)

    def local_range(self, start: int, stop: int, rank: int) -> range:
        """Local indices of ``rank``'s tokens among positions ``[start, stop)``."""
        return range(self.num_local(start, rank), self.num_local(stop, rank))


def prefill_chunks(start: int, num_tokens: int, cp: int) -> list[range]:
    """The ``2 * cp`` chunks of positions ``[start, start + num_tokens)``, in order.

    The last ``num_tokens % (2 * cp)`` chunks take one token more; early ones may be empty.
    """
    num_chunks = 2 * cp
    base, extra = divmod(num_tokens, num_chunks)
    chunks, first = [], start
    for j in range(num_chunks):
        size = base + (1 if j >= num_chunks - extra else 0)
        chunks.append(range(first, first + size))
        first += size
    return chunks


def rank_positions(start: int, num_tokens: int, cp: int, rank: int) -> list[int]:
    """The positions ``rank`` computes of a prefill: chunks ``rank`` and ``2cp-1-rank``."""
    chunks = prefill_chunks(start, num_tokens, cp)
    return [*chunks[rank], *chunks[2 * cp - 1 - rank]]
