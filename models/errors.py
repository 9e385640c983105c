"""Errors of the model layer: checkpoints and configs we cannot read, splits we cannot make."""

from __future__ import annotations

from hybridkv.errors import HybridKVError


class CheckpointError(HybridKVError, ValueError):
    """A checkpoint folder is missing a file, holds no safetensors, or has unknown weights."""


class ModelConfigError(HybridKVError, ValueError):
    """A config.json names an unsupported architecture or holds values we cannot honour."""


class ParallelConfigError(HybridKVError, ValueError):
    """Parallel settings that cannot run: more stages than layers, unknown axes, bad sizes.

    Defined beside the model because the first such error is a split of its layers
    (``stages``) that the executor makes too; ``hybridkv.parallel`` raises it as well.
    """
