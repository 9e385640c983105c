"""Which pages a recurrent (mamba-like) layer reads and writes in a step: the contract.

A mamba-like group holds one page per block, like any group, but a page holds a state,
not the tokens' K/V. The KV cache manager and every executor (the model's Mamba2 layers,
the fake's checks) agree on what each page holds::

    tokens   0 1 2 3 | 4 5 6 7 | 8 9 . .     bs=4, 10 tokens computed
    page     [ s3  ] | [ s7  ] | [ s9  ]     s<t>: the state after token t

* The page of block j holds the state after the last token of block j once the block is
  complete (a checkpoint), and the running state after the latest token while the block
  is being filled. A complete block's page is never written again.
* A step running tokens ``[start, end)`` of a request reads the state after token
  ``start - 1`` from the page of block ``(start - 1) // bs`` (zeros when ``start`` is 0),
  and writes, for every block it touches, the state after its last token in that block.
  A prefill chunk therefore checkpoints every block boundary it crosses (the scan hands
  out those states in the same pass), and a decode that starts a block starts the new
  page from the previous block's.
* So every full block of a request holds a checkpoint by the time its step has run, and
  the manager may cache it like any other page: a prefix hit of k blocks resumes from the
  page of block k-1 (``MambaLike.live_spans``), which holds the state after ``k * bs``
  tokens. A block cached by an allocation whose step never ran is uncached again
  (``KVCacheManager.free(computed=False)``).
* Within a step, a request may read a page another request of the same step fills (a
  prefix hit on blocks cached at allocation); executors run requests in batch order, so
  the writer, allocated first, runs first.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from hybridkv.errors import HybridKVError
from hybridkv.memory.pool import NULL_BLOCK


class StateContractError(HybridKVError):
    """A step would read a state from a page that holds none for its boundary."""


@attrs.frozen
class StateAccess:
    """One request's state pages in one step.

    Attributes:
        read_page: The page holding the state the step starts from, or None (from zeros).
        writes: ``(tokens, page)`` pairs: after ``tokens`` of the step's tokens, the state
            goes to ``page``; one per block touched, in order, the last after all tokens.
    """

    read_page: int | None
    writes: tuple[tuple[int, int], ...]


def state_access(start: int, num_tokens: int, table: Sequence[int], block_size: int) -> StateAccess:
    """The pages a step of ``num_tokens`` tokens from position ``start`` reads and writes.

    Raises:
        StateContractError: the block of token ``start - 1`` is the null block in ``table``
            (nothing holds the state the step needs), or a block written is.
    """
    read = None
    if start > 0:
        read = table[(start - 1) // block_size] if (start - 1) // block_size < len(table) else 0
        if read == NULL_BLOCK:
            raise StateContractError(
                f"the state after {start} tokens is in block {(start - 1) // block_size}, "
                "which the block table does not hold"
            )
    end = start + num_tokens
    writes = []
    for block in range(start // block_size, (end - 1) // block_size + 1):
        page = table[block] if block < len(table) else NULL_BLOCK
        if page == NULL_BLOCK:
            raise StateContractError(
                f"block {block} of a step over positions [{start}, {end}) has no page"
            )
        writes.append((min((block + 1) * block_size, end) - start, page))
    return StateAccess(read, tuple(writes))
