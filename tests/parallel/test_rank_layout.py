"""The rank layout: every group of every axis combination against a brute-force definition."""

from __future__ import annotations

import itertools
import math

import pytest

from hybridkv.models.errors import ParallelConfigError
from hybridkv.parallel.rank_layout import AXES, ParallelConfig


def _shapes(limit: int) -> list[tuple[int, int, int, int]]:
    """Every (data, pipeline, context, tensor) with at most ``limit`` ranks."""
    sizes = range(1, limit + 1)
    return [s for s in itertools.product(sizes, repeat=4) if math.prod(s) <= limit]


def _brute_force(shape: tuple[int, ...], axes: tuple[str, ...]) -> list[list[int]]:
    """Ranks grouped by their coordinates off ``axes``, ranks numbered row-major."""
    coords = list(itertools.product(*(range(n) for n in shape)))  # rank r -> coords[r]
    moving = {AXES.index(a) for a in axes}
    groups: dict[tuple[int, ...], list[int]] = {}
    for rank, c in enumerate(coords):
        key = tuple(v for i, v in enumerate(c) if i not in moving)
        groups.setdefault(key, []).append(rank)
    return sorted(groups.values())


AXIS_SETS = [combo for n in range(1, 5) for combo in itertools.combinations(AXES, n)]


def test_every_group_matches_brute_force_up_to_16_ranks() -> None:
    """For every shape up to 16 ranks and every set of axes, the groups are the definition's."""
    shapes = _shapes(16)
    assert len(shapes) > 200
    for shape in shapes:
        config = ParallelConfig(data=shape[0], pipeline=shape[1], context=shape[2], tensor=shape[3])
        for axes in AXIS_SETS:
            assert config.group_ranks(*axes) == _brute_force(shape, axes), (shape, axes)


def test_groups_of_one_kind_partition_the_world() -> None:
    """Each kind of group holds every rank exactly once, in groups of the axes' size."""
    config = ParallelConfig(data=2, pipeline=2, context=2, tensor=2)
    for axes in AXIS_SETS:
        groups = config.group_ranks(*axes)
        assert sorted(r for g in groups for r in g) == list(range(16))
        size = math.prod(config.shape[AXES.index(a)] for a in axes)
        assert {len(g) for g in groups} == {size}


def test_seed_003_transpose_reshape_mixes_context_into_expert_groups() -> None:
    """vLLM's ``transpose(1, 2).reshape(-1, dp * tp)`` is wrong once cp > 1; ours is not."""
    config = ParallelConfig(data=2, pipeline=1, context=2, tensor=2)
    grid = config.rank_grid()
    vllm = grid.transpose(0, 1).reshape(-1, config.data * config.tensor).tolist()
    expected = _brute_force(config.shape, ("data", "tensor"))
    assert expected == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert sorted(map(sorted, vllm)) != expected  # [0, 1, 2, 3] mixes context ranks
    assert config.group_ranks("data", "tensor") == expected
    assert config.group_ranks("tensor", "data") == expected


def test_coordinates_and_group_of_agree_with_the_grid() -> None:
    """A rank's coordinates index it in the grid; group_of finds the group holding it."""
    config = ParallelConfig(pipeline=3, tensor=2)
    assert config.coordinates(5) == {"data": 0, "pipeline": 2, "context": 0, "tensor": 1}
    assert config.group_of(5, "pipeline") == [1, 3, 5]
    assert config.group_of(5, "tensor") == [4, 5]


@pytest.mark.parametrize(
    ("kwargs", "axes", "message"),
    [
        ({"pipeline": 0}, (), "pipeline parallel size must be an int >= 1, got 0"),
        ({}, ("expert",), "axes must be distinct names"),
        ({}, ("data", "data"), "axes must be distinct names"),
        ({}, (), "at least one"),
    ],
)
def test_bad_sizes_and_axes_are_refused(
    kwargs: dict[str, int], axes: tuple[str, ...], message: str
) -> None:
    """A size below one, an unknown axis, a repeated axis or no axis raise, naming it."""
    with pytest.raises(ParallelConfigError, match=message):
        ParallelConfig(**kwargs).group_ranks(*axes)


def test_a_rank_outside_the_world_is_refused() -> None:
    """coordinates() names the rank and the world size."""
    with pytest.raises(ParallelConfigError, match="rank 4 is outside a world of 4"):
        ParallelConfig(pipeline=4).coordinates(4)


def test_errors_name_a_rank_by_its_place() -> None:
    """A stage alone is named as a stage; beside context or tensor ranks, a rank is named
    with its coordinates on every axis of more than one rank."""
    assert ParallelConfig(pipeline=3).describe(2) == "pipeline stage 2"
    assert ParallelConfig(tensor=2).describe(1) == "rank 1 (tensor rank 1)"
    layout = ParallelConfig(pipeline=2, context=2, tensor=2)
    assert layout.describe(5) == "rank 5 (stage 1, context rank 0, tensor rank 1)"
