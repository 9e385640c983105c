"""The one exception family of hybridkv.

It lives in the lowest layer (``policies`` imports nothing of ours) so that every layer
above can raise and catch it. ``hybridkv.scheduler`` re-exports it for users.
"""

from __future__ import annotations


class HybridKVError(Exception):
    """Base class of every error hybridkv raises on bad input or a broken invariant."""


class PolicyError(HybridKVError, ValueError):
    """A memory policy was named or parametrised wrongly."""


class CapacityError(HybridKVError):
    """A request or layout can never fit, whatever else is freed."""
