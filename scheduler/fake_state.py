"""The fake executor's state pages: the mamba-like contract, checked strictly.

A group whose policy keeps state (``MemoryPolicy.keeps_state``) holds, per page, one
state: the fake's rolling hash after some token, and how many tokens it covers. A step
reads and writes exactly the pages ``hybridkv.memory.state_pages`` names, and a read
fails unless the page holds the state after exactly the tokens the step resumes from::

    page 7   (hash h(31), covers 32)    a step from position 32 reads it: fine
                                          a step from position 40 reads it: StateMismatch

So a prefix hit on a block whose page holds no checkpoint for its boundary (never
written, written for another boundary, or reused since) fails the step instead of
passing unnoticed.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

from hybridkv.errors import HybridKVError
from hybridkv.memory.state_pages import read_page, state_access


class FakeStateMismatchError(HybridKVError):
    """A state page does not hold the state the step resumes from."""


class FakeStatePages:
    """Per state group, each page's hash and the number of tokens that hash covers.

    Args:
        groups: The groups that keep state.
        num_blocks: Pages in the pool.
        block_size: Tokens per block.
        owner: Per page id, the group that wrote it last, shared with the K/V writes.
        span: Page ids one state page takes.
    """

    def __init__(
        self,
        groups: Sequence[int],
        num_blocks: int,
        block_size: int,
        *,
        owner: array[int] | None = None,
        span: int = 1,
    ) -> None:
        self.groups = tuple(groups)
        self.block_size = block_size
        self.span = span
        # Per page id, the group that wrote it last (shared with the K/V groups' writes).
        self._owner = owner if owner is not None else array("q", [-1]) * num_blocks
        self._hash = {g: array("Q", bytes(8 * num_blocks)) for g in self.groups}
        self._covers = {g: array("Q", bytes(8 * num_blocks)) for g in self.groups}

    def read(self, tables: Sequence[Sequence[int]], start: int) -> int | None:
        """The hash after token ``start - 1`` that every state group holds (None at 0).

        Raises:
            StateContractError: the table lacks the block of token ``start - 1``.
            FakeStateMismatchError: a page holds another boundary's state, or the groups
                disagree.
        """
        found: set[int] = set()
        for g in self.groups:
            page = read_page(start, tables[g], self.block_size)
            if page is None:
                continue
            ids = range(page, page + self.span)
            if any(self._owner[i] not in (g, -1) for i in ids):
                raise FakeStateMismatchError(
                    f"group {g} reads state page {page} (ids {ids.start}-{ids.stop - 1}), "
                    "which another group wrote into since"
                )
            if self._covers[g][page] != start:
                raise FakeStateMismatchError(
                    f"group {g} page {page} holds the state after {self._covers[g][page]} "
                    f"tokens; the step resumes after {start}"
                )
            found.add(self._hash[g][page])
        if len(found) > 1:
            raise FakeStateMismatchError(f"state groups disagree on the state after {start} tokens")
        return found.pop() if found else None

    def record(self, group: int, page: int) -> array[int]:
        """A state page's hash and the tokens it covers (what an offload tier stores)."""
        return array("Q", [self._hash[group][page], self._covers[group][page]])

    def restore(self, group: int, page: int, record: array[int]) -> None:
        """Write a stored :meth:`record` back into ``page`` of ``group`` (a load)."""
        self._hash[group][page], self._covers[group][page] = record
        self._own(group, page)

    def write(self, tables: Sequence[Sequence[int]], start: int, hashes: Sequence[int]) -> None:
        """Write the states of a step from ``start`` (``hashes[i]``: after token start+i)."""
        for g in self.groups:
            access = state_access(start, len(hashes), tables[g], self.block_size)
            for count, page in access.writes:
                self._hash[g][page] = hashes[count - 1]
                self._covers[g][page] = start + count
                self._own(g, page)

    def _own(self, group: int, page: int) -> None:
        """``group`` wrote the state page ``page``: every id of its span is now its."""
        self._owner[page : page + self.span] = array("q", [group]) * self.span
