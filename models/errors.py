"""Errors of the model layer: checkpoints we cannot read, batches we cannot run."""

from __future__ import annotations

from hybridkv.errors import HybridKVError


class CheckpointError(HybridKVError, ValueError):
    """A checkpoint folder is missing a file, holds no safetensors, or has unknown weights."""


class ModelConfigError(HybridKVError, ValueError):
    """A config.json names an unsupported architecture or holds values we cannot honour."""


class BatchError(HybridKVError, ValueError):
    """A step batch does not match the executor's layout (groups, block tables, length)."""


class ParallelConfigError(HybridKVError, ValueError):
    """Parallel settings that cannot run: more stages than layers, unknown axes, bad sizes."""


class PipelineError(HybridKVError):
    """A pipeline stage could not start, or failed while serving (see its message)."""
