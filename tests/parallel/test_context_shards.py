"""Round-robin KV placement and the 2 x cp prefill chunks, against their definitions."""

from __future__ import annotations

import pytest

from hybridkv.models.errors import ParallelConfigError
from hybridkv.parallel.context_shards import KVInterleave, prefill_chunks, rank_positions


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
@pytest.mark.parametrize("unit", [1, 2, 4])
def test_each_rank_stores_its_tokens_in_order_one_page_per_virtual_block(cp, unit) -> None:
    """Owners deal units round-robin; local indices count each rank's tokens in order, and
    a virtual block's tokens land in the same page index on every rank."""
    place = KVInterleave(cp, block_size=4, unit=unit)
    seen: dict[int, list[int]] = {r: [] for r in range(cp)}
    for p in range(5 * place.virtual_block_size + 3):
        rank = place.owner(p)
        assert rank == (p // unit) % cp
        assert place.local_index(p) == len(seen[rank])
        assert place.position(rank, place.local_index(p)) == p
        assert place.local_index(p) // 4 == p // place.virtual_block_size
        seen[rank].append(p)
        for r in range(cp):
            assert place.num_local(p + 1, r) == len(seen[r])
    assert place.local_range(3, 11, 0) == range(place.num_local(3, 0), place.num_local(11, 0))


def test_an_interleave_that_does_not_divide_the_block_is_refused() -> None:
    """A unit of 3 tokens cannot fill 4-token pages evenly."""
    with pytest.raises(ParallelConfigError, match="must divide the block size 4"):
        KVInterleave(2, block_size=4, unit=3)


@pytest.mark.parametrize("num_tokens", [1, 3, 7, 8, 11, 64])
@pytest.mark.parametrize("cp", [1, 2, 4])
def test_chunks_cover_the_prompt_and_rank_0_runs_the_last_token(num_tokens, cp) -> None:
    """2cp contiguous chunks within a token of each other; every position computed once;
    the last token on rank 0."""
    chunks = prefill_chunks(5, num_tokens, cp)
    assert len(chunks) == 2 * cp
    assert [p for c in chunks for p in c] == list(range(5, 5 + num_tokens))
    assert max(map(len, chunks)) - min(map(len, chunks)) <= 1
    owned = [rank_positions(5, num_tokens, cp, r) for r in range(cp)]
    assert sorted(p for ps in owned for p in ps) == list(range(5, 5 + num_tokens))
    assert owned[0][-1] == 5 + num_tokens - 1
    assert owned[1 % cp] == [*chunks[1 % cp], *chunks[2 * cp - 1 - 1 % cp]]
