"""The root of hybridkv's exceptions, in a package that imports nothing.

Every package of hybridkv may import it (``kernels`` included, which imports nothing
else of ours), so that one ``except HybridKVError`` catches whatever any layer raises on
bad input or a broken invariant. ``hybridkv.scheduler`` re-exports it for users.
"""

from __future__ import annotations


class HybridKVError(Exception):
    """Base class of every error hybridkv raises on bad input or a broken invariant."""


class CapacityError(HybridKVError):
    """A request or layout can never fit, whatever else is freed."""


__all__ = ["CapacityError", "HybridKVError"]
