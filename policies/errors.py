"""The errors of memory policies."""

from __future__ import annotations

from hybridkv.errors import HybridKVError


class PolicyError(HybridKVError, ValueError):
    """A memory policy was named or parametrised wrongly."""
