"""Gather buffers that outlive a step, so that each step does not fault in fresh memory.

Every layer gathers its keys and values into one buffer as large as the batch's K/V for
one layer (``2 * num_requests * num_kv_heads * key_len * head_dim`` elements). A freshly
allocated buffer of that size costs page faults on first touch, several times the gather
itself on a CPU; keeping one workspace per executor and passing it to every
``PagedMetadata.build`` pays that once instead of every step.
"""

from __future__ import annotations

import torch

from hybridkv.kernels.errors import KernelInputError


class GatherWorkspace:
    """One growable flat buffer per (dtype, device), lent to one attention call at a time.

    A buffer grows to ``headroom`` times the size asked for when it is too small (decode
    contexts grow a little every step), and never shrinks unless ``clear`` is called. Two
    ``paged_attention`` calls must not use one workspace at the same time.
    """

    def __init__(self, headroom: float = 1.25) -> None:
        if headroom < 1.0:
            raise KernelInputError(f"headroom must be >= 1.0, got {headroom}")
        self._headroom = headroom
        self._buffers: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}

    def get(self, num_elements: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A 1-D tensor of ``num_elements`` whose contents are undefined."""
        key = (dtype, torch.device(device))
        buf = self._buffers.get(key)
        # A buffer made under inference_mode cannot be written outside it: remake it then.
        stale = buf is not None and buf.is_inference() and not torch.is_inference_mode_enabled()
        if buf is None or buf.numel() < num_elements or stale:
            del buf  # drop the old buffer before allocating its replacement
            self._buffers.pop(key, None)
            buf = torch.empty(int(num_elements * self._headroom), dtype=dtype, device=device)
            self._buffers[key] = buf
        return buf[:num_elements]

    @property
    def nbytes(self) -> int:
        """Bytes held by all buffers."""
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    def clear(self) -> None:
        """Release every buffer."""
        self._buffers.clear()
