"""Errors of the executor: a step batch it cannot run."""

from __future__ import annotations

from hybridkv.errors import HybridKVError


class BatchError(HybridKVError, ValueError):
    """A step batch does not match the executor's layout (groups, block tables, length)."""
