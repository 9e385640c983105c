"""Errors of the processes behind parallel execution."""

from __future__ import annotations

from hybridkv.errors import HybridKVError


class PipelineError(HybridKVError):
    """A pipeline stage could not start, or failed while serving (see its message)."""
