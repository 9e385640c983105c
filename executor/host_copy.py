"""The step loop's device->host copies: each one a step makes goes through here.

On a GPU, reading a device tensor on the host (``tolist``, ``item``, ``bool(t)``,
``.cpu()``) waits for every kernel queued before it, so a step keeps the device busy
only if it reads back as little, as rarely, as it can::

    to_host_list     the sampled token ids: once per step, with a flag per row that
                     top-k/top-p candidates could not decide (drawn again and read
                     back again: rare, executor/draw.py); once per request verifying
                     proposals greedily
    to_host_rows     log-probabilities a request asked for: values the user sees
    to_host_tensor   the distributions a sampled request's proposals are verified
                     against (speculative decoding: the rejection rule runs on the host,
                     proposal by proposal, with the request's CPU generator)

Anything else a step reads back is a bug; ``hybridkv.testing.host_copies`` counts the
calls here as allowed and every other read of a device tensor as one.
"""

from __future__ import annotations

import torch


def to_host_list(values: torch.Tensor) -> list[int]:
    """The integers of a 1-D tensor (sampled token ids), as Python ints."""
    ids: list[int] = values.tolist()
    return ids


def to_host_rows(values: torch.Tensor) -> list[list[float]]:
    """The rows of a 2-D tensor (log-probabilities a request asked for), as Python floats."""
    rows: list[list[float]] = values.tolist()
    return rows


def to_host_tensor(values: torch.Tensor) -> torch.Tensor:
    """``values`` on the host (themselves where they already are)."""
    return values.cpu()
