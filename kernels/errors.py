"""The error raised by the paged-attention kernels on malformed input."""

from __future__ import annotations

from hybridkv.errors import HybridKVError


class KernelInputError(HybridKVError, ValueError):
    """Shapes, dtypes, lengths or block tables handed to a kernel are inconsistent."""
