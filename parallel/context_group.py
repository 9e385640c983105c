"""The context group of a rank, and the small values its attention layers pass around.

Every context-parallel rank of a pipeline stage belongs to one group (``open_context_group``
creates all of them in the same order on every process); ``ContextCounters`` counts what
the rank sends, for the benchmark. ``LayerCall`` and ``StoredKeys`` are what the step
(``context_attention``) hands the ring (``context_ring``).
"""

from __future__ import annotations

import attrs
import torch
import torch.distributed as dist

from hybridkv.parallel.rank_layout import ParallelConfig, new_groups


@attrs.frozen(eq=False)
class LayerCall:
    """One layer's call: its KV group and pages, scale, sliding window (None: full) and
    soft-cap."""

    group: int
    kv_cache: torch.Tensor
    scale: float
    sliding_window: int | None
    softcap: float | None


@attrs.define
class ContextCounters:
    """Bytes this rank sent for context parallelism: K/V around the ring, queries around
    the ring and partial outputs back (pass-Q), decode partials and hidden rows gathered."""

    ring_bytes: int = 0
    query_bytes: int = 0
    partial_bytes: int = 0
    gather_bytes: int = 0


@attrs.frozen(eq=False)
class ContextRanks:
    """This process's place among the context-parallel ranks of its pipeline stage.

    Attributes:
        group: Their process group.
        rank: This process's index in it.
        size: cp.
        counters: Bytes sent, for the benchmark.
    """

    group: dist.ProcessGroup
    rank: int
    size: int
    counters: ContextCounters = attrs.field(factory=ContextCounters)


def open_context_group(layout: ParallelConfig, rank: int) -> ContextRanks | None:
    """Create every context group of ``layout`` and return ``rank``'s; None without cp."""
    if layout.context == 1:
        return None
    group, ranks = new_groups(layout, rank, "context")
    return ContextRanks(group, ranks.index(rank), len(ranks))


@attrs.frozen(eq=False)
class StoredKeys:
    """Where some keys sit in this rank's pages, and whose they are."""

    pages: torch.Tensor
    offsets: torch.Tensor
    positions: torch.Tensor
    seqs: torch.Tensor

    @property
    def num_tokens(self) -> int:
        """Keys held."""
        return int(self.pages.numel())
