"""The tensor group of a rank, and what its layers send.

Every tensor-parallel rank of a pipeline stage (and context rank) belongs to one group
(``open_tensor_group`` creates all of them in the same order on every process); its
sharded layers (``tensor_layers``) count the bytes they reduce and gather, for the
benchmark.
"""

from __future__ import annotations

import attrs
import torch.distributed as dist

from hybridkv.parallel.rank_layout import ParallelConfig, new_groups


@attrs.define
class TensorCounters:
    """Bytes of this rank's tensors in the group's collectives: all-reduces (after
    attention, MLPs, experts, Mamba2 mixers and the embedding) and the logits gather,
    and the seconds spent in them (waiting for the slower rank included)."""

    reduced_bytes: int = 0
    gathered_bytes: int = 0
    num_reduces: int = 0
    collective_s: float = 0.0


@attrs.frozen(eq=False)
class TensorRanks:
    """This process's place in its tensor-parallel group.

    Attributes:
        group: The group's processes.
        rank: This process's index in it.
        size: tp.
        counters: Bytes sent, for the benchmark.
    """

    group: dist.ProcessGroup
    rank: int
    size: int
    counters: TensorCounters = attrs.field(factory=TensorCounters)


def open_tensor_group(layout: ParallelConfig, rank: int) -> TensorRanks | None:
    """Create every tensor group of ``layout`` and return ``rank``'s; None without tp."""
    if layout.tensor == 1:
        return None
    group, ranks = new_groups(layout, rank, "tensor")
    return TensorRanks(group, ranks.index(rank), len(ranks))


__all__ = ["TensorCounters", "TensorRanks", "open_tensor_group"]
