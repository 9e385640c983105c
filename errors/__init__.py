"""The root every package of hybridkv may import: its exceptions, and (``events``) its
library logging.

This module imports nothing, so ``kernels`` (which imports nothing else of ours) may use
it, and one ``except HybridKVError`` catches whatever any layer raises on bad input or a
broken invariant. ``hybridkv.scheduler`` re-exports it for users.
"""

from __future__ import annotations


class HybridKVError(Exception):
    """Base class of every error hybridkv raises on bad input or a broken invariant."""


class CapacityError(HybridKVError):
    """A request or layout can never fit, whatever else is freed."""


__all__ = ["CapacityError", "HybridKVError"]
