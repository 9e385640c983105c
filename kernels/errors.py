"""The error raised by the paged-attention kernels on malformed input.

``hybridkv.kernels`` imports nothing else of hybridkv (see design.md), so this error
cannot derive from ``HybridKVError``; it derives from ``ValueError`` so that callers
(the models layer) can catch it and re-raise it inside their own error family.
"""

from __future__ import annotations


class KernelInputError(ValueError):
    """Shapes, dtypes, lengths or block tables handed to a kernel are inconsistent."""
