"""Whether a float weight still lies on the grid of the quantised format it came from.

The built-in model is converted from a GGUF file whose tensors are stored at 4 to 8 bits
(Q4_K, Q5_0, Q6_K, Q8_0: per block of 16 or 32 inputs, ``w = step * q + offset``).
Dequantised to float32, a block's values still sit on its grid::

    block values     -0.30 -0.10  0.10 -0.30  0.50 ...    step 0.2, offset -0.30
    levels q         0     1      2     0     4    ...    q = (w - min) / step

Re-quantising such a tensor to 4 bits with fresh min-max scales adds error on top of
the file's own; a tensor already on a 4-bit grid of 32 packs losslessly instead, and one
on a finer grid (5, 6, 8 bits) keeps 8 bits rather than losing bits it was shipped with.
"""

from __future__ import annotations

import torch

#: Largest ratio tried between a group's smallest gap and its grid step.
_MAX_DIVISOR = 8
#: Rows checked before a whole tensor is (most float tensors fail on the first rows).
_SAMPLE_ROWS = 256


def grid_steps(weight: torch.Tensor, group: int) -> tuple[torch.Tensor, int] | None:
    """Per group of ``group`` inputs, the grid step its values lie on, and the number
    of levels the widest group uses; None where some group is on no grid.

    A group's step is the largest that puts all its values on levels: its smallest gap
    between distinct values divided by 1 to 8 (a multiple of the format's own step
    represents the values as exactly); a constant group has step 1.
    """
    groups = weight.detach().to(torch.float64).reshape(-1, group)
    low = groups.amin(1, keepdim=True)
    offsets = groups - low
    tolerance = 1e-5 * groups.abs().amax(1, keepdim=True) + 1e-30
    ordered = offsets.sort(1).values
    gaps = ordered[:, 1:] - ordered[:, :-1]
    gaps = torch.where(gaps > tolerance, gaps, torch.full_like(gaps, torch.inf))
    widest = gaps.amin(1, keepdim=True)
    widest = torch.where(torch.isinf(widest), torch.ones_like(widest), widest)
    # The smallest gap can be a multiple of the step (levels 0, 2, 5 have gaps 2 and 3):
    # per group, the largest step widest / k that puts every value on a level.
    steps = torch.zeros_like(widest)
    for k in range(_MAX_DIVISOR, 0, -1):
        candidate = widest / k
        fits = ((torch.round(offsets / candidate) * candidate - offsets).abs() <= tolerance).all(
            1, keepdim=True
        )
        steps = torch.where(fits, candidate, steps)
    if not bool((steps > 0).all()):
        return None
    return steps.squeeze(1).to(torch.float32), int(torch.round(offsets / steps).max()) + 1


def on_grid(weight: torch.Tensor, group: int, max_levels: int) -> bool:
    """Whether the first rows of ``weight`` lie on grids of at most ``max_levels`` levels
    per ``group`` inputs (the format a GGUF tensor came from, judged by a sample)."""
    found = grid_steps(weight[:_SAMPLE_ROWS], group)
    return found is not None and found[1] <= max_levels
