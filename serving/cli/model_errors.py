"""What can go wrong finding a model by name: the errors ``builtin_models.py`` and
``hub.py`` raise (each a :class:`HybridKVError`: one line on stderr, exit status 2)."""

from __future__ import annotations

from hybridkv.errors import HybridKVError


class ModelNotFoundError(HybridKVError, ValueError):
    """A model name is neither a checkpoint folder, a built-in model nor a hub name in
    reach (in the cache, or on the hub while online)."""


class CacheDirError(HybridKVError, OSError):
    """The cache folder for converted built-in models cannot be written."""


class MissingExtraError(HybridKVError, RuntimeError):
    """A model needs packages that are not installed."""


__all__ = ["CacheDirError", "MissingExtraError", "ModelNotFoundError"]
