"""Which pages a recurrent (mamba-like) layer reads and writes in a step: the contract.

A mamba-like group holds one page per block, like any group, but a page holds a state,
not the tokens' K/V. The KV cache manager and every executor (the model's Mamba2 layers,
the fake's checks) agree on what each page holds::

    tokens   0 1 2 3 | 4 5 6 7 | 8 9 . .     bs=4, 10 tokens computed
    page     [ s3  ] | [ s7  ] | [ s9  ]     s<t>: the state after token t

* A block's page, where it has one, holds the state after the last token of the block
  once the block is complete (a checkpoint), and the running state after the latest
  token while the block is being filled. A complete block's page is never written again.
* The manager gives a step over positions ``[start, end)`` a page only in the blocks its
  policy's ``page_blocks`` names (``MambaLike``: the block the step ends in, the block
  before it when that block ends inside the step, every k-th with ``checkpoint_every``);
  the other blocks of the step stay the null block, never read, never cached.
* The step reads the state after token ``start - 1`` from the page of block
  ``(start - 1) // bs`` (zeros when ``start`` is 0), and writes, in every block of the
  step that has a page, the state after its last token in that block. A prefill chunk
  takes those states from one pass of the scan; a decode that starts a block starts the
  new page from the previous block's.
* So the last full block of a request always holds a checkpoint once its step has run,
  as does every block a decode completed (a chat's next turn resumes from the end of the
  previous reply), and the block before ``(len - 1) // bs * bs`` of a prompt (its first
  repeat resumes there). Only pages, never null blocks, are cached, so a prefix hit of k
  blocks resumes from the page of block k-1 (``MambaLike.live_spans``), which holds the
  state after ``k * bs`` tokens. A block cached by an allocation whose step never ran is
  uncached again (``KVCacheManager.free(computed=False)``).
* A verification step (speculative decoding) runs proposed tokens after the request's
  own; it writes the states of the tokens verification keeps, and only those
  (:func:`verified_writes`), so no page ever holds a state of a rejected token.
* Within a step, a request may read a page another request of the same step fills (a
  prefix hit on blocks cached at allocation); executors run requests in batch order, so
  the writer, allocated first, runs first.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import attrs

from hybridkv.errors import HybridKVError
from hybridkv.memory.pool import NULL_BLOCK

#: A state layer's writer of a request's states: ``write(page_ids, token_rows)`` writes
#: the state after each of those tokens (rows of the step's own record) into those pages.
StateWriter = Callable[[list[int], list[int]], None]


class StateContractError(HybridKVError):
    """A step would read a state from a page that holds none for its boundary."""


@attrs.frozen
class StateAccess:
    """One request's state pages in one step.

    Attributes:
        read_page: The page holding the state the step starts from, or None (from zeros).
        writes: ``(tokens, page)`` pairs: after ``tokens`` of the step's tokens, the state
            goes to ``page``; one per block of the step that has a page, in order, the
            last after all tokens.
    """

    read_page: int | None
    writes: tuple[tuple[int, int], ...]


def read_page(start: int, table: Sequence[int], block_size: int) -> int | None:
    """The page holding the state after ``start`` tokens (None at 0: zeros).

    Raises:
        StateContractError: the table holds no page for the block of token ``start - 1``.
    """
    if start == 0:
        return None
    block = (start - 1) // block_size
    page = table[block] if block < len(table) else NULL_BLOCK
    if page == NULL_BLOCK:
        raise StateContractError(
            f"the state after {start} tokens is in block {block}, which the block table "
            "does not hold"
        )
    return page


def state_access(start: int, num_tokens: int, table: Sequence[int], block_size: int) -> StateAccess:
    """The pages a step of ``num_tokens`` tokens from position ``start`` reads and writes.

    Raises:
        StateContractError: the block of token ``start - 1`` is the null block in ``table``
            (nothing holds the state the step needs), or the block the step ends in is.
    """
    read = read_page(start, table, block_size)
    end = start + num_tokens
    last = (end - 1) // block_size
    if last >= len(table) or table[last] == NULL_BLOCK:
        raise StateContractError(
            f"block {last}, where a step over positions [{start}, {end}) ends, has no page"
        )
    writes = [
        ((block + 1) * block_size - start, table[block])
        for block in range(start // block_size, last)
        if table[block] != NULL_BLOCK
    ]
    writes.append((end - start, table[last]))
    return StateAccess(read, tuple(writes))


def verified_writes(access: StateAccess, num_kept: int) -> tuple[tuple[int, int], ...]:
    """The writes of a verification step whose first ``num_kept`` tokens were kept
    (speculative decoding): the step's ``access`` covers every token it ran, proposed
    ones included, with a page in every block they reach (``KVCacheManager.
    reserve_lookahead``); the kept tokens' states go to the same pages::

        tokens   | 8 9 10 11 | 12 13 14 .      bs=4, a step over [9, 15), 4 kept
        access   (3, s11), (6, s14)            the state after 3 tokens to s11, ...
        kept     (3, s11), (4, s14)            ... the running state after 4 to s14

    Raises:
        StateContractError: no block of the access holds token ``num_kept - 1``.
    """
    writes = [(count, page) for count, page in access.writes if count < num_kept]
    last = next((page for count, page in access.writes if count >= num_kept), None)
    if last is None or num_kept < 1:
        raise StateContractError(f"no page holds the state after {num_kept} kept tokens")
    writes.append((num_kept, last))
    return tuple(writes)


@attrs.frozen
class StepStates:
    """Every request's :class:`StateAccess` in one step, for one state group: what the
    layers of the group read instead of paged metadata (built once per step).

    Attributes:
        accesses: Per request, in batch order, its state pages.
        query_lens: Per request, the tokens it runs.
        num_drafts: Per request, the proposed tokens among them (speculative decoding;
            empty: none). A layer keeps such a request's state after each of its tokens
            in ``pending`` instead of writing its pages; once verification has said how
            many tokens are kept, :func:`verified_writes` says where their states go.
        pending: What the layers kept for the executor to write after verification: per
            (layer, request), the request's index and the layer's writer of the states
            after some of its tokens (``write(page_ids, token_rows)``), whatever its mixer.
    """

    accesses: tuple[StateAccess, ...]
    query_lens: tuple[int, ...]
    num_drafts: tuple[int, ...] = ()
    pending: list[tuple[int, StateWriter]] = attrs.field(factory=list, eq=False, repr=False)

    def write_verified(self, num_kept: Sequence[int]) -> None:
        """Write the states of the tokens verification kept (``num_kept``: per request of
        the step, its tokens kept; 0 for a request that failed) into the pages the
        contract names (:func:`verified_writes`); the rest are dropped."""
        for index, write in self.pending:
            if num_kept[index]:
                writes = verified_writes(self.accesses[index], num_kept[index])
                write([page for _, page in writes], [count - 1 for count, _ in writes])
        self.pending.clear()

    @classmethod
    def build(
        cls,
        query_lens: Sequence[int],
        context_lens: Sequence[int],
        tables: Sequence[Sequence[int]],
        block_size: int,
        span: int = 1,
        num_drafts: Sequence[int] = (),
    ) -> StepStates:
        """The accesses of a step's requests (``context_lens``: tokens after the step).

        ``span``: page ids one state page takes; the accesses then name state rows (page
        id // span), the index of the executor's state view (``executor/kv_caches.py``).

        Raises:
            StateContractError: as :func:`state_access`.
        """
        accesses = tuple(
            state_access(ctx - q, q, table, block_size)
            for q, ctx, table in zip(query_lens, context_lens, tables, strict=True)
        )
        if span > 1:
            accesses = tuple(
                StateAccess(
                    None if a.read_page is None else a.read_page // span,
                    tuple((n, page // span) for n, page in a.writes),
                )
                for a in accesses
            )
        return cls(accesses, tuple(query_lens), tuple(num_drafts) if any(num_drafts) else ())
