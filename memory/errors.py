"""Errors of the memory layer."""

from __future__ import annotations

from hybridkv.errors import CapacityError, HybridKVError


class LayoutError(HybridKVError, ValueError):
    """Layer specs or a byte budget from which no layout can be planned."""


class PromptTooLongError(CapacityError, ValueError):
    """A request needs more pages than the whole pool holds."""


__all__ = ["CapacityError", "LayoutError", "PromptTooLongError"]
