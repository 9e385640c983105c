"""Where each rank sits on the data, pipeline, context and tensor axes, and its groups.

Every process group is cut from one tensor of ranks, ``arange(world).view(dp, pp, cp, tp)``
(the outermost axis first, tensor parallelism innermost so its ranks are neighbours)::

    dp=1, pp=2, cp=2, tp=2          tensor groups    [0 1] [2 3] [4 5] [6 7]
    pipeline 0   cp0: 0 1           context groups   [0 2] [1 3] [4 6] [5 7]
                 cp1: 2 3           pipeline groups  [0 4] [1 5] [2 6] [3 7]
    pipeline 1   cp0: 4 5
                 cp1: 6 7

A group over some axes is the ranks that differ only in those coordinates. To cut them,
the group's axes are permuted to the end and the tensor is reshaped: a reshape then
only ever merges axes of the group. Seed 003 shows what happens otherwise: vLLM built
its expert groups (data x tensor) with ``transpose(1, 2).reshape(-1, dp * tp)``, which
leaves the context axis between data and tensor and mixes context ranks into the groups
as soon as ``cp > 1``. ``tests/parallel/test_rank_layout.py`` holds every group of every
axis combination, for every shape up to 16 ranks, against the definition above.
"""

from __future__ import annotations

import math
from typing import Any

import attrs
import torch
import torch.distributed as dist

from hybridkv.models.errors import ParallelConfigError

#: The axes, outermost first.
AXES = ("data", "pipeline", "context", "tensor")


def _at_least_one(_: object, attribute: attrs.Attribute[int], value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ParallelConfigError(
            f"{attribute.name} parallel size must be an int >= 1, got {value!r}"
        )


@attrs.frozen(kw_only=True)
class ParallelConfig:
    """The sizes of the four parallel axes; their product is the world size.

    Attributes:
        data: Data-parallel replicas (independent engines, or expert groups with tensor).
        pipeline: Pipeline stages, each holding a contiguous run of layers.
        context: Context-parallel ranks, sharing one request's tokens.
        tensor: Tensor-parallel ranks, sharing each layer's heads.
    """

    data: int = attrs.field(default=1, validator=_at_least_one)
    pipeline: int = attrs.field(default=1, validator=_at_least_one)
    context: int = attrs.field(default=1, validator=_at_least_one)
    tensor: int = attrs.field(default=1, validator=_at_least_one)

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """The axis sizes in :data:`AXES` order."""
        return (self.data, self.pipeline, self.context, self.tensor)

    @property
    def world_size(self) -> int:
        """Ranks in all."""
        return math.prod(self.shape)

    def rank_grid(self) -> torch.Tensor:
        """The one tensor of ranks, ``[data, pipeline, context, tensor]``."""
        return torch.arange(self.world_size).view(self.shape)

    def group_ranks(self, *axes: str) -> list[list[int]]:
        """Every group spanning ``axes``: ranks equal in every other coordinate.

        Groups come in rank order of their first member, members in rank order (the
        order of ``axes`` does not matter). ``group_ranks("data", "tensor")`` are the
        expert-parallel groups; ``group_ranks(*AXES)`` is the whole world.

        Raises:
            ParallelConfigError: an unknown axis, an axis named twice, or none.
        """
        moved = self._axis_indices(axes)
        kept = [i for i in range(len(AXES)) if i not in moved]
        size = math.prod(self.shape[i] for i in moved)
        # Permute the group's axes innermost, in their canonical order, then merge only them.
        grid = self.rank_grid().permute(*kept, *moved)
        return grid.reshape(-1, size).tolist()

    def group_of(self, rank: int, *axes: str) -> list[int]:
        """The group spanning ``axes`` that holds ``rank``."""
        self._check_rank(rank)
        for group in self.group_ranks(*axes):
            if rank in group:
                return group
        raise AssertionError("every rank is in exactly one group of each kind")

    def coordinates(self, rank: int) -> dict[str, int]:
        """``rank``'s index on each axis."""
        self._check_rank(rank)
        coords = torch.nonzero(self.rank_grid() == rank)[0].tolist()
        return dict(zip(AXES, coords, strict=True))

    def describe(self, rank: int) -> str:
        """How errors name ``rank``: ``pipeline stage 2`` where stages are the only axis,
        else ``rank 3 (stage 1, tensor rank 1)`` with every axis of more than one rank."""
        coords = self.coordinates(rank)
        if self.shape == (1, self.pipeline, 1, 1):
            return f"pipeline stage {rank}"
        named = {"pipeline": "stage", "context": "context rank", "tensor": "tensor rank"}
        sizes = dict(zip(AXES, self.shape, strict=True))
        places = [f"{named[axis]} {coords[axis]}" for axis in named if sizes[axis] > 1]
        return f"rank {rank} ({', '.join(places)})"

    def _axis_indices(self, axes: tuple[str, ...]) -> list[int]:
        unknown = [a for a in axes if a not in AXES]
        if unknown or not axes or len(set(axes)) != len(axes):
            raise ParallelConfigError(
                f"axes must be distinct names among {AXES}, at least one; got {axes}"
            )
        return sorted(AXES.index(a) for a in axes)

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ParallelConfigError(f"rank {rank} is outside a world of {self.world_size}")


def new_groups(
    layout: ParallelConfig, rank: int, *axes: str, **options: Any
) -> tuple[dist.ProcessGroup, list[int]]:
    """Create every process group over ``axes`` of ``layout`` (each process must create
    all of them, in the same order, as ``torch.distributed`` requires); return ``rank``'s
    and its members. ``options`` go to ``dist.new_group`` (backend, timeout)."""
    mine: tuple[dist.ProcessGroup, list[int]] | None = None
    for ranks in layout.group_ranks(*axes):
        group: dist.ProcessGroup = dist.new_group(ranks, **options)
        if rank in ranks:
            mine = (group, ranks)
    assert mine is not None, "every rank is in one group over any axes"
    return mine
