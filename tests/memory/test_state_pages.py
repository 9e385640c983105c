"""The state-page contract: which page a step of a mamba-like group reads and writes."""

from __future__ import annotations

import pytest

from hybridkv.memory.state_pages import StateAccess, StateContractError, state_access


def test_a_prefill_from_zero_checkpoints_every_block_it_crosses() -> None:
    """Tokens [0, 10) at bs=4: states after 4 and 8 tokens, then the running state."""
    assert state_access(0, 10, [7, 3, 9], 4) == StateAccess(None, ((4, 7), (8, 3), (10, 9)))


def test_a_chunk_resumes_from_the_block_of_its_previous_token() -> None:
    """Tokens [6, 9) read block 1 (state after 6), write blocks 1 and 2."""
    assert state_access(6, 3, [0, 3, 9], 4) == StateAccess(3, ((2, 3), (3, 9)))


def test_a_decode_starting_a_block_starts_its_page_from_the_previous_one() -> None:
    """Token 8 reads the checkpoint of block 1 and writes the new page of block 2."""
    assert state_access(8, 1, [0, 3, 9], 4) == StateAccess(3, ((1, 9),))


def test_a_decode_inside_a_block_rewrites_its_running_state() -> None:
    """Token 9 reads and writes the page of block 2."""
    assert state_access(9, 1, [0, 0, 9], 4) == StateAccess(9, ((1, 9),))


def test_reading_a_released_block_is_an_error() -> None:
    """The block holding the state to resume from must be in the table."""
    with pytest.raises(StateContractError, match="after 8 tokens is in block 1"):
        state_access(8, 1, [0, 0, 9], 4)


def test_blocks_without_a_page_are_not_written() -> None:
    """A block the manager left null in the middle of a step gets no checkpoint."""
    assert state_access(0, 10, [0, 3, 9], 4) == StateAccess(None, ((8, 3), (10, 9)))


def test_a_step_must_end_in_a_page() -> None:
    """The running state needs the page of the block the step ends in."""
    with pytest.raises(StateContractError, match="block 2, where a step over positions"):
        state_access(4, 5, [3, 5, 0], 4)
