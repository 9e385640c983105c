"""Attention masks from live spans: the generic path, for keys that are not one window.

A layer whose keys are not one window ending at the query (sinks plus a window, chunks, a
user's own memory policy) says which keys a query at position ``p`` reads as
``live_spans(p)``: sorted, disjoint spans inside ``[0, p)``, the positions that must still
be resident to compute p. The query also reads its own key, written in the same step.

Per request, the keys gathered run from the page of the first key any of its queries
reads to its last page; pages that no query reads may be the null block (the allocator
released them), so they are zeroed after the gather and masked out::

    positions  0 1 2 3 | 4 5 6 7 | 8 9 . .     block_size=4, sinks 2 + window 3
    table      [ b3  ] | [null ] | [ b5  ]     queries at 8 and 9 (a chunk of 2)
    query 8    x x . . | . . x x | x . . .     live_spans(8) = (0, 2), (6, 8)
    query 9    x x . . | . . . x | x x . .     live_spans(9) = (0, 2), (7, 9)

This module knows nothing of policies: it takes any callable with that contract.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import attrs
import torch

from hybridkv.kernels.errors import KernelInputError

#: Position p -> the spans ``[start, end)`` of earlier positions its query reads.
LiveSpans = Callable[[int], Sequence[tuple[int, int]]]


@attrs.frozen(eq=False)
class SpanMasks:
    """Per request of one step, which keys each of its queries reads.

    Attributes:
        key_start: ``[num_requests]`` int64, the first position any query of a request reads.
        allowed: Per request, ``[query_len, num_pages * block_size]`` bool: whether query i
            reads the key at position ``first_page * block_size + j``, where ``first_page``
            holds ``key_start`` and the pages run to the one holding the last position.
    """

    key_start: torch.Tensor
    allowed: tuple[torch.Tensor, ...]

    @classmethod
    def build(
        cls,
        live_spans: LiveSpans,
        query_lens: Sequence[int],
        context_lens: Sequence[int],
        block_size: int,
    ) -> SpanMasks:
        """Ask ``live_spans`` for every query position of the step and lay out the masks.

        Raises:
            KernelInputError: spans that are unsorted, overlap or leave ``[0, p)``.
        """
        key_starts, allowed = [], []
        for q_len, ctx in zip(query_lens, context_lens, strict=True):
            rows, starts, ends = _spans(live_spans, range(ctx - q_len, ctx))
            key_start = min(starts)
            base = key_start // block_size * block_size
            key_len = ((ctx - 1) // block_size + 1) * block_size - base
            # +1 where a span starts, -1 where it ends: a running sum > 0 is inside a span.
            edges = torch.zeros(q_len, key_len + 1, dtype=torch.int32)
            row_index = torch.tensor(rows)
            ones = torch.ones(len(rows), dtype=torch.int32)
            edges.index_put_((row_index, torch.tensor(starts) - base), ones, accumulate=True)
            edges.index_put_((row_index, torch.tensor(ends) - base), -ones, accumulate=True)
            allowed.append(edges.cumsum(dim=1)[:, :key_len] > 0)
            key_starts.append(key_start)
        return cls(torch.tensor(key_starts, dtype=torch.long), tuple(allowed))

    def visible(self, request_ids: Sequence[int], key_len: int) -> torch.Tensor:
        """``[len(request_ids), key_len]``: keys some query of each request reads.

        Rows are right-padded with False up to ``key_len`` (a region's padded length).
        """
        out = torch.zeros(len(request_ids), key_len, dtype=torch.bool)
        for row, i in enumerate(request_ids):
            out[row, : self.allowed[i].shape[1]] = self.allowed[i].any(dim=0)
        return out

    def mask(self, request_id: int, key_len: int) -> torch.Tensor:
        """``[query_len, key_len]``: the keys each query of one request reads, padded."""
        allowed = self.allowed[request_id]
        out = torch.zeros(allowed.shape[0], key_len, dtype=torch.bool)
        out[:, : allowed.shape[1]] = allowed
        return out


def _spans(live_spans: LiveSpans, positions: range) -> tuple[list[int], list[int], list[int]]:
    """Rows (query index), starts and ends of every span read, each query's own key included."""
    rows, starts, ends = [], [], []
    for row, p in enumerate(positions):
        last = 0
        for start, end in live_spans(p):
            if not last <= start <= end <= p:
                raise KernelInputError(
                    f"live_spans({p}) returned {tuple(live_spans(p))}; spans must be "
                    f"sorted, disjoint and inside [0, {p})"
                )
            if start == end:
                continue  # an empty span reads nothing; tolerated, as the allocator does
            rows.append(row)
            starts.append(start)
            ends.append(end)
            last = end
        rows.append(row)
        starts.append(p)
        ends.append(p + 1)
    return rows, starts, ends
